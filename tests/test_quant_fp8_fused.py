"""The one-row fp8 GEMV with the RMSNorm in its launch and, for q/k/v, the rotation and KV store in its epilogue
(`fp8_gemv_fused`). Under TRITON_INTERPRET=1 on the CPU: the fused product equals the norm kernel followed by the
plain elementwise GEMV bit for bit (and SiLU·mul's epilogue too), the rotation equals the reference formula with k
and v stored at the token's slot only, bad shapes are refused, and an online-fp8 Llama decodes the tokens it decodes
with the hooks off."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.quantization.fp8 import quantize_rows
from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
from radixserve.layers.quantization.fp8_gemv_fused import fp8_normed_gemv
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
from radixserve.layers.triton_ops.gemv_rope import KVDest
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm, rmsnorm


def _weights(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    return quantize_rows(torch.randn(n, k, generator=g) * 0.1)


def _normed(x: torch.Tensor, res: torch.Tensor | None, nw: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
    if res is None:
        return rmsnorm(x, nw, 1e-5), None
    return fused_add_rmsnorm(x, res, nw, 1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("variant,silu_mul", [("r8", False), ("f16+ef", False), ("r8+ef", True), ("", True)])
def test_normed_gemv_equals_the_norm_then_the_gemv(dtype: torch.dtype, with_residual: bool, variant: str,
                                                   silu_mul: bool) -> None:
    g = torch.Generator().manual_seed(len(variant) + 2 * silu_mul + with_residual)
    k, n = 384, 2 * 52 if silu_mul else 50  # rows not a multiple of the tile; K three 128-column steps
    q, s = _weights(n, k, g)
    x = (torch.randn(1, k, generator=g) * 3).to(dtype)
    res = torch.randn(1, k, generator=g).to(dtype) if with_residual else None
    nw = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    cfg = GemvConfig("ew", 4, 128, variant=variant)
    out, new_res, rotated = fp8_normed_gemv(x, res, nw, 1e-5, q, s, bias, silu_mul=silu_mul, config=cfg)
    ref_in, ref_res = _normed(x, res, nw)
    ref = fp8_skinny_gemv(ref_in, q, s, dtype, bias, cfg, silu_mul=silu_mul)
    assert not rotated and out.shape == ref.shape
    assert torch.equal(out, ref)
    assert (new_res is None) == (res is None)
    if res is not None:
        assert torch.equal(new_res, ref_res)


@pytest.mark.parametrize("block_n,head_dim,with_kv,fp8_kv", [(4, 16, True, False), (2, 16, True, True),
                                                             (8, 32, False, False)])
def test_normed_qkv_rope_equals_the_product_then_the_rotation(block_n: int, head_dim: int, with_kv: bool,
                                                              fp8_kv: bool) -> None:
    """R = block_n / 2 rows of each half-head run a program: q and k rotated by the reference formula, v as the
    product left it, k and v stored at slot 5 only (an fp8 pool: k / k_scale and v / v_scale, saturated)."""
    g = torch.Generator().manual_seed(block_n + head_dim)
    hq, hk, k = 4, 2, 256
    n, half = (hq + 2 * hk) * head_dim, head_dim // 2
    q, s = _weights(n, k, g)
    x, res = torch.randn(1, k, generator=g), torch.randn(1, k, generator=g)
    nw, bias = 1 + 0.2 * torch.randn(k, generator=g), torch.randn(n, generator=g)
    cfg = GemvConfig("ew", block_n, 64, variant="r8")
    freqs = torch.arange(64).float()[:, None] * (1e4 ** (-torch.arange(half).float() / half))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    kv_dtype = torch.float8_e4m3fn if fp8_kv else torch.float32
    kv = KVDest(torch.zeros(8, hk, head_dim, dtype=kv_dtype), torch.zeros(8, hk, head_dim, dtype=kv_dtype),
                torch.tensor([5]), 0.5, 2.0) if with_kv else None
    out, new_res, rotated = fp8_normed_gemv(x, res, nw, 1e-5, q, s, bias,
                                            rope=RopeArgs(hq, hk, head_dim, torch.tensor([37]), cos, sin, kv),
                                            config=cfg)
    assert rotated
    ref_in, ref_res = _normed(x, res, nw)
    assert torch.equal(new_res, ref_res)
    plain = fp8_skinny_gemv(ref_in, q, s, torch.float32, bias, cfg).view(hq + 2 * hk, head_dim)
    x1, x2 = plain[:, :half], plain[:, half:]
    ref = torch.cat([x1 * cos[37] - x2 * sin[37], x2 * cos[37] + x1 * sin[37]], dim=-1)
    ref[hq + hk:] = plain[hq + hk:]  # v is not rotated
    torch.testing.assert_close(out.view(hq + 2 * hk, head_dim), ref, rtol=1e-5, atol=1e-5)
    if with_kv:
        if fp8_kv:
            torch.testing.assert_close(kv.k_buf[5].float(), (ref[hq:hq + hk] / 0.5).clamp(-448, 448).to(kv_dtype)
                                       .float(), rtol=0.07, atol=1e-3)
            torch.testing.assert_close(kv.v_buf[5].float(), (ref[hq + hk:] / 2.0).to(kv_dtype).float(),
                                       rtol=0, atol=0)
        else:
            torch.testing.assert_close(kv.k_buf[5], ref[hq:hq + hk], rtol=1e-5, atol=1e-5)
            torch.testing.assert_close(kv.v_buf[5], ref[hq + hk:], rtol=0, atol=0)
        others = torch.arange(8) != 5
        assert not kv.k_buf[others].float().any() and not kv.v_buf[others].float().any()


def test_normed_gemv_refuses_what_it_cannot_take() -> None:
    g = torch.Generator().manual_seed(0)
    q, s = _weights(32, 128, g)
    x, nw = torch.randn(1, 128), torch.ones(128)
    with pytest.raises(ValueError, match="one contiguous"):
        fp8_normed_gemv(torch.randn(2, 128), None, nw, 1e-6, q, s, None)
    with pytest.raises(ValueError, match="norm weight"):
        fp8_normed_gemv(x, None, torch.ones(64), 1e-6, q, s, None)
    with pytest.raises(ValueError, match="does not fit"):
        fp8_normed_gemv(x, None, nw, 1e-6, q, s[:8], None)
    with pytest.raises(ValueError, match="not both"):
        fp8_normed_gemv(x, None, nw, 1e-6, q, s, None, silu_mul=True,
                        rope=RopeArgs(1, 0, 32, torch.tensor([0]), torch.ones(4, 16), torch.ones(4, 16), None))
    # the tensor-core tile for the shape: not this kernel (the caller keeps the norm kernel)
    assert fp8_normed_gemv(x, None, nw, 1e-6, q, s, None, config=GemvConfig("dot", 16, 64)) is None
    # tiles that do not pair the rotary halves: the plain product, not rotated
    rope = RopeArgs(2, 1, 6, torch.tensor([0]), torch.ones(4, 3), torch.ones(4, 3), None)  # half a head: 3 rows
    out, _, rotated = fp8_normed_gemv(x, None, nw, 1e-6, q, s, None, rope=rope, config=GemvConfig("ew", 4, 64))
    assert not rotated and torch.equal(out, fp8_skinny_gemv(rmsnorm(x, nw, 1e-6), q, s, torch.float32, None,
                                                            GemvConfig("ew", 4, 64)))


def test_fp8_model_decodes_the_same_tokens_with_the_norm_folded(tmp_path, monkeypatch) -> None:
    """An online-fp8 Llama decoding one prompt on the fused-kernel path: each decode step folds the input norm into
    q/k/v (rotation and KV store in its epilogue) and the post-attention norm into gate/up (SiLU·mul in its
    epilogue), and gives the tokens of the same model with the hooks off."""
    from model_utils import make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import fp8_gemv_fused, gemv_configs
    from radixserve.layers.quantization.fp8 import Fp8LinearMethod
    from radixserve.layers.triton_ops import set_fused_kernels

    make_tiny_model("llama", str(tmp_path), hidden_size=256, intermediate_size=256, num_attention_heads=8,
                    num_key_value_heads=4, num_hidden_layers=2, vocab_size=512)
    real_get = gemv_configs.get

    def few_programs(fam: str, m: int, n: int, k: int, cuda: bool = True) -> GemvConfig:
        if fam in ("fp8", "fp8_silu"):  # large tiles: few programs for the interpreter
            return GemvConfig("ew", 16, 256, variant="r8") if m <= 2 else GemvConfig("dot", 64, 256)
        return real_get(fam, m, n, k, cuda)

    monkeypatch.setattr(gemv_configs, "get", few_programs)
    calls: list[tuple[bool, bool]] = []
    real = fp8_gemv_fused.fp8_normed_gemv

    def counted(*a, **kw):
        out = real(*a, **kw)
        calls.append((out[2], kw.get("silu_mul", False)))
        return out

    monkeypatch.setattr(fp8_gemv_fused, "fp8_normed_gemv", counted)
    prompt = [5, 17, 42, 99, 7]
    set_fused_kernels(True)
    try:
        fused = StaticBatch(make_runner(str(tmp_path), quantization="fp8")).generate([prompt], 4)[0]
        monkeypatch.setattr(Fp8LinearMethod, "apply_normed", lambda *a: None)
        plain = StaticBatch(make_runner(str(tmp_path), quantization="fp8")).generate([prompt], 4)[0]
    finally:
        set_fused_kernels(None)
    # 3 decode steps x 2 layers: q/k/v rotated, gate/up activated
    assert calls.count((True, False)) == 6 and calls.count((False, True)) == 6 and len(calls) == 12
    assert fused == plain
