"""GPT-OSS against transformers (eager attention, float32) on tiny random models: attention with biases and learned
sink logits, sliding and full layers alternating, YaRN, a biased router, experts with biases and the clamped SwiGLU;
the BF16 checkpoint layout and the MXFP4 one (experts widened at load); every attention backend that takes sinks;
the scheduler with chunked prefill and the prefix cache; TP=2; the experts' kernel under Triton's interpreter."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def gpt_oss(path: str, seed: int = 0, save: bool = True) -> torch.nn.Module:
    """A tiny GPT-OSS whose every term shows in its greedy tokens: experts strong enough to pass the clamp
    (swiglu_limit 1.5), sharper attention, embeddings and logits spread."""
    hf = make_tiny_model("gpt_oss", path, seed=seed)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(("gate_up_proj", "down_proj")):
                p.mul_(15.0)
            if name.endswith(("q_proj.weight", "k_proj.weight")):
                p.mul_(4.0)
            if name.endswith("embed_tokens.weight"):
                p.mul_(30.0)
            if name == "lm_head.weight":
                p.mul_(10.0)
            if name.endswith("sinks"):  # sinks that take a real share of each row's mass
                p.copy_(torch.randn_like(p) + 3.0)
    if save:
        hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("backend", ["cpu", "torch_native", "flex", "triton"])  # triton: interpreted on the CPU
def test_greedy_matches_transformers(backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = gpt_oss(str(tmp_path))
    steps = 6 if backend in ("triton", "flex") else 12  # the interpreter / eager flex are slow on the CPU
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, steps) == [hf_greedy(hf, p, steps) for p in PROMPTS]


def test_sinks_clamp_and_biases_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with the sinks, the SwiGLU clamp or the experts' biases left out."""
    hf = gpt_oss(str(tmp_path))
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    changes = {"sinks": lambda: [lay.self_attn.sinks.fill_(-1e4) for lay in hf.model.layers],
               "clamp": lambda: [setattr(lay.mlp.experts, "limit", 1e4) for lay in hf.model.layers],
               "bias": lambda: [lay.mlp.experts.gate_up_proj_bias.zero_() for lay in hf.model.layers]}
    for what, change in changes.items():
        saved = {k: v.clone() for k, v in hf.state_dict().items()}
        with torch.no_grad():
            change()
        assert [hf_greedy(hf, p, 12) for p in PROMPTS] != want, what
        hf.load_state_dict(saved)
        for lay in hf.model.layers:
            lay.mlp.experts.limit = hf.config.swiglu_limit


def mxfp4_checkpoint(hf: torch.nn.Module, path: str, seed: int = 0) -> None:
    """Give `hf` experts that MXFP4 represents exactly (random 4-bit codes and power-of-two group scales) and
    save it in OpenAI's layout: `*_blocks` / `*_scales` in place of the experts' matrices, quant_method mxfp4."""
    from safetensors.torch import load_file, save_file
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    g = torch.Generator().manual_seed(seed)
    hf.save_pretrained(path)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for i, layer in enumerate(hf.model.layers):
        experts = layer.mlp.experts
        for name in ("gate_up_proj", "down_proj"):
            param = getattr(experts, name)  # [E, K, N] (input-major); MXFP4 stores [E, N, K / 32, 16]
            e, k, n = param.shape
            blocks = torch.randint(0, 256, (e, n, k // 32, 16), generator=g, dtype=torch.uint8)
            scales = torch.randint(123, 128, (e, n, k // 32), generator=g, dtype=torch.uint8)
            with torch.no_grad():
                param.copy_(convert_moe_packed_tensors(blocks, scales, dtype=torch.float32))
            key = f"model.layers.{i}.mlp.experts.{name}"
            del tensors[key]
            tensors[f"{key}_blocks"], tensors[f"{key}_scales"] = blocks, scales
    save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        config = json.load(f)
    config["quantization_config"] = {"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]}
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)


def test_mxfp4_checkpoint_matches_transformers(tmp_path) -> None:  # noqa: ANN001
    """The experts' 4-bit blocks and scales widened at load (the model then served unquantized) give the tokens of
    transformers' model holding the same values (its own MXFP4 dequantisation)."""
    from radixserve.models.gpt_oss import dequantize_mxfp4

    hf = gpt_oss(str(tmp_path), save=False)  # (its widths, 64, are multiples of the 32-column MXFP4 group)
    mxfp4_checkpoint(hf, str(tmp_path))
    runner = make_runner(str(tmp_path))
    assert runner.model_config.hf_config.quantization_config["quant_method"] == "mxfp4"
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    # the widening on its own: nibble order and scale bias, against transformers'
    from transformers.integrations.mxfp4 import convert_moe_packed_tensors

    blocks = torch.randint(0, 256, (2, 3, 4, 16), dtype=torch.uint8)
    scales = torch.randint(100, 140, (2, 3, 4), dtype=torch.uint8)
    torch.testing.assert_close(dequantize_mxfp4(blocks, scales, torch.float32),
                               convert_moe_packed_tensors(blocks, scales, dtype=torch.float32).transpose(1, 2),
                               atol=0, rtol=0)


def test_mxfp4_refusals(tmp_path) -> None:  # noqa: ANN001
    from radixserve.models.gpt_oss import dequantize_mxfp4

    with pytest.raises(ValueError, match="do not match scales"):
        dequantize_mxfp4(torch.zeros(2, 4, 16, dtype=torch.uint8), torch.zeros(2, 3, dtype=torch.uint8),
                         torch.float32)
    hf = gpt_oss(str(tmp_path), save=False)
    mxfp4_checkpoint(hf, str(tmp_path))
    with pytest.raises(ValueError, match="widened to the model dtype at load"):
        make_runner(str(tmp_path), quantization="fp8")


def test_expert_kernel_matches_transformers_experts() -> None:
    """The grouped and small-batch Triton kernels (interpreted) and the torch path with the biases and the clamped
    SwiGLU against transformers' GptOssExperts, through the checkpoint-to-stacked layout change the loader makes."""
    import transformers as tf
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssExperts

    from radixserve.layers.moe.activation import ExpertActivation, ExpertBias
    from radixserve.layers.moe.fused_moe import MoEConfig, fused_moe
    from radixserve.layers.moe.moe_torch import moe_forward_torch
    from radixserve.layers.moe.small_batch import small_batch_moe
    from radixserve.models.gpt_oss import deinterleave_rows

    torch.manual_seed(0)
    cfg = tf.GptOssConfig(hidden_size=32, intermediate_size=24, num_local_experts=6, num_experts_per_tok=2,
                          swiglu_limit=0.5)
    ref_experts = GptOssExperts(cfg).float()
    ref_experts.limit = cfg.swiglu_limit  # transformers before 5.18 fix it at 7.0, whatever the config says
    with torch.no_grad():
        for p in ref_experts.parameters():
            p.normal_(0.0, 0.3)
    x = torch.randn(9, 32)
    ids = torch.stack([torch.randperm(6)[:2] for _ in range(9)])
    weights = torch.rand(9, 2)
    with torch.no_grad():
        want = ref_experts(x, ids, weights)
    w13 = deinterleave_rows(ref_experts.gate_up_proj.data.transpose(1, 2)).contiguous()
    w2 = ref_experts.down_proj.data.transpose(1, 2).contiguous()
    bias = ExpertBias(deinterleave_rows(ref_experts.gate_up_proj_bias.data).contiguous(),
                      ref_experts.down_proj_bias.data.contiguous())
    act = ExpertActivation("swiglu_oai", ref_experts.alpha, cfg.swiglu_limit)
    ids32 = ids.to(torch.int32)
    torch.testing.assert_close(moe_forward_torch(x, w13, w2, weights, ids32, act=act, bias=bias), want,
                               atol=1e-5, rtol=1e-5)
    for config in (None, MoEConfig(16, 8, 16, 16, 1, 1)):
        torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids32, config=config, act=act, bias=bias), want,
                                   atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(small_batch_moe(x[:3], w13, w2, weights[:3], ids32[:3], act=act, bias=bias), want[:3],
                               atol=1e-5, rtol=1e-5)
    assert not torch.allclose(moe_forward_torch(x, w13, w2, weights, ids32, bias=bias), want, atol=1e-2)


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    """Chunks of 5 tokens and prompts sharing cached prefixes longer than the window (5)."""
    hf = gpt_oss(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_fp8_keeps_the_biased_experts_in_the_model_dtype(tmp_path) -> None:  # noqa: ANN001
    """--quantization fp8 quantizes the attention projections; the experts (biases, clamped SwiGLU) stay 16-bit,
    and no quantization method can be given to them."""
    from radixserve.layers.moe.methods import UnquantizedMoEMethod
    from radixserve.layers.quantization.fp8 import Fp8Config

    gpt_oss(str(tmp_path))
    runner = make_runner(str(tmp_path), quantization="fp8", dtype_override="bfloat16")
    layer = runner.model.model.layers[0]
    assert type(layer.mlp.experts.quant_method) is UnquantizedMoEMethod
    assert layer.mlp.experts.w13_weight.dtype == torch.bfloat16
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float8_e4m3fn
    assert StaticBatch(runner).generate(PROMPTS[:1], 4)[0]  # it serves
    fp8_moe = Fp8Config.from_config({}, serialized=False).get_quant_method(layer.mlp.experts, "model.layers.0.mlp")
    with pytest.raises(ValueError, match="served in the model dtype only"):
        layer.mlp.experts.set_quant_method(fp8_moe)


def _ranks(path: str, monkeypatch: pytest.MonkeyPatch, ep: int) -> list[dict[str, torch.Tensor]]:
    """Dummy-weighted parameters of TP=1, then of each rank of TP=2 (--ep-size `ep`), built in this process."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.moe import layer as moe_layer
    from radixserve.model_loader.dummy import initialize_dummy_weights
    from radixserve.models.gpt_oss import GptOssForCausalLM

    cfg = ModelConfig(path).hf_config
    out = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        monkeypatch.setattr(moe_layer, "get_expert_parallel_size", lambda size=size: ep if size > 1 else 1)
        model = GptOssForCausalLM(cfg, rank, size)
        initialize_dummy_weights(model)
        out.append(dict(model.named_parameters()))
    return out


@pytest.mark.parametrize("ep", [1, 2])
def test_dummy_weights_do_not_depend_on_the_tp_split(ep: int, tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """--load-format dummy draws each layer's sinks whole and gives each rank its heads' slice (not a draw of its
    own); the experts' biases are their ranks' slices (TP: gate/up rows, the down bias on rank 0 alone; EP: whole
    experts)."""
    gpt_oss(str(tmp_path))
    whole, rank0, rank1 = _ranks(str(tmp_path), monkeypatch, ep)
    sinks = "model.layers.1.self_attn.attn.sinks"
    assert torch.equal(torch.cat([rank0[sinks], rank1[sinks]]), whole[sinks])
    w13, w2 = "model.layers.0.mlp.experts.w13_bias", "model.layers.0.mlp.experts.w2_bias"
    if ep == 1:
        halves = [r[w13].chunk(2, dim=1) for r in (rank0, rank1)]
        assert torch.equal(torch.cat([halves[0][0], halves[1][0], halves[0][1], halves[1][1]], 1), whole[w13])
        assert torch.equal(rank0[w2], whole[w2]) and not rank1[w2].any()
    else:
        for name in (w13, w2):
            assert torch.equal(torch.cat([rank0[name], rank1[name]]), whole[name])


@pytest.mark.parametrize("ep", [1, 2])
def test_biased_experts_split_over_ranks_sum_to_the_whole(ep: int) -> None:
    """The experts loaded from one checkpoint tensor on each of two TP ranks (their intermediate slices, the down
    bias on rank 0) or EP ranks (half the experts each, with their biases): the ranks' partial outputs, which the
    all-reduce adds, sum to the one-rank output."""
    from radixserve.layers.moe import FusedMoE, RouterConfig
    from radixserve.layers.moe.activation import ExpertActivation

    torch.manual_seed(0)
    act = ExpertActivation("swiglu_oai", 1.702, 0.8)
    full = {"w13_weight": torch.randn(4, 48, 16), "w2_weight": torch.randn(4, 16, 24), "w13_bias": torch.randn(4, 48),
            "w2_bias": torch.randn(4, 16)}
    x = torch.randn(7, 16)
    ids = torch.stack([torch.randperm(4)[:2] for _ in range(7)]).to(torch.int32)
    weights = torch.rand(7, 2)

    def out(rank: int, size: int) -> torch.Tensor:
        layer = FusedMoE(RouterConfig(4, 2), 16, 24, rank, size, ep_size=ep if size > 1 else 1,
                         reduce_results=False, activation=act, bias=True)
        for name, t in full.items():
            getattr(layer, name).weight_loader(getattr(layer, name), t, None)
        return layer.run_experts(x, weights, ids)

    torch.testing.assert_close(out(0, 2) + out(1, 2), out(0, 1), atol=1e-5, rtol=1e-5)


def test_bad_configs_gguf_and_expert_lora_are_refused(tmp_path) -> None:  # noqa: ANN001
    """swiglu_limit 0 (not the default in its place), a layer type served as another, sinks of another head count,
    a GGUF file of the architecture (its config transformers reads; its tensors no loader here maps), and a PEFT
    adapter on the stacked experts (`target_parameters`) are refused with their reason."""

    from radixserve.configs.model_config import ModelConfig
    from radixserve.lora.config import LoRAConfig
    from radixserve.models.gpt_oss import GptOssForCausalLM

    path = str(tmp_path / "m")
    gpt_oss(path)
    cfg = ModelConfig(path).hf_config
    model = GptOssForCausalLM(cfg)
    with pytest.raises(ValueError, match="self_attn.sinks: attention sinks of shape \\(3,\\); expected \\(4,\\)"):
        model.load_weight(dict(model.named_parameters()), "model.layers.0.self_attn.sinks", torch.zeros(3))
    for key, value, match in (("swiglu_limit", 0.0, "swiglu_limit must be > 0; got 0.0"),
                              ("layer_types", ["sliding_attention", "chunked_attention"], "chunked_attention")):
        bad = ModelConfig(path).hf_config
        setattr(bad, key, value)
        with pytest.raises(ValueError, match=match):
            GptOssForCausalLM(bad)
    cfg.swiglu_alpha = 0.0  # a value of the config's own, served as such
    assert GptOssForCausalLM(cfg).model.layers[0].mlp.experts.activation.alpha == 0.0
    file = stub_gguf(str(tmp_path / "gpt-oss.gguf"), "gpt-oss")
    with pytest.raises(ValueError, match="GGUF files of GPT-OSS are not supported"):
        ModelConfig(file)
    adapter = tmp_path / "adapter"
    adapter.mkdir()
    (adapter / "adapter_config.json").write_text(json.dumps(
        {"peft_type": "LORA", "r": 4, "target_modules": ["q_proj"], "target_parameters": ["mlp.experts.down_proj"]}))
    with pytest.raises(ValueError, match="target_parameters .* not supported"):
        LoRAConfig.from_folder(str(adapter))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads (and their sinks), the experts' intermediate slices and the down bias (added by rank 0 alone)."""
    path = str(tmp_path)
    gpt_oss(path, seed=4)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
