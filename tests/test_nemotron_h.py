"""NVIDIA Nemotron-H (`NemotronHForCausalLM`) against transformers in float32 on a tiny random model with the three
layer kinds (Mamba2 in two groups of heads, attention without rotation, relu2 MLP): greedy tokens on the CPU
backends (a prompt longer than the scan's chunk), prefill logits; through the scheduler with 5-token chunks, with and
without the prefix cache; prefix-cache hits request by request. Also that the Mamba2 state decides tokens, the KV
layer count (only the attention layers), the layer kinds read from the pattern, and what the model refuses.
Nemotron 3's MoE layers ("E": grouped sigmoid routing with a correction bias, non-gated relu2 experts, a shared MLP,
with and without the latent projection) the same way, and their weights from transformers 5's stacked names."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

import pytest
import torch
from model_utils import hf_greedy, make_runner
from parallel_utils import tp2_and_tp1_outputs
from test_granite_hybrid import check_logits, check_scheduler_waves, check_state_matters
from test_hybrid_prefix_cache import check_hits

from radixserve.bench_one_batch import StaticBatch
from radixserve.layers.mamba2 import CHUNK, NEMOTRON_H, Mamba2Mixer

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [2, 3, 4], list(range(30, 110))]  # 80 > CHUNK
PATTERN = "M*-M-*M"  # Mamba2 at 0, 3, 6; attention at 1, 5; MLP at 2, 4
COMMON = dict(vocab_size=256, hidden_size=64, intermediate_size=96, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=512, layer_norm_epsilon=1e-5, mamba_num_heads=8, mamba_head_dim=16,
              n_groups=2, ssm_state_size=16, conv_kernel=4, chunk_size=16, tie_word_embeddings=False,
              pad_token_id=0, initializer_range=0.1, rescale_prenorm_residual=False)


def _config(pattern: str = PATTERN, **kw: Any) -> Any:
    import transformers as tf

    return tf.NemotronHConfig(**{**COMMON, "hybrid_override_pattern": pattern, **kw})


# Nemotron 3's MoE layers, tiny: 8 experts in 4 groups, the best 2 groups eligible, top-3
MOE_PATTERN = "M*EM-E"  # Mamba2 at 0, 3; attention at 1; MoE at 2, 5; MLP at 4
MOE = dict(n_routed_experts=8, num_experts_per_tok=3, moe_intermediate_size=32, moe_shared_expert_intermediate_size=48,
           n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=True)


def nemotron_h(path: str, seed: int = 0, pattern: str = PATTERN, **kw: Any) -> torch.nn.Module:
    """A tiny Nemotron-H saved at `path`; norms and D away from their initial values, the Mamba2 decays slow so that
    the state carries far. `kw`: config overrides (a MoE's); its routers get a correction bias large enough to change
    choices."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = _config(pattern, **kw)
    cfg._attn_implementation = "eager"
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".D"):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("A_log"):  # slow decays (A near -0.15, dt near 0.5): a long memory in the state
                p.copy_(torch.randn_like(p) * 0.5 - 2.0)
            if name.endswith("dt_bias"):
                p.copy_(torch.randn_like(p) * 0.3 - 0.5)
            if name.endswith("mixer.out_proj.weight"):
                p.mul_(4.0)  # the Mamba2 layers' share of the residual stream well above the others'
            if name == "lm_head.weight":
                p.mul_(4.0)  # clear margins between the top tokens
            if name.endswith("experts.down_proj"):
                p.mul_(3.0)  # the routed experts' share well above the rounding
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.2)
    hf.save_pretrained(path)
    return hf


def nemotron_h_moe(path: str, latent: int | None = None, norm: bool = True, seed: int = 0) -> torch.nn.Module:
    return nemotron_h(path, seed, MOE_PATTERN, **{**MOE, "moe_latent_size": latent, "norm_topk_prob": norm})


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = nemotron_h(str(tmp_path))
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert type(runner.model).__name__ == "NemotronHForCausalLM"
    assert runner.model_config.linear_attention_layers == [0, 3, 6] and runner.model_config.kv_layer_count == 2
    assert len(runner.token_to_kv_pool.k_buffer) == 2
    assert max(len(p) for p in PROMPTS) > CHUNK
    assert StaticBatch(runner).generate(PROMPTS, 10) == [hf_greedy(hf, p, 10) for p in PROMPTS]


def test_prefill_logits_match_transformers(tmp_path) -> None:  # noqa: ANN001
    check_logits(nemotron_h(str(tmp_path)), str(tmp_path), PROMPTS[2])


def test_the_mamba_state_matters(tmp_path) -> None:  # noqa: ANN001
    check_state_matters(nemotron_h(str(tmp_path)), str(tmp_path), PROMPTS, 3)


@pytest.mark.parametrize("cache", [True, False])
def test_scheduler_chunks_carry_the_state(cache: bool, tmp_path) -> None:  # noqa: ANN001
    check_scheduler_waves(nemotron_h(str(tmp_path)), str(tmp_path), cache)


def test_prefix_cache_hits_request_by_request(tmp_path) -> None:  # noqa: ANN001
    """The hybrid models' sequence of hits (a shared head from its third request, a next turn, a repeated prompt,
    n > 1's shared prefill), with Nemotron-H's Mamba2 states in the snapshots."""
    check_hits(str(tmp_path), "nemotron_h", build=nemotron_h)


def test_states_are_sized_and_layer_kinds_read(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.hybrid import kv_layer_count, layer_kinds, linear_attention_layers

    nemotron_h(str(tmp_path))
    runner = make_runner(str(tmp_path), max_running_requests=6)
    mixer = runner.model.model.mixers()[0]
    channels = 128 + 2 * 2 * 16  # x (8 heads of 16), then B and C of two groups
    assert mixer.states.ssm.shape == (7 + 6 + 1, 8, 16, 16) and mixer.states.conv.shape == (14, channels, 3)
    assert runner.state_bytes == 3 * (channels * 3 * 4 + 8 * 16 * 16 * 4)
    assert len(runner.model.state_buffers()) == 3 and runner.state_pool is not None
    # the released configs' pattern string alone, transformers 5's list, and models without MLP-only layers
    raw = SimpleNamespace(hybrid_override_pattern=PATTERN)
    assert layer_kinds(raw) == ["mamba", "attention", "mlp", "mamba", "mlp", "attention", "mamba"]
    assert linear_attention_layers(raw) == [0, 3, 6] and kv_layer_count(raw, 7) == 2
    assert linear_attention_layers(_config()) == [0, 3, 6] and kv_layer_count(_config(), 7) == 2
    assert kv_layer_count(SimpleNamespace(hybrid_override_pattern="M-M-M-"), 6) == 0
    assert kv_layer_count(SimpleNamespace(layer_types=["linear_attention", "full_attention"]), 2) == 1
    assert kv_layer_count(SimpleNamespace(layer_types=["sliding_attention", "full_attention"]), 2) == 2
    assert kv_layer_count(SimpleNamespace(), 4) == 4


def test_mixer_reads_nemotron_h_names() -> None:
    """The inner width is heads x head width (not expand x hidden); the gated norm's epsilon is
    layer_norm_epsilon; the convolution's bias follows use_conv_bias."""
    mixer = Mamba2Mixer(_config(expand=7, layer_norm_epsilon=1e-3, use_conv_bias=False), NEMOTRON_H)
    assert (mixer.inner, mixer.heads, mixer.head_dim, mixer.groups, mixer.state_size, mixer.width) == \
        (128, 8, 16, 2, 16, 4)
    assert mixer.eps == 1e-3 and mixer.conv_bias is None


def test_refusals() -> None:
    from radixserve.models.nemotron_h import NemotronHForCausalLM

    with pytest.raises(ValueError, match="mamba_num_heads 8 and n_groups 2 must be divisible by the tensor "
                                         "parallel size 4"):
        NemotronHForCausalLM(_config(), tp_rank=0, tp_size=4)
    with pytest.raises(ValueError, match="n_groups 1 must be divisible by the tensor parallel size 2"):
        Mamba2Mixer(_config(n_groups=1), NEMOTRON_H, tp_rank=1, tp_size=2)
    with pytest.raises(ValueError, match=r"'X' is not supported \(M, \*, -, E\)"):
        NemotronHForCausalLM(SimpleNamespace(hybrid_override_pattern="M*X"))
    with pytest.raises(ValueError, match="mlp_hidden_act 'silu' is not supported"):
        NemotronHForCausalLM(_config(MOE_PATTERN, **MOE, mlp_hidden_act="silu"))
    with pytest.raises(ValueError, match="n_groups 3 must divide mamba_num_heads 8"):
        NemotronHForCausalLM(_config(n_groups=3))
    with pytest.raises(ValueError, match="mamba_hidden_act 'gelu'"):
        NemotronHForCausalLM(_config(mamba_hidden_act="gelu"))
    with pytest.raises(ValueError, match="sliding_window"):
        NemotronHForCausalLM(_config(sliding_window=8))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    nemotron_h(path, seed=3)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want


@pytest.mark.parametrize("latent,norm", [(None, True), (None, False), (24, True), (24, False)])
def test_moe_greedy_and_logits_match_transformers(latent: int | None, norm: bool, tmp_path) -> None:  # noqa: ANN001
    """Nemotron 3's MoE layers (grouped sigmoid routing with a correction bias, relu2 experts, the shared MLP; the
    latent projection or none; renormalised weights or not) among the other kinds: greedy tokens and prefill logits
    equal transformers'; the MoE layers hold the experts stacked, up rows alone."""
    path = str(tmp_path)
    hf = nemotron_h_moe(path, latent, norm)
    runner = make_runner(path)
    model = runner.model
    moe = model.model.layers[2].mixer
    assert type(moe).__name__ == "NemotronHMoE" and model.model.layers[5].letter == "E"
    width = latent or 64
    assert moe.experts.w13_weight.shape == (8, 32, width) and moe.experts.w2_weight.shape == (8, width, 32)
    assert (moe.fc1_latent_proj is not None) == (latent is not None)
    assert moe.gate.e_score_correction_bias.abs().sum() > 0
    assert runner.model_config.linear_attention_layers == [0, 3] and runner.model_config.kv_layer_count == 1
    assert StaticBatch(runner).generate(PROMPTS, 10) == [hf_greedy(hf, p, 10) for p in PROMPTS]
    check_logits(hf, path, PROMPTS[2])


def test_moe_layers_matter(tmp_path) -> None:  # noqa: ANN001
    """The greedy test above could not pass with the routed experts, the correction bias or the shared MLP left
    out."""
    path = str(tmp_path)
    hf = nemotron_h_moe(path, 24)
    want = [hf_greedy(hf, p, 10) for p in PROMPTS]
    for drop in ("experts.w2_weight", "gate.e_score_correction_bias", "shared_experts.down_proj.weight"):
        runner = make_runner(path)
        for layer in runner.model.model.layers:
            if layer.letter == "E":
                dict(layer.mixer.named_parameters())[drop].data.zero_()
        assert StaticBatch(runner).generate(PROMPTS, 10) != want, drop


def test_moe_scheduler_chunks(tmp_path) -> None:  # noqa: ANN001
    check_scheduler_waves(nemotron_h_moe(str(tmp_path), 24, False), str(tmp_path), True)


def test_moe_weights_load_from_transformers_stacked_names(tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory names (`model.layers.N.mixer.experts.up_proj` [E, I, H_in] stacked,
    `model.embeddings`, `model.norm_f`) load to the same parameters as the saved checkpoint's per-expert
    `backbone.layers.N.mixer.experts.J.up_proj.weight`."""
    from radixserve.models.nemotron_h import NemotronHForCausalLM

    path = str(tmp_path)
    hf = nemotron_h_moe(path, 24)
    names = dict(hf.state_dict())
    assert "model.layers.2.mixer.experts.up_proj" in names
    saved = make_runner(path).model
    model = NemotronHForCausalLM(hf.config)
    model.load_weights(names.items())
    mine = dict(model.named_parameters())
    for name, p in saved.named_parameters():
        assert torch.equal(mine[name], p), name


@pytest.mark.integration
@pytest.mark.parametrize("ep", [1, 2])
def test_moe_tp2_matches_tp1(ep: int, tmp_path) -> None:  # noqa: ANN001
    """TP=2 (the experts' and the shared MLP's intermediate width split) or EP=2 (the experts split) over gloo, with
    the latent projection: the same greedy tokens as one rank."""
    path = str(tmp_path)
    nemotron_h_moe(path, 24, seed=3)
    got, want = tp2_and_tp1_outputs(path, PROMPTS, ep_size=ep)
    assert got == want


# ---------------------------------------------------------------- FP8 (NVIDIA's ModelOpt release)
def _write_modelopt_fp8(path: str, exclude: list[str], listed: list[str], hf_quant_config: bool = False) -> str:
    """The tiny MoE model at `path` rewritten as NVIDIA-Nemotron-3-Nano-30B-A3B-FP8 is laid out (ModelOpt FP8):
    every `*proj.weight` of the layers (each expert's up / down, the shared MLP's, Mamba2's in_proj / out_proj, the
    MLP's) fp8 with a scalar `weight_scale` and a static scalar `input_scale`, but the modules in `exclude` (HF
    names); the attention layer's KV-cache scales on k_proj / v_proj; the settings in config.json's
    quantization_config (`ignore`) or in hf_quant_config.json (`exclude_modules`), that list written as `listed`.
    The dequantised weights are saved with the other files in `path`/deq."""
    import json
    import os

    from model_utils import rewrite_checkpoint

    from radixserve.layers.quantization.base import name_matches
    from radixserve.layers.quantization.fp8 import FP8, FP8_MAX

    def convert(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        module = name.rsplit(".", 1)[0]
        if ".layers." not in name or not name.endswith("proj.weight") or any(name_matches(module, p) for p in exclude):
            return None
        scale = t.float().abs().max() / FP8_MAX
        q = (t.float() / scale).clamp(-FP8_MAX, FP8_MAX).to(FP8)
        return ({name: q, module + ".weight_scale": scale.reshape(()), module + ".input_scale": torch.tensor(0.03)},
                q.float() * scale)

    deq_dir = rewrite_checkpoint(path, convert, {"backbone.layers.1.mixer.k_proj.k_scale": torch.tensor(0.5),
                                                 "backbone.layers.1.mixer.v_proj.v_scale": torch.tensor(0.25)})
    settings = {"quant_algo": "FP8", "kv_cache_quant_algo": "FP8"}
    if hf_quant_config:
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.35.0"},
                       "quantization": {**settings, "exclude_modules": listed}}, f)
    else:
        from model_utils import set_quantization_config

        set_quantization_config(path, {"quant_method": "modelopt", **settings, "ignore": listed,
                                       "producer": {"name": "modelopt", "version": "0.35.0"}})
    return deq_dir


# as the release's ignore list: lm_head, the attention projections, the Mamba2 layer next to them (here layer 0)
FP8_EXCLUDE = ["lm_head", "backbone.layers.0.mixer.in_proj", "backbone.layers.0.mixer.out_proj",
               *(f"backbone.layers.1.mixer.{p}_proj" for p in "qkvo")]


@pytest.mark.parametrize("names,hf_quant_config", [("backbone", False), ("backbone", True), ("model", False)])
def test_modelopt_fp8_checkpoint_matches_its_dequantized_weights(names: str, hf_quant_config: bool, tmp_path,
                                                                 monkeypatch) -> None:  # noqa: ANN001
    """Nemotron 3 in NVIDIA's FP8 layout: the relu2 experts fp8 (each expert's up_proj alone in w13, per-tensor
    scales), the shared MLP and the quantized Mamba2 layer's in_proj (one scale for all its sections) / out_proj fp8,
    the ignore list's layers (by the checkpoint's `backbone.` names, or transformers 5's `model.` ones) 16-bit, the KV
    scales on the attention layer. With W8A16 forced and the dense layers' static input scales dropped after their
    check, the model is the dequantised one: greedy tokens equal transformers' on those weights."""
    import transformers as tf

    import radixserve.layers.quantization.fp8 as fp8mod

    path = str(tmp_path)
    nemotron_h_moe(path, latent=None)
    listed = [p.replace("backbone.", "model.") for p in FP8_EXCLUDE] if names == "model" else FP8_EXCLUDE
    deq_dir = _write_modelopt_fp8(path, FP8_EXCLUDE, listed, hf_quant_config)
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)  # W8A16: the dequantised reference's arithmetic
    runner = make_runner(path)
    layers = runner.model.model.layers
    moe, experts = layers[2].mixer, layers[2].mixer.experts
    assert type(experts.quant_method).__name__ == "Fp8MoEMethod"
    assert experts.w13_weight.dtype == fp8mod.FP8 and experts.w13_weight.shape == (8, 32, 64)
    assert {n for n, _ in experts.named_parameters()} == {"w13_weight", "w2_weight", "w13_scale", "w2_scale"}
    assert moe.shared_experts.up_proj.weight.dtype == fp8mod.FP8 and layers[4].mixer.up_proj.weight.dtype == fp8mod.FP8
    in_proj = layers[3].mixer.in_proj
    assert in_proj.weight.dtype == fp8mod.FP8 and layers[3].mixer.out_proj.weight.dtype == fp8mod.FP8
    assert in_proj.weight_scale.unique().numel() == 1  # the checkpoint's one scale on every section's rows
    assert layers[0].mixer.in_proj.weight.dtype == torch.float32 and layers[0].mixer.out_proj.weight.dtype == \
        torch.float32
    assert layers[1].mixer.qkv_proj.weight.dtype == torch.float32 and runner.model.lm_head.weight.dtype == \
        torch.float32
    assert (layers[1].mixer.attn.k_scale, layers[1].mixer.attn.v_scale) == (0.5, 0.25)
    dense = [m for m in runner.model.modules() if getattr(m, "input_scale", None) is not None]
    assert len(dense) == 2 + 2 + 2 + 2 and all(float(m.input_scale) == pytest.approx(0.03) for m in dense)
    for m in dense:  # (static activation quantisation is the dense fp8 layers' own, tested with them)
        del m.input_scale
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    assert StaticBatch(runner).generate(PROMPTS, 8) == [hf_greedy(hf, p, 8) for p in PROMPTS]


def test_online_fp8_quantizes_the_relu2_experts(tmp_path) -> None:  # noqa: ANN001
    """`--quantization fp8` on the 16-bit model: the relu2 experts fp8 (up rows alone, a scale a row) with every
    other projection; the experts' product is the reference's on their dequantised weights, and the model serves."""
    from radixserve.layers.moe.activation import RELU2
    from radixserve.layers.moe.moe_torch import moe_forward_torch
    from radixserve.layers.quantization.fp8 import FP8, dequantize_blocks

    path = str(tmp_path)
    nemotron_h_moe(path, latent=24)
    runner = make_runner(path, quantization="fp8")
    layers = runner.model.model.layers
    experts = layers[5].mixer.experts
    assert type(experts.quant_method).__name__ == "Fp8MoEMethod"
    assert experts.w13_weight.dtype == FP8 and experts.w13_weight.shape == (8, 32, 24)
    sc = experts.quant_method.expert_scales(experts)
    assert sc.w13.shape == (8, 32, 1) and layers[3].mixer.in_proj.weight.dtype == FP8
    d13 = torch.stack([dequantize_blocks(experts.w13_weight[j], sc.w13[j], 1, 24) for j in range(8)])
    d2 = torch.stack([dequantize_blocks(experts.w2_weight[j], sc.w2[j], 1, 32) for j in range(8)])
    x = torch.randn(4, 24, generator=torch.Generator().manual_seed(0))
    ids = torch.tensor([[0, 3, 5], [1, 2, 7], [4, 6, 0], [7, 5, 3]], dtype=torch.int32)
    w = torch.rand(4, 3, generator=torch.Generator().manual_seed(1))
    torch.testing.assert_close(experts.quant_method.apply(experts, x, w, ids),
                               moe_forward_torch(x, d13, d2, w, ids, act=RELU2), atol=1e-5, rtol=1e-5)
    out = StaticBatch(runner).generate(PROMPTS, 6)
    assert [len(o) for o in out] == [6, 6, 6]
