"""The fused Triton layer kernels (RMSNorm, add+RMSNorm, SiLU·mul, rotary in place, KV store) against the layers'
torch code. On the CPU they run under TRITON_INTERPRET=1 (set in conftest); on CUDA, natively."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.activation import SiluAndMul
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.layers.triton_ops.activation import silu_and_mul
from radixserve.layers.triton_ops.kv_store import store_kv
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm, rmsnorm
from radixserve.layers.triton_ops.rotary import KVWrite, apply_rotary_inplace

DEV = "cuda" if torch.cuda.is_available() else "cpu"
DTYPES = [torch.float32, torch.bfloat16]


def _exact_or_ulp(a: torch.Tensor, b: torch.Tensor) -> None:
    """Equal up to about one rounding step of the dtype: reductions may sum in another order, and Triton's CPU
    interpreter casts float32 to bfloat16 by truncation where the GPU rounds to nearest."""
    tol = 1e-5 if a.dtype == torch.float32 else 2e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,hidden", [(1, 64), (5, 96), (0, 64)])
def test_rmsnorm_matches_torch(dtype: torch.dtype, rows: int, hidden: int) -> None:
    g = torch.Generator().manual_seed(rows * 1000 + hidden)
    norm = RMSNorm(hidden, 1e-5)
    norm.weight.data = (torch.rand(hidden, generator=g) + 0.5).to(dtype)
    x = (torch.randn(rows, hidden, generator=g) * 3).to(dtype)
    r = torch.randn(rows, hidden, generator=g).to(dtype)
    ref = norm(x)  # CPU tensors: the torch path
    ref_out, ref_res = norm(x, r)
    out = rmsnorm(x.to(DEV), norm.weight.to(DEV), 1e-5).cpu()
    f_out, f_res = fused_add_rmsnorm(x.to(DEV), r.to(DEV), norm.weight.to(DEV), 1e-5)
    _exact_or_ulp(out, ref)
    _exact_or_ulp(f_out.cpu(), ref_out)
    if DEV == "cuda" or dtype == torch.float32:
        assert torch.equal(f_res.cpu(), ref_res)  # the residual sum is one rounding: exact
    _exact_or_ulp(f_res.cpu(), ref_res)
    assert out.dtype == dtype and f_out.shape == (rows, hidden)


def test_rmsnorm_bad_input() -> None:
    w = torch.ones(8)
    with pytest.raises(ValueError, match="weight"):
        rmsnorm(torch.zeros(2, 16), w, 1e-5)
    with pytest.raises(ValueError, match="residual"):
        fused_add_rmsnorm(torch.zeros(2, 8), torch.zeros(3, 8), w, 1e-5)
    with pytest.raises(ValueError, match="2-D"):
        rmsnorm(torch.zeros(8), w, 1e-5)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("rows,d", [(1, 48), (7, 96), (3, 1500)])
def test_silu_and_mul_matches_torch(dtype: torch.dtype, rows: int, d: int) -> None:
    x = (torch.randn(rows, 2 * d, generator=torch.Generator().manual_seed(d)) * 4).to(dtype)
    ref = SiluAndMul()(x)
    out = silu_and_mul(x.to(DEV)).cpu()
    _exact_or_ulp(out, ref)
    with pytest.raises(ValueError, match="2d"):
        silu_and_mul(torch.zeros(2, 5))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("hq,hk,head_dim,scaling", [
    (4, 2, 16, None),
    (6, 1, 80, None),  # half = 40: not a power of two
    (8, 8, 32, {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                "original_max_position_embeddings": 64}),
])
def test_rotary_in_place_on_qkv_views(dtype: torch.dtype, hq: int, hk: int, head_dim: int,
                                      scaling: dict | None) -> None:
    rope = RotaryEmbedding(head_dim, 256, 10000.0, scaling)
    t = 9
    g = torch.Generator().manual_seed(hq * 100 + head_dim)
    qkv = torch.randn(t, (hq + 2 * hk) * head_dim, generator=g).to(dtype)
    positions = torch.tensor([0, 1, 2, 200, 7, 7, 31, 255, 64])
    q, k, _ = qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    ref_q, ref_k = rope(positions, q, k)  # CPU: new tensors, qkv untouched
    dev_qkv = qkv.to(DEV)
    dq, dk, dv = dev_qkv.split([hq * head_dim, hk * head_dim, hk * head_dim], dim=-1)
    apply_rotary_inplace(positions.to(DEV), dq, dk, rope.cos_cache.to(DEV), rope.sin_cache.to(DEV), head_dim)
    _exact_or_ulp(dq.cpu(), ref_q)
    _exact_or_ulp(dk.cpu(), ref_k)
    assert torch.equal(dv.cpu(), qkv[:, (hq + hk) * head_dim:])  # v is not touched


@pytest.mark.parametrize("src_dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16)])
@pytest.mark.parametrize("hq,hk", [(4, 2), (3, 3)])
def test_rotary_with_kv_write_equals_rotary_then_store(src_dtype: torch.dtype, pool_dtype: torch.dtype, hq: int,
                                                       hk: int) -> None:
    """The fused rotary + KV store writes exactly what rotary followed by store_kv writes, and rotates q/k the same."""
    d, slots, t = 32, 40, 6
    rope = RotaryEmbedding(d, 256, 10000.0)
    g = torch.Generator().manual_seed(hq * 10 + hk)
    qkv = torch.randn(t, (hq + 2 * hk) * d, generator=g).to(src_dtype).to(DEV)
    positions = torch.tensor([0, 5, 255, 9, 9, 100]).to(DEV)
    loc = torch.tensor([3, 39, 0, 17, 8, 21]).to(DEV)
    cos, sin = rope.cos_cache.to(DEV), rope.sin_cache.to(DEV)

    def split(x: torch.Tensor) -> list[torch.Tensor]:
        return list(x.split([hq * d, hk * d, hk * d], dim=-1))

    ref_qkv = qkv.clone()
    q, k, v = split(ref_qkv)
    apply_rotary_inplace(positions, q, k, cos, sin, d)
    ref_k = torch.full((slots, hk, d), 7.0, dtype=pool_dtype, device=DEV)
    ref_v = torch.full((slots, hk, d), 7.0, dtype=pool_dtype, device=DEV)
    store_kv(ref_k, ref_v, loc, k, v)
    q, k, v = split(qkv)
    k_buf = torch.full((slots, hk, d), 7.0, dtype=pool_dtype, device=DEV)
    v_buf = torch.full((slots, hk, d), 7.0, dtype=pool_dtype, device=DEV)
    apply_rotary_inplace(positions, q, k, cos, sin, d, KVWrite(k_buf, v_buf, loc, v))
    assert torch.equal(qkv, ref_qkv)
    assert torch.equal(k_buf, ref_k) and torch.equal(v_buf, ref_v)
    with pytest.raises(ValueError, match="k_buf"):
        apply_rotary_inplace(positions, q, k, cos, sin, d, KVWrite(k_buf[:, :1], v_buf, loc, v))
    with pytest.raises(ValueError, match="loc"):
        apply_rotary_inplace(positions, q, k, cos, sin, d, KVWrite(k_buf, v_buf, loc[:2], v))


@pytest.mark.parametrize("dtype", DTYPES)
def test_rotary_with_qk_norm_equals_rmsnorm_then_rotary(dtype: torch.dtype) -> None:
    """Qwen3's per-head q/k RMSNorm inside the rotary kernel (with the KV write) gives what the RMSNorm kernel
    followed by the rotary kernel gives."""
    from radixserve.layers.triton_ops.rotary import QKNorm

    hq, hk, d, t, slots = 4, 2, 32, 5, 12
    rope = RotaryEmbedding(d, 256, 10000.0)
    g = torch.Generator().manual_seed(11)
    qkv = (torch.randn(t, (hq + 2 * hk) * d, generator=g) * 3).to(dtype).to(DEV)
    qw, kw = (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEV), (torch.rand(d, generator=g) + 0.5).to(dtype).to(DEV)
    positions, loc = torch.tensor([0, 9, 255, 3, 3]).to(DEV), torch.tensor([1, 0, 11, 4, 7]).to(DEV)
    cos, sin = rope.cos_cache.to(DEV), rope.sin_cache.to(DEV)
    ref = qkv.clone()
    q, k, v = ref.split([hq * d, hk * d, hk * d], dim=-1)
    qn, kn = rmsnorm(q.reshape(-1, d), qw, 1e-6).view(t, -1), rmsnorm(k.reshape(-1, d), kw, 1e-5).view(t, -1)
    apply_rotary_inplace(positions, qn, kn, cos, sin, d)
    q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
    k_buf = torch.zeros(slots, hk, d, dtype=dtype, device=DEV)
    v_buf = torch.zeros(slots, hk, d, dtype=dtype, device=DEV)
    apply_rotary_inplace(positions, q, k, cos, sin, d, KVWrite(k_buf, v_buf, loc, v), QKNorm(qw, kw, 1e-6, 1e-5))
    _exact_or_ulp(q, qn)
    _exact_or_ulp(k, kn)
    _exact_or_ulp(k_buf[loc].reshape(t, -1), kn)
    assert torch.equal(v_buf[loc].reshape(t, -1), v)
    with pytest.raises(ValueError, match="norm weights"):
        apply_rotary_inplace(positions, q, k, cos, sin, d, None, QKNorm(qw[:-1], kw, 1e-6, 1e-6))


def test_rotary_bad_input() -> None:
    rope = RotaryEmbedding(16, 32, 10000.0)
    with pytest.raises(ValueError, match="head_dim"):
        apply_rotary_inplace(torch.zeros(2, dtype=torch.int64), torch.zeros(2, 24), torch.zeros(2, 16),
                             rope.cos_cache, rope.sin_cache, 16)
    with pytest.raises(ValueError, match="positions"):
        apply_rotary_inplace(torch.zeros(3, dtype=torch.int64), torch.zeros(2, 32), torch.zeros(2, 16),
                             rope.cos_cache, rope.sin_cache, 16)


@pytest.mark.parametrize("src_dtype,pool_dtype", [(torch.float32, torch.float32), (torch.bfloat16, torch.bfloat16),
                                                  (torch.float32, torch.bfloat16)])
def test_store_kv_matches_index_put(src_dtype: torch.dtype, pool_dtype: torch.dtype) -> None:
    hk, d, slots = 2, 40, 32
    g = torch.Generator().manual_seed(3)
    qkv = torch.randn(5, (4 + 2 * hk) * d, generator=g).to(src_dtype)
    k = qkv[:, 4 * d:(4 + hk) * d]  # strided row views, as the models pass them
    v = qkv[:, (4 + hk) * d:]
    loc = torch.tensor([3, 17, 0, 31, 8])
    ref_k = torch.zeros(slots, hk, d, dtype=pool_dtype)
    ref_v = torch.zeros(slots, hk, d, dtype=pool_dtype)
    ref_k[loc] = k.reshape(-1, hk, d).to(pool_dtype)
    ref_v[loc] = v.reshape(-1, hk, d).to(pool_dtype)
    k_buf = torch.zeros(slots, hk, d, dtype=pool_dtype, device=DEV)
    v_buf = torch.zeros(slots, hk, d, dtype=pool_dtype, device=DEV)
    store_kv(k_buf, v_buf, loc.to(DEV), k.to(DEV), v.to(DEV))
    if DEV == "cuda" or src_dtype == pool_dtype:
        assert torch.equal(k_buf.cpu(), ref_k) and torch.equal(v_buf.cpu(), ref_v)
    _exact_or_ulp(k_buf.cpu(), ref_k)
    _exact_or_ulp(v_buf.cpu(), ref_v)
    with pytest.raises(ValueError, match="width"):
        store_kv(k_buf, v_buf, loc.to(DEV), k[:, :d].to(DEV), v[:, :d].to(DEV))
    with pytest.raises(ValueError, match="rows"):
        store_kv(k_buf, v_buf, loc[:2].to(DEV), k.to(DEV), v.to(DEV))


@pytest.mark.parametrize("kind", ["llama", "qwen3", "deepseek_v2", "mixtral"])
def test_models_with_fused_kernels_match_transformers(kind: str, tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The whole model with every fused kernel and the Triton attention backend (interpreted on the CPU) is still
    greedy token-identical to transformers: the kernels compose (in-place rotary on qkv views, strided K/V stores)."""
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.triton_ops import set_fused_kernels

    prompts = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3]]
    hf = make_tiny_model(kind, str(tmp_path))
    from radixserve.layers.moe import topk_kernel

    # MoE: the one-launch norm + router also for these 2-token decode steps (it serves 1 token by default)
    monkeypatch.setattr(topk_kernel, "GATE_TOPK_TOKENS", 16)
    set_fused_kernels(True if DEV == "cpu" else None)  # on CUDA they are on by default
    try:
        runner = make_runner(str(tmp_path), attention_backend="triton", device=DEV)
        ours = StaticBatch(runner).generate(prompts, 8)
    finally:
        set_fused_kernels(None)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 8)
