"""GLM-4.7-Flash (Glm4MoeLiteForCausalLM) against transformers in float32 on tiny random models: DeepSeek-V3's
latent attention with qk_nope_head_dim != v_head_dim (48 / 64: the release's 192 / 256 scaled down, neither a
power of two nor equal), interleaved or neox rotary (YaRN with mscale_all_dim), q_lora_rank set or not; GLM-4.5's
sigmoid + correction-bias routing (one group as released, or grouped), shared experts, and the dense / sparse layers
of `mlp_layer_types`. Both prefill forms (expanded, latent), decode, the fused MLA preparation under Triton; the
scheduler with chunked prefill and a radix hit; the multi-token-prediction layer skipped; TP=2 over gloo."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
# the released shape scaled down: q_lora_rank 768 -> 24, kv_lora_rank 512 -> 32, rope 64 -> 16, nope 192 -> 48,
# v 256 -> 64; 64 experts top-4 -> 8 top-3; one shared expert, routed_scaling_factor 1.8, the first layer dense
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=4, q_lora_rank=24, kv_lora_rank=32, qk_rope_head_dim=16,
             qk_nope_head_dim=48, v_head_dim=64, n_routed_experts=8, num_experts_per_tok=3, n_shared_experts=1,
             routed_scaling_factor=1.8, norm_topk_prob=True, max_position_embeddings=512, rms_norm_eps=1e-6,
             tie_word_embeddings=False, pad_token_id=0)
# the other options transformers implements: no q_lora_rank, grouped routing, neox rotary with YaRN, a dense layer
# between sparse ones
KINDS = {
    "flash": {},
    "mixed": dict(q_lora_rank=None, n_group=4, topk_group=2, rope_interleave=False,
                  mlp_layer_types=["sparse", "dense", "sparse"],
                  rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 8.0,
                                   "original_max_position_embeddings": 64, "beta_fast": 32.0, "beta_slow": 1.0,
                                   "mscale": 1.0, "mscale_all_dim": 0.707}),
}


def glm_lite(path: str, kind: str = "flash", seed: int = 0, init: float = 0.08, **over: object) -> torch.nn.Module:
    """A tiny GLM-4.7-Flash saved to `path` whose tokens depend on each term: norms away from 1, routers with clear
    winners that the correction bias can still reorder."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.Glm4MoeLiteConfig(**{**SHAPE, **KINDS[kind], **over}, initializer_range=init)
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("mlp.gate.weight"):
                p.mul_(10.0)
        for name, b in hf.named_buffers():  # a buffer in transformers, zero at init
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn_like(b) * 0.3)
    hf.save_pretrained(path)
    return hf


def ours(path: str, prompts: list[list[int]] = PROMPTS, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(prompts, steps)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend,expanded", [("cpu", True), ("cpu", False), ("torch_native", True)])
def test_greedy_matches_transformers(kind: str, backend: str, expanded: bool, tmp_path,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    """Prefills in the expanded form (taken wherever Triton runs, its interpreter included) or, with it off, in
    the latent one; decode in the latent form."""
    from radixserve.models import deepseek_v2

    monkeypatch.setattr(deepseek_v2, "EXPANDED_PREFILL", expanded)
    hf = glm_lite(str(tmp_path), kind)
    assert ours(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.slow
@pytest.mark.parametrize("expanded", [True, False])
def test_triton_kernels_match_transformers(expanded: bool, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The Triton MLA paths with the fused kernels forced (interpreted on the CPU: a few steps): the expanded
    prefill or the latent one (the fused preparation's batched-GEMM branch at 17 tokens), decode with the one-launch
    preparation and absorbed output, the MoE kernels."""
    if os.environ.get("TRITON_INTERPRET") != "1" and not torch.cuda.is_available():
        pytest.skip("Triton needs a GPU or TRITON_INTERPRET=1")
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.models import deepseek_v2

    monkeypatch.setattr(deepseek_v2, "EXPANDED_PREFILL", expanded)
    hf = glm_lite(str(tmp_path))
    prompts = PROMPTS[:2]
    set_fused_kernels(None if torch.cuda.is_available() else True)
    try:
        got = ours(str(tmp_path), prompts, 4, attention_backend="triton", disable_cuda_graph=True)
    finally:
        set_fused_kernels(None)
    assert got == [hf_greedy(hf, p, 4) for p in prompts]


@pytest.mark.parametrize("kind,every_extend_expanded", [("flash", False), ("flash", True), ("mixed", False)])
def test_scheduler_chunked_prefill_and_radix_hit(kind: str, every_extend_expanded: bool, tmp_path,
                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """5-token chunks, then prompts that hit the first wave's prefixes in the radix cache: the extends on a cached
    prefix in the latent form as chosen, or all in the expanded form (the prefixes' latents read back from the
    pool and expanded)."""
    from radixserve.layers.attention.triton_ops import mla_expanded

    if every_extend_expanded:
        monkeypatch.setattr(mla_expanded, "expanded_pays", lambda *args: True)
    hf = glm_lite(str(tmp_path), kind)
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_mlp_layer_types_pick_the_dense_layers_and_the_pool_is_latent(tmp_path) -> None:
    """The dense / sparse layers follow mlp_layer_types (and, in a config without it, transformers' default: the
    first layer dense); the KV pool holds one latent row of kv_lora_rank + qk_rope_head_dim a token and layer."""
    from radixserve.mem_cache.mla_memory_pool import MLATokenToKVPool
    from radixserve.models.deepseek_v2 import DeepseekMoE

    path = str(tmp_path / "mixed")
    glm_lite(path, "mixed")
    runner = make_runner(path)
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in runner.model.model.layers] == [True, False, True]
    pool = runner.token_to_kv_pool
    assert isinstance(pool, MLATokenToKVPool) and pool.get_kv_buffer(0)[0].shape[1:] == (1, 32 + 16)
    path = str(tmp_path / "released")
    glm_lite(path)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    del cfg["mlp_layer_types"]
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)
    runner = make_runner(path)
    assert [isinstance(layer.mlp, DeepseekMoE) for layer in runner.model.model.layers] == [False, True, True]


def test_bad_configs_are_refused(tmp_path) -> None:
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.glm4 import Glm4MoeLiteForCausalLM

    path = str(tmp_path)
    glm_lite(path)
    for key, value, match in (("mlp_layer_types", ["dense", "sparse"], "mlp_layer_types must name"),
                              ("mlp_layer_types", ["dense", "moe", "sparse"], "mlp_layer_types must name"),
                              ("partial_rotary_factor", 0.5, "partial_rotary_factor 0.5"),
                              ("hidden_act", "gelu", "hidden_act 'gelu'")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own checks
        with pytest.raises(ValueError, match=match):
            Glm4MoeLiteForCausalLM(cfg)


def test_gguf_files_are_refused(tmp_path) -> None:
    """llama.cpp writes GLM-4.7-Flash as `deepseek2` (DeepSeek's latent attention): no tensor map here, refused."""
    from radixserve.configs.model_config import ModelConfig

    file = stub_gguf(str(tmp_path / "m.gguf"), "deepseek2")
    with pytest.raises(ValueError, match="GGUF files of DeepSeek-V2 / V3 and GLM-4.7-Flash"):
        ModelConfig(file)


def test_mtp_layer_is_skipped(tmp_path) -> None:
    """The release stores its multi-token-prediction layer as layer num_hidden_layers: skipped at load."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    hf = glm_lite(path)
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    mtp = {name.replace("model.layers.2.", "model.layers.3."): t.clone() for name, t in tensors.items()
           if name.startswith("model.layers.2.")}
    mtp.update({"model.layers.3.eh_proj.weight": torch.zeros(64, 128), "model.layers.3.enorm.weight": torch.ones(64)})
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    assert ours(path, PROMPTS[:2], 6) == [hf_greedy(hf, p, 6) for p in PROMPTS[:2]]


def test_expanded_kernel_at_unequal_unpadded_head_dims() -> None:
    """The expanded prefill kernel with GLM-4.7-Flash's proportions (key part 48, padded to 64; value 64; rope 16)
    against its torch reference, with a cached prefix."""
    pytest.importorskip("triton")
    from radixserve.layers.attention.triton_ops.mla_expanded import mla_expanded_extend, mla_expanded_extend_torch

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    g = torch.Generator().manual_seed(1)
    heads, d, r, dv = 2, 48, 16, 64
    ext, pre = [9, 20], [7, 0]
    kv_lens = [e + p for e, p in zip(ext, pre, strict=True)]
    q = torch.randn(sum(ext), heads, d + r, generator=g).to(dev)
    kv = torch.randn(sum(kv_lens), heads, d + dv, generator=g).to(dev)
    k_pe = torch.randn(sum(kv_lens), r, generator=g).to(dev)
    q_start, kv_start = [0, ext[0]], [0, kv_lens[0]]
    ints = [torch.tensor(x, dtype=torch.int32, device=dev) for x in (q_start, kv_start, ext, kv_lens)]
    o = torch.full((sum(ext), heads, dv), float("nan"), device=dev)
    mla_expanded_extend(q, kv[..., :d], kv[..., d:], k_pe, o, *ints, max(ext), 0.2)
    ref = mla_expanded_extend_torch(q, kv[..., :d], kv[..., d:], k_pe, q_start, kv_start, ext, kv_lens, 0.2)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:
    """Heads (q_b_proj, kv_b_proj, o_proj) and experts split over two ranks, the latent pool whole on each."""
    path = str(tmp_path)
    glm_lite(path, seed=3, init=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
