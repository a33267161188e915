"""The one-row GEMV (`layers/triton_ops/gemv.py`) as the MoE / MLA models call it (`gemv_row_norm`) against torch:
plain, with a bias, two weights side by side, with K not a multiple of the tile, and with the RMSNorm (with and
without the residual add) before it. CPU: under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.triton_ops.gemv import STAT_SLOTS, gemv_row_chain, gemv_row_norm

DEV = "cuda" if torch.cuda.is_available() else "cpu"
CFG = None if DEV == "cuda" else GemvConfig("ew", 4, 32)  # the interpreter: small tiles, K spans several blocks


def _close(a: torch.Tensor, b: torch.Tensor) -> None:
    tol = 2e-5 if a.dtype == torch.float32 else 3e-2
    torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("n1,n2,k,bias", [(40, 0, 96, False), (38, 0, 80, True), (24, 10, 64, False),
                                          (16, 6, 72, True)])
def test_gemv_row_norm_plain_matches_torch(dtype: torch.dtype, n1: int, n2: int, k: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n1 * 100 + k)
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n1, k, generator=g) / k ** 0.5).to(dtype)
    w2 = (torch.randn(n2, k, generator=g) / k ** 0.5).to(dtype) if n2 else None
    b = torch.randn(n1 + n2, generator=g).to(dtype) if bias else None
    full = torch.cat([w, w2]) if w2 is not None else w
    ref = torch.nn.functional.linear(x.float(), full.float(), b.float() if b is not None else None)
    out, res = gemv_row_norm(x.to(DEV), w.to(DEV), b.to(DEV) if b is not None else None,
                             w2.to(DEV) if w2 is not None else None, config=CFG)
    assert res is None and out.shape == (1, n1 + n2) and out.dtype == dtype
    _close(out.cpu(), ref)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("n2", [0, 12])
def test_gemv_row_norm_with_norm_matches_layers(dtype: torch.dtype, residual: bool, n2: int) -> None:
    """RMSNorm (+ the residual add) then the product, against the layers' own RMSNorm and F.linear."""
    k, n1 = 96, 36
    g = torch.Generator().manual_seed(7 + n2 + residual)
    norm = RMSNorm(k, 1e-6)
    norm.weight.data = (torch.rand(k, generator=g) + 0.5).to(dtype)
    x = (torch.randn(1, k, generator=g) * 3).to(dtype)
    r = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(n1, k, generator=g) / k ** 0.5).to(dtype)
    w2 = (torch.randn(n2, k, generator=g) / k ** 0.5).to(dtype) if n2 else None
    if residual:
        normed, ref_res = norm(x, r)
    else:
        normed, ref_res = norm(x), None
    full = torch.cat([w, w2]) if w2 is not None else w
    ref = torch.nn.functional.linear(normed.float(), full.float())
    out, res = gemv_row_norm(x.to(DEV), w.to(DEV), None, w2.to(DEV) if w2 is not None else None,
                             norm=(r.to(DEV) if residual else None, norm.weight.to(DEV), 1e-6), config=CFG)
    _close(out.cpu(), ref)
    if residual:
        # the sum rounded once: exact in float32; in bfloat16 one step apart at most (the CPU interpreter truncates
        # float32 to bfloat16 where torch and the GPU round to nearest)
        tol = 0 if dtype == torch.float32 else 8e-3
        torch.testing.assert_close(res.cpu(), ref_res, rtol=tol, atol=tol)
    else:
        assert res is None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("k,n,bias", [(96, 80, False), (72, 40, True)])
def test_gemv_row_chain_matches_norm_and_linear(dtype: torch.dtype, k: int, n: int, bias: bool) -> None:
    """o_proj with the residual add in its epilogue (and the sum of squares left in the statistics), then gate_up
    with the norm from those statistics and SiLU·mul, then down with the next residual add: the same values as
    F.linear, the layers' RMSNorm (with the add) and SiluAndMul; the statistics are the new residual's."""
    from radixserve.layers.activation import SiluAndMul

    g = torch.Generator().manual_seed(k + n + bias)
    norm = RMSNorm(n, 1e-6)
    norm.weight.data = (torch.rand(n, generator=g) + 0.5).to(dtype)
    a = torch.randn(1, k, generator=g).to(dtype)
    r = (torch.randn(1, n, generator=g) * 2).to(dtype)
    w_o = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b_o = torch.randn(n, generator=g).to(dtype) if bias else None
    w_gu = (torch.randn(2 * k, n, generator=g) / n ** 0.5).to(dtype)
    w_d = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    # the layers' path
    o = torch.nn.functional.linear(a, w_o, b_o)
    normed, r_mid = norm(o, r)
    act = SiluAndMul()(torch.nn.functional.linear(normed, w_gu))
    r_out = torch.nn.functional.linear(act, w_d) + r_mid
    # the chain
    stats = torch.zeros(2, STAT_SLOTS, device=DEV)
    d = lambda t: t.to(DEV) if t is not None else None  # noqa: E731
    got_mid = gemv_row_chain(d(a), d(w_o), d(b_o), CFG, add_to=(d(r), stats[0]))
    got_act = gemv_row_chain(got_mid, d(w_gu), None, CFG, silu_mul=True, norm_from=(stats[0], d(norm.weight), 1e-6))
    got_out = gemv_row_chain(got_act, d(w_d), None, CFG, add_to=(got_mid, stats[1]))
    # one rounding step apart at most in bfloat16 (the interpreter truncates where torch rounds to nearest)
    tol = 2e-5 if dtype == torch.float32 else 3e-2
    for got, ref in ((got_mid, r_mid), (got_act, act), (got_out, r_out)):
        torch.testing.assert_close(got.cpu().float(), ref.float(), rtol=tol, atol=tol)
    for slot, ref in ((0, got_mid), (1, got_out)):
        torch.testing.assert_close(stats[slot].sum().cpu(), ref.float().pow(2).sum().cpu(), rtol=1e-5, atol=1e-5)


def test_gemv_row_chain_rejects_bad_statistics() -> None:
    x, w = torch.randn(1, 16), torch.randn(8, 16)
    with pytest.raises(ValueError, match="statistics"):
        gemv_row_chain(x, w, None, CFG, add_to=(torch.randn(1, 8), torch.zeros(STAT_SLOTS - 1)))
    with pytest.raises(ValueError, match="statistics"):
        gemv_row_chain(x, w, None, CFG, norm_from=(torch.zeros(STAT_SLOTS, dtype=torch.float64), torch.ones(16),
                                                   1e-6))
    with pytest.raises(ValueError, match="norm weight"):
        gemv_row_chain(x, w, None, CFG, norm_from=(torch.zeros(STAT_SLOTS), torch.ones(15), 1e-6))
    with pytest.raises(ValueError, match="residual"):
        gemv_row_chain(x, w, None, CFG, add_to=(torch.randn(1, 7), torch.zeros(STAT_SLOTS)))


def test_gemv_row_norm_rejects_bad_shapes() -> None:
    x = torch.randn(2, 16)
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv_row_norm(x, torch.randn(8, 16))
    with pytest.raises(ValueError, match="does not fit"):
        gemv_row_norm(x[:1], torch.randn(8, 12))
    with pytest.raises(ValueError, match="bias"):
        gemv_row_norm(x[:1], torch.randn(8, 16), torch.randn(7))
    with pytest.raises(ValueError, match="norm weight"):
        gemv_row_norm(x[:1], torch.randn(8, 16), norm=(None, torch.randn(15), 1e-6))


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model under the interpreter (GPU: tests/gpu)")
@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v2", "deepseek_v2_lora"])
def test_models_decode_through_the_gemv_token_identical(kind: str, tmp_path, monkeypatch: pytest.MonkeyPatch
                                                        ) -> None:
    """A tiny MoE / MLA model with the fused kernels on (interpreted on the CPU): its one-row decode steps take the
    GEMV (the input norm with q/k/v, or with q and kv_a, and o_proj) and stay greedy token-identical to
    transformers in float32."""
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.triton_ops import gemv as gemv_mod
    from radixserve.layers.triton_ops import set_fused_kernels

    hf = make_tiny_model(kind, str(tmp_path), initializer_range=0.08)
    runner = make_runner(str(tmp_path))
    calls: list[tuple[int, bool]] = []
    real = gemv_mod.gemv_row_norm

    def counting(x: torch.Tensor, w: torch.Tensor, *args: object, **kwargs: object) -> object:
        calls.append((w.shape[0], kwargs.get("norm") is not None))
        return real(x, w, *args, config=GemvConfig("ew", 4, 32), **{k: v for k, v in kwargs.items() if k != "config"})

    monkeypatch.setattr(gemv_mod, "gemv_row_norm", counting)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    set_fused_kernels(True)
    try:
        ours = StaticBatch(runner).generate([prompt], 4)[0]
    finally:
        set_fused_kernels(None)
    assert ours == hf_greedy(hf, prompt, 4)
    layers = hf.config.num_hidden_layers
    assert sum(norm for _, norm in calls) == 3 * layers  # three decode steps, every layer's input norm fused
    assert len(calls) == 3 * layers * 2  # and o_proj


@pytest.mark.skipif(torch.cuda.is_available(), reason="the CPU model under the interpreter (GPU: tests/gpu)")
@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_dense_models_decode_through_the_chain_token_identical(kind: str, tmp_path,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny dense model with the fused kernels on (interpreted on the CPU) and tiles for every product: its
    one-row decode steps run each layer as the chain of four one-row products with the norms inside them
    (q/k/v and gate_up normalise from the statistics o_proj and down_proj leave), and stay greedy token-identical
    to transformers in float32 (qwen2: q/k/v with a bias)."""
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.triton_ops import gemv as gemv_mod
    from radixserve.layers.triton_ops import set_fused_kernels

    hf = make_tiny_model(kind, str(tmp_path), initializer_range=0.08)
    runner = make_runner(str(tmp_path))
    monkeypatch.setattr(gemv_mod, "gemv_config", lambda w, silu_mul=False: GemvConfig("ew", 4, 32))
    calls: list[tuple[bool, bool]] = []
    real = gemv_mod.gemv_row_chain

    def counting(x: torch.Tensor, w: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append((kwargs.get("norm_from") is not None, kwargs.get("add_to") is not None))
        return real(x, w, *args, **kwargs)

    monkeypatch.setattr(gemv_mod, "gemv_row_chain", counting)
    prompt = [5, 17, 42, 99, 3, 250, 7]
    set_fused_kernels(True)
    try:
        ours = StaticBatch(runner).generate([prompt], 4)[0]
    finally:
        set_fused_kernels(None)
    assert ours == hf_greedy(hf, prompt, 4)
    layers = hf.config.num_hidden_layers
    assert len(calls) == 3 * layers * 4  # three decode steps, four products a layer
    assert sum(n for n, _ in calls) == 3 * (2 * layers - 1)  # every norm but the first layer's input norm
    assert sum(a for _, a in calls) == 3 * 2 * layers  # every residual add
