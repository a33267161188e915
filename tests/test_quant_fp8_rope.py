"""The one-row fp8 q/k/v GEMV with the rotation and the KV store in its epilogue (`fp8_gemv_rope`). Under
TRITON_INTERPRET=1 on the CPU: q and k equal the plain elementwise GEMV rotated by the reference formula, v equals it
bit for bit, k and v land at the token's slot only (bf16 / float32 and fp8 pools), shapes it cannot take are refused
or handed back, and an online-fp8 Llama decodes the tokens it decodes with the rotary kernel instead."""

from __future__ import annotations

import pytest
import torch
import triton
import triton.language as tl

from radixserve.layers.quantization.fp8 import quantize_rows
from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
from radixserve.layers.quantization.fp8_gemv_rope import fp8_qkv_rope
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
from radixserve.layers.triton_ops.gemv_rope import KVDest


@triton.jit
def _cast_kernel(X, Y, BLOCK: tl.constexpr):
    i = tl.arange(0, BLOCK)
    tl.store(Y + i, tl.load(X + i).to(Y.dtype.element_ty))


def _triton_fp8(t: torch.Tensor) -> torch.Tensor:
    """t converted to float8_e4m3fn by Triton's own conversion (the interpreter's on the CPU, which rounds
    [1.9375, 2) down to 1.0 where torch gives 2.0): what the kernel's stores produce here."""
    out = torch.empty(t.shape, dtype=torch.float8_e4m3fn)
    _cast_kernel[(1,)](t.contiguous(), out, BLOCK=t.numel())
    return out


def _caches(half: int) -> tuple[torch.Tensor, torch.Tensor]:
    freqs = torch.arange(64).float()[:, None] * (1e4 ** (-torch.arange(half).float() / half))[None, :]
    return freqs.cos(), freqs.sin()


@pytest.mark.parametrize("block_n,head_dim,variant,with_kv,fp8_kv", [
    (4, 16, "r8", True, False), (2, 16, "f16+ef", True, True), (8, 32, "", False, False)])
def test_fp8_qkv_rope_equals_the_gemv_then_the_rotation(block_n: int, head_dim: int, variant: str, with_kv: bool,
                                                        fp8_kv: bool) -> None:
    """R = block_n / 2 rows of each half-head run a program: q and k rotated by the reference formula, v as the
    plain product left it, k and v stored at slot 5 only (an fp8 pool: k / k_scale and v / v_scale, saturated)."""
    g = torch.Generator().manual_seed(block_n + head_dim)
    hq, hk, k = 4, 2, 256
    n, half = (hq + 2 * hk) * head_dim, head_dim // 2
    q, s = quantize_rows(torch.randn(n, k, generator=g) * 0.1)
    x, bias = torch.randn(1, k, generator=g), torch.randn(n, generator=g)
    cfg = GemvConfig("ew", block_n, 64, variant=variant)
    cos, sin = _caches(half)
    kv_dtype = torch.float8_e4m3fn if fp8_kv else torch.float32
    kv = KVDest(torch.zeros(8, hk, head_dim, dtype=kv_dtype), torch.zeros(8, hk, head_dim, dtype=kv_dtype),
                torch.tensor([5]), 0.5, 2.0) if with_kv else None
    out = fp8_qkv_rope(x, q, s, bias, RopeArgs(hq, hk, head_dim, torch.tensor([37]), cos, sin, kv), cfg)
    plain = fp8_skinny_gemv(x, q, s, torch.float32, bias, cfg).view(hq + 2 * hk, head_dim)
    x1, x2 = plain[:, :half], plain[:, half:]
    ref = torch.cat([x1 * cos[37] - x2 * sin[37], x2 * cos[37] + x1 * sin[37]], dim=-1)
    ref[hq + hk:] = plain[hq + hk:]  # v is not rotated
    got = out.view(hq + 2 * hk, head_dim)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert torch.equal(got[hq + hk:], plain[hq + hk:])
    if with_kv:
        if fp8_kv:  # k / k_scale and v / v_scale, saturated, converted as Triton converts here
            assert torch.equal(kv.k_buf[5].float(), _triton_fp8((got[hq:hq + hk] / 0.5).clamp(-448, 448)).float())
            assert torch.equal(kv.v_buf[5].float(), _triton_fp8(plain[hq + hk:] / 2.0).float())
        else:
            assert torch.equal(kv.k_buf[5], got[hq:hq + hk]) and torch.equal(kv.v_buf[5], plain[hq + hk:])
        others = torch.arange(8) != 5
        assert not kv.k_buf[others].float().any() and not kv.v_buf[others].float().any()


def test_fp8_qkv_rope_refuses_or_hands_back_what_it_cannot_take() -> None:
    g = torch.Generator().manual_seed(0)
    q, s = quantize_rows(torch.randn(48, 128, generator=g))
    cos, sin = _caches(4)
    rope = RopeArgs(4, 1, 8, torch.tensor([3]), cos, sin, None)  # (4 + 2) heads x 8 = 48 rows
    x = torch.randn(1, 128, generator=g)
    with pytest.raises(ValueError, match="one row"):
        fp8_qkv_rope(torch.randn(2, 128), q, s, None, rope)
    with pytest.raises(ValueError, match="does not fit"):
        fp8_qkv_rope(x, q, s[:8], None, rope)
    with pytest.raises(ValueError, match="heads"):
        fp8_qkv_rope(x, q, s, None, RopeArgs(4, 2, 8, torch.tensor([3]), cos, sin, None), GemvConfig("ew", 4, 64))
    assert fp8_qkv_rope(x, q, s, None, rope, GemvConfig("dot", 16, 64)) is None  # the tensor-core tile
    assert fp8_qkv_rope(x, q, s, None, rope, GemvConfig("ew", 16, 64)) is None  # 8 rows a run: half a head is 4
    assert fp8_qkv_rope(x, q, s, None, rope, GemvConfig("ew", 8, 64)) is not None


def test_fp8_model_decodes_the_same_tokens_with_the_rotation_in_the_gemv(tmp_path, monkeypatch) -> None:
    """An online-fp8 Llama decoding one prompt on the fused-kernel path: every decode step's q/k/v rotates q and k
    and stores k and v in its epilogue, and the tokens equal those of the same model with the rotary kernel."""
    from model_utils import make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import fp8_gemv_rope, gemv_configs
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
    calls: list[int] = []
    real = fp8_gemv_rope.fp8_qkv_rope
    monkeypatch.setattr(fp8_gemv_rope, "fp8_qkv_rope", lambda *a: calls.append(1) or real(*a))
    prompt = [5, 17, 42, 99, 7]
    set_fused_kernels(True)
    try:
        fused = StaticBatch(make_runner(str(tmp_path), quantization="fp8")).generate([prompt], 4)[0]
        assert len(calls) == 3 * 2  # 3 decode steps x 2 layers
        monkeypatch.setattr(Fp8LinearMethod, "apply_rope", lambda *a: None)
        plain = StaticBatch(make_runner(str(tmp_path), quantization="fp8")).generate([prompt], 4)[0]
    finally:
        set_fused_kernels(None)
    assert len(calls) == 6
    assert fused == plain
