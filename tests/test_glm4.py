"""GLM-4 (Glm4ForCausalLM) and GLM-4.5 (Glm4MoeForCausalLM) against transformers in float32 on tiny random models:
partial rotation (interleaved pairs for GLM-4, neox halves for GLM-4.5) laid out at load, GLM-4's four norms a
layer and fused gate/up, GLM-4.5's q/k norms, sigmoid routing with the correction bias over expert groups, scaled
and renormalised weights, shared experts and a first dense layer; through the scheduler with chunked prefill and the
prefix cache, the multi-token-prediction layer's weights skipped at load, and TP=2 over gloo."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def glm(kind: str, path: str, seed: int = 0, **over: object) -> torch.nn.Module:
    """A tiny `kind` (glm4 / glm4_moe) whose tokens depend on each term: norms away from 1, sharper attention."""
    hf = make_tiny_model(kind, path, seed=seed, initializer_range=0.08, **over)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(3.0)
        for name, b in hf.named_buffers():  # a buffer in transformers: make_tiny_model leaves it at 0
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b))
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("kind,backend", [("glm4", "cpu"), ("glm4", "torch_native"), ("glm4_moe", "cpu"),
                                          ("glm4_moe", "torch_native")])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = glm(kind, str(tmp_path))
    assert ours(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("kind", ["glm4", "glm4_moe"])
def test_triton_backend_matches_transformers(kind: str, tmp_path) -> None:  # noqa: ANN001
    """The Triton attention kernels (interpreted on the CPU: a few steps)."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    hf = glm(kind, str(tmp_path))
    prompts = PROMPTS[:2]
    got = StaticBatch(make_runner(str(tmp_path), attention_backend="triton")).generate(prompts, 4)
    assert got == [hf_greedy(hf, p, 4) for p in prompts]


def test_rotary_order_puts_each_pair_where_the_kernels_rotate() -> None:
    """Our neox rotation of the laid-out dims equals transformers' GLM-4 (interleaved) and GLM-4.5 (neox halves)
    rotation of the checkpoint's dims, for a head of 16 with 8 rotated."""
    from transformers.models.glm4.modeling_glm4 import apply_rotary_pos_emb as interleaved
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb as halves

    from radixserve.layers.rotary_embedding import RotaryEmbedding
    from radixserve.models.glm4 import rotary_order

    assert rotary_order(8, 4, interleaved=True).tolist() == [0, 2, 4, 5, 1, 3, 6, 7]
    assert rotary_order(8, 8, interleaved=True).tolist() == [0, 2, 4, 6, 1, 3, 5, 7]
    assert rotary_order(8, 8, interleaved=False) is None
    head, rot, pos = 16, 8, torch.arange(5)
    rope = RotaryEmbedding(head, 64, 10000.0, rotary_dim=rot)
    inv = 1.0 / (10000.0 ** (torch.arange(0, rot, 2).float() / rot))
    emb = torch.cat([pos[:, None] * inv] * 2, dim=-1)
    q, k = torch.randn(5, 2 * head), torch.randn(5, head)
    for apply, inter in ((interleaved, True), (halves, False)):
        want_q, want_k = apply(q.view(1, 5, 2, head).transpose(1, 2), k.view(1, 5, 1, head).transpose(1, 2),
                               emb.cos()[None], emb.sin()[None])
        order = rotary_order(head, rot, inter)
        got_q, got_k = rope(pos, q.view(5, 2, head)[..., order].reshape(5, -1).clone(),
                            k[..., order].clone())
        torch.testing.assert_close(got_q.view(5, 2, head), want_q.transpose(1, 2)[0][..., order])
        torch.testing.assert_close(got_k.view(5, 1, head), want_k.transpose(1, 2)[0][..., order])


def test_layout_and_sandwich_norms_change_glm4_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The GLM-4 cases above could not pass with the neox layout in place of the interleaved one, or with the
    post-attention / post-MLP norms left out."""
    from radixserve.models import glm4

    path = str(tmp_path)
    hf = glm("glm4", path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.post_self_attn_layernorm = layer.post_mlp_layernorm = torch.nn.Identity()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    original = glm4.rotary_order
    monkeypatch.setattr(glm4, "rotary_order", lambda head_dim, rotary_dim, interleaved:
                        original(head_dim, rotary_dim, interleaved=False))
    assert ours(path) != want


def test_layout_qk_norm_and_correction_bias_change_glm4_moe_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The GLM-4.5 cases above could not pass without the q/k layout (of the projections or of the q/k norms), or
    with the routers' correction bias left out."""
    from radixserve.models import glm4

    path = str(tmp_path)
    hf = glm("glm4_moe", path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers[1:]:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    monkeypatch.setattr(glm4, "_QK", (".q_proj.", ".k_proj."))  # the norms' weights in checkpoint order
    assert ours(path) != want
    monkeypatch.setattr(glm4, "rotary_order", lambda head_dim, rotary_dim, interleaved: None)
    assert ours(path) != want


@pytest.mark.parametrize("kind", ["glm4", "glm4_moe"])
def test_scheduler_chunked_prefill_and_prefix_cache(kind: str, tmp_path) -> None:  # noqa: ANN001
    hf = glm(kind, str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_mtp_layer_weights_are_skipped(tmp_path) -> None:  # noqa: ANN001
    """GLM-4.5 checkpoints carry the multi-token-prediction layer as layer num_hidden_layers (2 here): loaded past,
    the tokens unchanged; a stray weight of a served layer is still an error."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    hf = glm("glm4_moe", path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    mtp = {name.replace("model.layers.1.", "model.layers.2."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.1.")}
    mtp.update({"model.layers.2.eh_proj.weight": torch.randn(64, 128), "model.layers.2.enorm.weight": torch.ones(64),
                "model.layers.2.shared_head.head.weight": torch.randn(256, 64)})
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    assert ours(path) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    save_file({**tensors, "model.layers.1.eh_proj.weight": torch.randn(64, 128)}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.1.eh_proj.weight'"):
        make_runner(path)


def test_unsupported_tensors_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.glm4 import Glm4ForCausalLM, Glm4MoeForCausalLM

    glm("glm4", str(tmp_path / "d"))
    model = Glm4ForCausalLM(ModelConfig(str(tmp_path / "d")).hf_config)
    params = dict(model.named_parameters())
    assert model.model.layers[0].self_attn.o_proj.bias is None  # attention_bias: q/k/v only
    with pytest.raises(ValueError, match="quantized GLM-4 checkpoints"):
        model.load_weight(params, "model.layers.0.mlp.gate_up_proj.weight",
                          torch.zeros(256, 64, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="even number of rows"):
        model.load_weight(params, "model.layers.0.mlp.gate_up_proj.weight", torch.zeros(255, 64))
    glm("glm4_moe", str(tmp_path / "m"))
    model = Glm4MoeForCausalLM(ModelConfig(str(tmp_path / "m")).hf_config)
    with pytest.raises(ValueError, match="block-wise or packed quantized q/k"):
        model.load_weight(dict(model.named_parameters()), "model.layers.0.self_attn.q_proj.weight_scale_inv",
                          torch.ones(1, 1).expand(1, 2).contiguous())


def test_bad_rotary_factors_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    """partial_rotary_factor 0 (which would rotate nothing: not the whole head in its place), an odd rotary_dim and
    llama.cpp's GLM files (post-norms, the rotary layout: no GGUF name here maps them) are refused."""

    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.glm4 import Glm4ForCausalLM

    path = str(tmp_path / "d")
    glm("glm4", path)
    for share, match in ((0.0, "partial_rotary_factor must be in \\(0, 1\\]; got 0.0"),
                         (0.15625, "even rotary_dim below head_dim 32; got 5")):
        cfg = ModelConfig(path).hf_config
        cfg.rope_parameters = {**cfg.rope_parameters, "partial_rotary_factor": share}
        with pytest.raises(ValueError, match=match):
            Glm4ForCausalLM(cfg)
    for arch, name in (("glm4", "GLM-4"), ("glm4moe", "GLM-4.5")):
        file = stub_gguf(str(tmp_path / f"{arch}.gguf"), arch)
        with pytest.raises(ValueError, match=f"GGUF files of {name} are not supported"):
            ModelConfig(file)


def test_lora_matches_transformers_peft(tmp_path) -> None:  # noqa: ANN001
    """A PEFT adapter on q/k/v/o and down_proj: its q/k B rows are laid out as their base rows (the interleaved
    partial rotation), so the tokens are transformers + PEFT's; its fused gate_up_proj target is refused."""
    import transformers as tf
    from peft import LoraConfig, PeftModel, get_peft_model
    from test_lora import submit_lora
    from test_scheduler import drain, make_scheduler

    path, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    base = glm("glm4", path)
    want_base = [hf_greedy(base, p, 8) for p in PROMPTS]
    targets = ["q_proj", "k_proj", "v_proj", "o_proj", "down_proj"]
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    peft.save_pretrained(adapter)
    ref = PeftModel.from_pretrained(tf.Glm4ForCausalLM.from_pretrained(path), adapter).eval()
    want = [hf_greedy(ref, p, 8) for p in PROMPTS]
    assert want != want_base
    s = make_scheduler(path, lora_paths=[f"glm={adapter}"])
    for i, prompt in enumerate(PROMPTS):
        submit_lora(s, str(i), prompt, 8, "glm")
    res = drain(s)
    assert [res[str(i)]["ids"] for i in range(len(PROMPTS))] == want
    with open(f"{adapter}/adapter_config.json") as f:
        cfg = json.load(f)
    with open(f"{adapter}/adapter_config.json", "w") as f:
        json.dump({**cfg, "target_modules": ["q_proj", "gate_up_proj"]}, f)
    with pytest.raises(ValueError, match="gate_up_proj not supported"):
        make_scheduler(path, lora_paths=[f"glm={adapter}"])


def test_per_row_scaled_qk_tensors_are_laid_out_with_their_rows(tmp_path) -> None:  # noqa: ANN001
    """fp8 q/k weights and their per-channel scales ([rows, 1]) move by the same row order; a scalar stays."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.glm4 import Glm4MoeForCausalLM, rotary_order

    glm("glm4_moe", str(tmp_path))
    model = Glm4MoeForCausalLM(ModelConfig(str(tmp_path)).hf_config)
    order = rotary_order(32, 16, interleaved=False)
    rows = torch.arange(64, dtype=torch.float32)[:, None]
    got = model._laid_out("model.layers.0.self_attn.k_proj.weight_scale", rows)
    assert got[:32, 0].tolist() == order.tolist() and got[32:, 0].tolist() == (order + 32).tolist()
    weight = torch.randn(64, 64).to(torch.float8_e4m3fn)
    got = model._laid_out("model.layers.0.self_attn.k_proj.weight", weight)
    assert got.dtype == torch.float8_e4m3fn and torch.equal(got[1].float(), weight[order[1]].float())
    assert model._laid_out("model.layers.0.self_attn.k_proj.input_scale", torch.ones(1)).shape == (1,)


def test_per_channel_fp8_checkpoint_matches_its_dequantized_weights(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A compressed-tensors FP8-dynamic GLM-4.5 (per-channel scales, as llm-compressor writes them): the q/k scales
    follow their rows' layout and the experts load through the generic fp8 expert path; W8A16 forced, the tokens are
    transformers' on the dequantised weights."""
    from test_quant_checkpoints import _greedy_matches, write_checkpoint

    import radixserve.layers.quantization.fp8 as fp8mod

    path = str(tmp_path)
    glm("glm4_moe", path)
    deq_dir = write_checkpoint(path, "ct", "channel")
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    _greedy_matches(path, deq_dir)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["glm4", "glm4_moe"])
def test_tp2_matches_tp1(kind: str, tmp_path) -> None:  # noqa: ANN001
    """Heads split over the ranks keep each head's layout; experts and shared experts split over them."""
    path = str(tmp_path)
    make_tiny_model(kind, path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
