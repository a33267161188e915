"""ERNIE 4.5 (Ernie4_5ForCausalLM) and ERNIE 4.5 MoE (Ernie4_5_MoeForCausalLM) against transformers in float32 on
tiny random models: the interleaved rotation laid out at load, use_bias (q/k/v, o_proj, MLPs) with tied embeddings,
softmax routing with the correction bias for the choice only and weights over max(sum, moe_norm_min), shared
experts and a first dense layer; through the scheduler with chunked prefill and the prefix cache, the
multi-token-prediction weights skipped at load, and TP=2 over gloo."""

from __future__ import annotations

import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def ernie(kind: str, path: str, seed: int = 0, **over: object) -> torch.nn.Module:
    """A tiny `kind` (ernie4_5 / ernie4_5_moe) whose tokens depend on each term: norms away from 1, sharper
    attention, softer router scores with a correction bias that can pass over the best-scored experts."""
    hf = make_tiny_model(kind, path, seed=seed, initializer_range=0.08, **over)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(3.0)
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.1)  # softer scores (make_tiny_model sharpens them 40x): the bias can pass over the best
        for name, t in [*hf.named_parameters(), *hf.named_buffers()]:  # a buffer in some transformers versions
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn_like(t))
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("kind,backend", [("ernie4_5", "cpu"), ("ernie4_5", "torch_native"),
                                          ("ernie4_5_moe", "cpu"), ("ernie4_5_moe", "torch_native")])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = ernie(kind, str(tmp_path))
    assert ours(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_model_structure(tmp_path) -> None:  # noqa: ANN001
    """use_bias puts biases on q/k/v, o_proj and the MLP; the MoE model's layer 0 is dense, layer 1 sparse."""
    from radixserve.models.ernie4_5 import ErnieMoE

    ernie("ernie4_5", str(tmp_path / "d"))
    model = make_runner(str(tmp_path / "d")).model
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert all(lin.bias is not None for lin in (attn.qkv_proj, attn.o_proj, mlp.gate_up_proj, mlp.down_proj))
    assert model.lm_head is model.model.embed_tokens  # tied
    ernie("ernie4_5_moe", str(tmp_path / "m"))
    layers = make_runner(str(tmp_path / "m")).model.model.layers
    assert not isinstance(layers[0].mlp, ErnieMoE) and isinstance(layers[1].mlp, ErnieMoE)
    assert layers[1].mlp.shared_experts.down_proj.weight.shape == (64, 64)  # 2 shared experts of 32
    assert layers[0].self_attn.o_proj.bias is None


def test_rotary_layout_and_correction_bias_change_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with the checkpoint's (neox) dim order in place of the interleaved layout, or
    with the routers' correction bias left out."""
    from radixserve.models import glm4

    dense, moe = str(tmp_path / "d"), str(tmp_path / "m")
    want_dense = [hf_greedy(ernie("ernie4_5", dense), p, 12) for p in PROMPTS]
    want_moe = [hf_greedy(ernie("ernie4_5_moe", moe), p, 12) for p in PROMPTS]
    runner = make_runner(moe)
    runner.model.model.layers[1].mlp.gate.e_score_correction_bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want_moe
    monkeypatch.setattr(glm4, "rotary_order", lambda head_dim, rotary_dim, interleaved: None)
    assert ours(dense) != want_dense
    assert ours(moe) != want_moe


def test_router_matches_transformers_including_the_norm_min_floor() -> None:
    """select_experts with ERNIE's RouterConfig gives transformers' router's experts and weights, also where the
    correction bias picks experts whose softmax scores sum below moe_norm_min (weights over the floor, not 1)."""
    import transformers as tf
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import Ernie4_5_MoeTopKRouter

    from radixserve.layers.moe import RouterConfig, select_experts

    cfg = tf.Ernie4_5_MoeConfig(hidden_size=16, moe_num_experts=8, moe_k=2, moe_norm_min=1e-12)
    router = Ernie4_5_MoeTopKRouter(cfg)
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        router.weight.copy_(torch.randn(8, 16, generator=g))
        router.moe_statics.e_score_correction_bias.copy_(torch.randn(1, 8, generator=g) * 0.3)
    x = torch.randn(32, 16, generator=g)
    x[0] = router.weight[0] * 40.0  # expert 0 takes all the mass: the other scores underflow to 0
    with torch.no_grad():
        router.moe_statics.e_score_correction_bias[0, 0] = -2.0  # ... and is never chosen
        logits, want_w, want_ids = router(x)
    rc = RouterConfig(8, 2, "softmax", renormalize=True, renorm_min=1e-12)
    w, ids = select_experts(logits, rc, router.moe_statics.e_score_correction_bias.reshape(-1))
    order, want_order = ids.long().sort(dim=-1), want_ids.sort(dim=-1)
    assert torch.equal(order.values, want_order.values)
    torch.testing.assert_close(w.gather(1, order.indices), want_w.gather(1, want_order.indices))
    assert float(w[0].sum()) < 1e-6  # the floor: a plain renormalisation would divide 0 by 0
    with pytest.raises(ValueError, match="renorm_min must be >= 0"):
        RouterConfig(8, 2, renorm_min=-1.0)


def test_fused_routers_decline_renorm_min(monkeypatch) -> None:
    """The Triton top-k kernels divide by the plain sum: MoEGate.route and select_experts' fused branch leave a
    router with renorm_min to the torch path instead of computing something else."""
    import radixserve.layers.moe.router as router_mod
    from radixserve.layers.moe import MoEGate, RouterConfig, select_experts

    monkeypatch.setattr(router_mod, "use_fused", lambda *_: True)
    gate = MoEGate(16, 8, correction_bias=True)
    with torch.no_grad():
        gate.weight.normal_()
    rc = RouterConfig(8, 2, "softmax", renormalize=True, renorm_min=1e-12)
    x = torch.randn(3, 16)
    assert gate.route(x, rc) is None
    w, ids = select_experts(gate(x), rc, gate.e_score_correction_bias)  # the torch path, no Triton launch
    torch.testing.assert_close(w.sum(dim=-1), torch.ones(3))


@pytest.mark.parametrize("kind", ["ernie4_5", "ernie4_5_moe"])
def test_scheduler_chunked_prefill_and_prefix_cache(kind: str, tmp_path) -> None:  # noqa: ANN001
    hf = ernie(kind, str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_mtp_weights_are_skipped_and_lm_head_bias_refused(tmp_path) -> None:  # noqa: ANN001
    """ERNIE checkpoints carry the multi-token-prediction block as model.mtp_*: loaded past, the tokens unchanged;
    a stray weight of a served layer is still an error, and so is a non-zero lm_head.bias (a zero one loads)."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    hf = ernie("ernie4_5_moe", path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    mtp = {name.replace("model.layers.1.", "model.mtp_block.0."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.1.")}
    mtp.update({"model.mtp_emb_norm.0.weight": torch.ones(64), "model.mtp_hidden_norm.0.weight": torch.ones(64),
                "model.mtp_linear_proj.0.weight": torch.randn(64, 128), "lm_head.bias": torch.zeros(256)})
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    assert ours(path) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    save_file({**tensors, "model.layers.1.mtp_linear_proj.weight": torch.randn(64, 128)}, file,
              metadata={"format": "pt"})
    with pytest.raises(ValueError, match="unexpected weight 'model.layers.1.mtp_linear_proj.weight'"):
        make_runner(path)
    save_file({**tensors, "lm_head.bias": torch.ones(256)}, file, metadata={"format": "pt"})
    with pytest.raises(ValueError, match="non-zero bias on the LM head"):
        make_runner(path)


def test_bad_configs_are_refused(tmp_path) -> None:  # noqa: ANN001
    """The multimodal models' per-modality expert lists, a partial rotation (transformers' ERNIE rotates the whole
    head) and an unsupported activation."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.ernie4_5 import Ernie4_5_MoeForCausalLM

    path = str(tmp_path)
    ernie("ernie4_5_moe", path)
    for key, value, match in (("moe_num_experts", [8, 8], "moe_num_experts must be an integer"),
                              ("moe_num_experts", 0, "needs moe_num_experts > 0"),
                              ("partial_rotary_factor", 0.5, "does not support partial_rotary_factor"),
                              ("hidden_act", "gelu", "hidden_act 'gelu' is not supported")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own type checks
        with pytest.raises(ValueError, match=match):
            Ernie4_5_MoeForCausalLM(cfg)


@pytest.mark.integration
@pytest.mark.parametrize("kind", ["ernie4_5", "ernie4_5_moe"])
def test_tp2_matches_tp1(kind: str, tmp_path) -> None:  # noqa: ANN001
    """Heads split over the ranks keep each head's layout; biases added once; experts and shared experts split."""
    path = str(tmp_path)
    make_tiny_model(kind, path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want


def test_gguf_files_are_refused(tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's ERNIE files: transformers' GGUF reader (this version) refuses them, so no loader maps them."""

    from radixserve.configs.model_config import ModelConfig

    for arch in ("ernie4_5", "ernie4_5-moe"):
        file = stub_gguf(str(tmp_path / f"{arch}.gguf"), arch)
        with pytest.raises(ValueError, match=f"architecture {arch} is not supported"):
            ModelConfig(file)
