"""The one-row q/k/v product with the rotary embedding and the KV store in its epilogue (`triton_ops/gemv_rope.py`)
against the two kernels it replaces (the one-row GEMV, then the rotary kernel storing k/v) — the same bits in the
output and in the pool — and against torch; a tiny Llama and Qwen2 decoding through it stay greedy token-identical
to transformers. CPU: under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.triton_ops.gemv import gemv_row
from radixserve.layers.triton_ops.gemv_rope import KVDest, gemv_qkv_rope
from radixserve.layers.triton_ops.rotary import KVWrite, apply_rotary_inplace

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _case(dtype: torch.dtype, hq: int, hk: int, d: int, k: int, bias: bool, pool_dtype: torch.dtype, seed: int):
    g = torch.Generator().manual_seed(seed)
    n = (hq + 2 * hk) * d
    x = torch.randn(1, k, generator=g).to(dtype).to(DEV)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype).to(DEV)
    b = torch.randn(n, generator=g).to(dtype).to(DEV) if bias else None
    ang = torch.rand(64, d // 2, generator=g) * 6.0
    cos, sin = ang.cos().to(DEV), ang.sin().to(DEV)
    pos = torch.tensor([37], device=DEV)
    loc = torch.tensor([5], device=DEV)
    pools = [torch.zeros(9, hk, d, dtype=pool_dtype, device=DEV) for _ in range(4)]
    return x, w, b, cos, sin, pos, loc, pools


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("hq,hk,d,k,bias,block_n", [(4, 2, 16, 64, False, 2), (4, 1, 16, 40, True, 4),
                                                    (2, 2, 8, 32, True, 1), (6, 2, 16, 48, False, 8)])
def test_gemv_qkv_rope_equals_gemv_then_rotary(dtype: torch.dtype, hq: int, hk: int, d: int, k: int, bias: bool,
                                                block_n: int) -> None:
    x, w, b, cos, sin, pos, loc, (kb, vb, kb_ref, vb_ref) = _case(dtype, hq, hk, d, k, bias, dtype, k + block_n)
    cfg = GemvConfig("ew", block_n, 16)  # K over several runs; 40 and 48 end in a partial one
    out = gemv_qkv_rope(x, w, b, hq, hk, d, pos, cos, sin, KVDest(kb, vb, loc), cfg)
    ref = gemv_row(x, w, b, GemvConfig("ew", 2, 16))
    q, kk, v = ref.split([hq * d, hk * d, hk * d], dim=-1)
    apply_rotary_inplace(pos, q, kk, cos, sin, d, KVWrite(kb_ref, vb_ref, loc, v))
    assert torch.equal(out, ref)
    assert torch.equal(kb, kb_ref) and torch.equal(vb, vb_ref)
    assert kb[5].abs().sum() > 0 and vb[5].abs().sum() > 0 and kb[:5].abs().sum() == 0  # only the token's slot
    # and against torch: the product, then rotate_half on q and k
    full = torch.nn.functional.linear(x.float(), w.float(), b.float() if b is not None else None).to(dtype).float()
    c, s = cos[37].repeat(2), sin[37].repeat(2)
    heads = full.view(hq + 2 * hk, d)
    rot = heads[:hq + hk]
    rot = rot * c + torch.cat([-rot[:, d // 2:], rot[:, :d // 2]], dim=1) * s
    expect = torch.cat([rot, heads[hq + hk:]]).view(1, -1)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(out.float().cpu(), expect.cpu(), rtol=tol, atol=tol)


@pytest.mark.parametrize("pool_dtype", [torch.float8_e4m3fn, torch.float8_e5m2])
def test_gemv_qkv_rope_fp8_pool_with_scales(pool_dtype: torch.dtype) -> None:
    x, w, b, cos, sin, pos, loc, (kb, vb, kb_ref, vb_ref) = _case(torch.bfloat16, 4, 2, 16, 64, True, pool_dtype, 3)
    w = w * 40  # some values past the format's range at scale 1 / 0.5: the clamp matters
    out = gemv_qkv_rope(x, w, b, 4, 2, 16, pos, cos, sin, KVDest(kb, vb, loc, 0.5, 2.0), GemvConfig("ew", 4, 32))
    ref = gemv_row(x, w, b, GemvConfig("ew", 2, 32))
    q, kk, v = ref.split([64, 32, 32], dim=-1)
    apply_rotary_inplace(pos, q, kk, cos, sin, 16, KVWrite(kb_ref, vb_ref, loc, v, 0.5, 2.0))
    assert torch.equal(out, ref)
    assert torch.equal(kb.view(torch.uint8), kb_ref.view(torch.uint8))
    assert torch.equal(vb.view(torch.uint8), vb_ref.view(torch.uint8))
    assert not torch.isnan(kb.float()).any()


def test_gemv_qkv_rope_without_kv_store_and_bad_arguments() -> None:
    x, w, b, cos, sin, pos, loc, (kb, vb, _, _) = _case(torch.float32, 2, 1, 8, 32, False, torch.float32, 1)
    cfg = GemvConfig("ew", 2, 16)
    out = gemv_qkv_rope(x, w, None, 2, 1, 8, pos, cos, sin, None, cfg)
    ref = gemv_row(x, w, None, cfg)
    q, kk, _ = ref.split([16, 8, 8], dim=-1)
    apply_rotary_inplace(pos, q, kk, cos, sin, 8)
    assert torch.equal(out, ref)
    with pytest.raises(ValueError, match="heads"):
        gemv_qkv_rope(x, w, None, 3, 1, 8, pos, cos, sin, None, cfg)
    with pytest.raises(ValueError, match="tile half a head"):
        gemv_qkv_rope(x, w, None, 2, 1, 8, pos, cos, sin, None, GemvConfig("ew", 3, 16))
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv_qkv_rope(x.expand(2, -1), w, None, 2, 1, 8, pos, cos, sin, None, cfg)
    with pytest.raises(ValueError, match="bias"):
        gemv_qkv_rope(x, w, torch.zeros(3, device=DEV), 2, 1, 8, pos, cos, sin, None, cfg)
    with pytest.raises(ValueError, match="k_buf"):
        gemv_qkv_rope(x, w, None, 2, 1, 8, pos, cos, sin, KVDest(kb[:, :, :4], vb, loc), cfg)


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model under the interpreter (GPU: tests/gpu)")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_models_decode_through_gemv_rope_token_identical(kind: str, tmp_path, monkeypatch: pytest.MonkeyPatch
                                                         ) -> None:
    """A tiny Llama / Qwen2 (q/k/v bias) with the fused kernels on: every one-row step's attention takes the fused
    q/k/v + rotary + KV store, and the greedy tokens equal transformers' in float32."""
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.triton_ops import gemv_rope, set_fused_kernels

    hf = make_tiny_model(kind, str(tmp_path), initializer_range=0.08)
    runner = make_runner(str(tmp_path))
    calls: list[int] = []
    real = gemv_rope.gemv_qkv_rope
    monkeypatch.setattr(gemv_rope, "gemv_rope_config", lambda w, d: GemvConfig("ew", 2, 32))

    def counting(x: torch.Tensor, *args: object) -> torch.Tensor:
        calls.append(x.shape[1])
        return real(x, *args)

    monkeypatch.setattr(gemv_rope, "gemv_qkv_rope", counting)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    set_fused_kernels(True)
    try:
        ours = StaticBatch(runner).generate([prompt], 4)[0]
    finally:
        set_fused_kernels(None)
    assert ours == hf_greedy(hf, prompt, 4)
    assert len(calls) == 3 * hf.config.num_hidden_layers  # three one-row steps, every layer fused
