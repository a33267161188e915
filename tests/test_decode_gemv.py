"""The one-row GEMV (`layers/triton_ops/gemv.py`) as the MoE / MLA models call it (`gemv_row_norm`) against torch:
plain, with a bias, two weights side by side, with K not a multiple of the tile, and with the RMSNorm (with and
without the residual add) before it. CPU: under TRITON_INTERPRET=1."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.triton_ops.gemv import gemv_row_norm

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
