"""The RMSNorm before an fp8 one-row product folded into the GEMV's launch (`fp8_gemv.NormIn`,
`Fp8LinearMethod.apply_normed`). Under TRITON_INTERPRET=1 on the CPU: the product of the folded norm equals the
norm kernel followed by the plain GEMV (float32: to rounding; the residual sum bit for bit), with the SiLU·mul
epilogue, block-wise scales and q/k/v's rotation; bad arguments are refused; an online-fp8 Llama decodes the tokens
it decodes with the norm kernels."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.quantization.fp8 import quantize_blocks, quantize_rows
from radixserve.layers.quantization.fp8_gemv import NormIn, fp8_skinny_gemv
from radixserve.layers.quantization.fp8_gemv_rope import fp8_qkv_rope
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm, rmsnorm

EPS = 1e-5


def _inputs(k: int, seed: int, dtype: torch.dtype = torch.float32) -> tuple[torch.Tensor, ...]:
    g = torch.Generator().manual_seed(seed)
    x = (torch.randn(1, k, generator=g) * 3).to(dtype)
    res = torch.randn(1, k, generator=g).to(dtype)
    w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    return x, res, w


@pytest.mark.parametrize("silu_mul", [False, True])
@pytest.mark.parametrize("with_residual", [True, False])
@pytest.mark.parametrize("blocks", [False, True])
def test_folded_norm_equals_the_norm_kernel_then_the_gemv(silu_mul: bool, with_residual: bool, blocks: bool) -> None:
    g = torch.Generator().manual_seed(int(silu_mul) + 2 * int(with_residual) + 4 * int(blocks))
    n, k = 64, 512
    w = torch.randn(n, k, generator=g) * 0.1
    q, s = quantize_blocks(w, 16, 128) if blocks else quantize_rows(w)
    block = (16, 128) if blocks else None
    x, res, nw = _inputs(k, 7)
    cfg = GemvConfig("ew", 8, 128, variant="r8")
    if with_residual:
        normed, ref_res = fused_add_rmsnorm(x, res, nw, EPS)
        h_out = torch.empty_like(x)
        norm = NormIn(res, nw, EPS, h_out)
    else:
        normed, norm = rmsnorm(x, nw, EPS), NormIn(None, nw, EPS, None)
    ref = fp8_skinny_gemv(normed, q, s, torch.float32, None, cfg, silu_mul=silu_mul, block=block)
    got = fp8_skinny_gemv(x, q, s, torch.float32, None, cfg, silu_mul=silu_mul, block=block, norm=norm)
    assert got.shape == (1, n // 2 if silu_mul else n)
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    if with_residual:
        assert torch.equal(h_out, ref_res)


def test_folded_norm_in_bf16_stays_within_the_norm_kernels_rounding() -> None:
    """bf16 x: the folded product skips the normed row's two bf16 roundings; it stays within their size."""
    g = torch.Generator().manual_seed(3)
    q, s = quantize_rows(torch.randn(96, 1024, generator=g) * 0.05)
    x, res, nw = _inputs(1024, 11, torch.bfloat16)
    cfg = GemvConfig("ew", 4, 256, variant="r8")
    normed, ref_res = fused_add_rmsnorm(x, res, nw, EPS)
    exact = (normed.float() @ (q.float() * s.view(-1, 1)).t())
    h_out = torch.empty_like(x)
    got = fp8_skinny_gemv(x, q, s, torch.float32, None, cfg, norm=NormIn(res, nw, EPS, h_out))
    h = ref_res.float()
    ideal = (h * torch.rsqrt(h.pow(2).mean() + EPS) * nw.float()) @ (q.float() * s.view(-1, 1)).t()
    assert torch.equal(h_out, ref_res)
    torch.testing.assert_close(got, ideal, rtol=1e-4, atol=1e-4)  # the folded form is the unrounded norm
    assert (got - exact).abs().max() < 0.02 * exact.abs().max()  # and the rounded one differs by bf16's steps


def test_folded_norm_with_the_rotation_equals_the_norm_then_fp8_qkv_rope() -> None:
    g = torch.Generator().manual_seed(5)
    hq, hk, hd, k = 4, 2, 16, 256
    n, half = (hq + 2 * hk) * hd, hd // 2
    q, s = quantize_rows(torch.randn(n, k, generator=g) * 0.1)
    x, res, nw = _inputs(k, 13)
    freqs = torch.arange(64).float()[:, None] * (1e4 ** (-torch.arange(half).float() / half))[None, :]
    cfg = GemvConfig("ew", 4, 64, variant="r8")

    def rope(kv_buf: torch.Tensor, v_buf: torch.Tensor) -> RopeArgs:
        from radixserve.layers.triton_ops.gemv_rope import KVDest

        return RopeArgs(hq, hk, hd, torch.tensor([21]), freqs.cos(), freqs.sin(),
                        KVDest(kv_buf, v_buf, torch.tensor([3]), 1.0, 1.0))

    bufs_ref = [torch.zeros(6, hk, hd) for _ in range(2)]
    bufs = [torch.zeros(6, hk, hd) for _ in range(2)]
    normed, ref_res = fused_add_rmsnorm(x, res, nw, EPS)
    ref = fp8_qkv_rope(normed, q, s, None, rope(*bufs_ref), cfg)
    h_out = torch.empty_like(x)
    got = fp8_qkv_rope(x, q, s, None, rope(*bufs), cfg, norm=NormIn(res, nw, EPS, h_out))
    torch.testing.assert_close(got, ref, rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(bufs[0], bufs_ref[0], rtol=2e-5, atol=2e-5)
    torch.testing.assert_close(bufs[1], bufs_ref[1], rtol=2e-5, atol=2e-5)
    assert torch.equal(h_out, ref_res)


def test_folded_norm_refuses_what_it_cannot_take() -> None:
    q, s = quantize_rows(torch.randn(32, 128))
    x, res, nw = _inputs(128, 1)
    cfg = GemvConfig("ew", 4, 64)
    with pytest.raises(ValueError, match="one row"):
        fp8_skinny_gemv(torch.randn(2, 128), q, s, torch.float32, None, cfg, norm=NormIn(None, nw, EPS, None))
    with pytest.raises(ValueError, match="weight"):
        fp8_skinny_gemv(x, q, s, torch.float32, None, cfg, norm=NormIn(None, nw[:64], EPS, None))
    with pytest.raises(ValueError, match="both or neither"):
        fp8_skinny_gemv(x, q, s, torch.float32, None, cfg, norm=NormIn(res, nw, EPS, None))
    with pytest.raises(ValueError, match="h_out"):
        fp8_skinny_gemv(x, q, s, torch.float32, None, cfg, norm=NormIn(res, nw, EPS, torch.empty(1, 64)))
    # a tensor-core tile for the shape: handed back (the caller runs the norm kernel first)
    assert fp8_skinny_gemv(x, q, s, torch.float32, None, GemvConfig("dot", 16, 64),
                           norm=NormIn(None, nw, EPS, None)) is None


def test_fp8_model_decodes_the_same_tokens_with_the_norms_in_the_gemvs(tmp_path, monkeypatch) -> None:
    """An online-fp8 Llama decoding one prompt on the fused-kernel path: each decode step's q/k/v and gate/up take
    their norm in the GEMV's launch (every layer, no norm kernel before them), and the tokens equal those of the
    same model with the norm kernels."""
    from model_utils import make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import fp8, fp8_gemv, fp8_gemv_rope, gemv_configs
    from radixserve.layers.triton_ops import set_fused_kernels

    make_tiny_model("llama", str(tmp_path), hidden_size=256, intermediate_size=256, num_attention_heads=8,
                    num_key_value_heads=4, num_hidden_layers=2, vocab_size=512)
    real_get = gemv_configs.get

    def few_programs(fam: str, m: int, n: int, k: int, cuda: bool = True) -> GemvConfig:
        if fam in ("fp8", "fp8_silu"):  # large tiles: few programs for the interpreter
            return GemvConfig("ew", 16, 256, variant="r8") if m <= 2 else GemvConfig("dot", 64, 256)
        return real_get(fam, m, n, k, cuda)

    monkeypatch.setattr(gemv_configs, "get", few_programs)
    normed: dict[str, list[bool]] = {"ew": [], "rope": []}

    class Spy:  # records whether each launch of a kernel took a folded norm
        def __init__(self, name: str, kernel) -> None:
            self.name, self.kernel = name, kernel

        def __getitem__(self, grid):
            def run(*args, **kw):
                normed[self.name].append(bool(kw.get("NORM")))
                return self.kernel[grid](*args, **kw)
            return run

    monkeypatch.setattr(fp8_gemv, "_fp8_gemv_ew_kernel", Spy("ew", fp8_gemv._fp8_gemv_ew_kernel))
    monkeypatch.setattr(fp8_gemv_rope, "_fp8_gemv_rope_kernel", Spy("rope", fp8_gemv_rope._fp8_gemv_rope_kernel))
    prompt = [5, 17, 42, 99, 7]
    set_fused_kernels(True)
    try:
        fused = StaticBatch(make_runner(str(tmp_path), quantization="fp8")).generate([prompt], 4)[0]
        # 3 decode steps x 2 layers: q/k/v (the rotation kernel) and gate/up normed; o and down not
        assert normed["rope"] == [True] * 6
        assert normed["ew"].count(True) == 6 and normed["ew"].count(False) == 12
        normed = {"ew": [], "rope": []}
        monkeypatch.setattr(fp8, "FOLD_NORM", False)
        plain = StaticBatch(make_runner(str(tmp_path), quantization="fp8")).generate([prompt], 4)[0]
        assert normed["rope"] == [False] * 6 and normed["ew"] == [False] * 18
    finally:
        set_fused_kernels(None)
    assert fused == plain
