"""The 16-bit product of 17..256 rows (`layers/triton_ops/gemm_mid.py`) against torch: whole and split over K (the last
split's ticket sums the partials), M not a multiple of the tile, a bias, SiLU·mul of a stacked [gate; up] in the
epilogue (against the unfused product and activation), the ticket counts back at zero after each launch; the
committed table's entries fit their shapes; the table lookup (`mid_config`: "cublas" entries and missing shapes keep
cuBLAS) and a linear layer taking the kernel from the table. CPU: under TRITON_INTERPRET=1 (GPU: the same tests on
CUDA)."""

from __future__ import annotations

import json
import os

import pytest
import torch

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.triton_ops import gemm_mid
from radixserve.layers.triton_ops.gemm_mid import mid_mm

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _cfg(bn: int, bm: int, bk: int, split: int) -> GemvConfig:
    return GemvConfig("tn", bn, bk, 4, 3, block_m=bm, split_k=split)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("m,n,k,bn,bm,bk,split,bias,silu", [
    (17, 48, 64, 16, 16, 32, 1, False, False),   # two row blocks, the second one row; N not a multiple of block_n
    (40, 64, 128, 32, 32, 32, 2, True, False),   # split over K with a bias
    (33, 40, 192, 16, 16, 16, 4, False, False),  # four splits, partial tiles in both dimensions
    (20, 80, 64, 16, 16, 32, 1, True, True),     # [gate; up] of 40 rows each, the activation in the epilogue
    (36, 48, 128, 16, 32, 32, 2, False, True),   # ... split over K (both partials summed by the last split)
])
def test_mid_mm_matches_torch(dtype: torch.dtype, m: int, n: int, k: int, bn: int, bm: int, bk: int, split: int,
                              bias: bool, silu: bool) -> None:
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    b = torch.randn(n, generator=g).to(dtype) if bias else None
    ref = torch.nn.functional.linear(x.float(), w.float(), b.float() if b is not None else None)
    if silu:  # as the unfused path rounds: the product in dtype, then silu(gate) * up
        gate, up = ref.to(dtype).float().chunk(2, dim=-1)
        ref = (torch.nn.functional.silu(gate).to(dtype).float() * up)
    out = mid_mm(x.to(DEV), w.to(DEV), b.to(DEV) if b is not None else None, _cfg(bn, bm, bk, split), silu_mul=silu)
    assert out.shape == (m, n // 2 if silu else n) and out.dtype == dtype
    tol = 1e-4 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(out.float().cpu(), ref, rtol=tol, atol=tol)
    if split > 1:  # every ticket count is back at zero for the next launch (and the next graph replay)
        assert int(gemm_mid._tickets(torch.device(DEV)).abs().sum()) == 0
        again = mid_mm(x.to(DEV), w.to(DEV), b.to(DEV) if b is not None else None, _cfg(bn, bm, bk, split),
                       silu_mul=silu)
        assert torch.equal(again, out)


def test_mid_mm_rejects_what_it_cannot_take() -> None:
    x = torch.randn(20, 96)
    with pytest.raises(ValueError, match="multiple of split_k"):
        mid_mm(x, torch.randn(32, 96), None, _cfg(16, 16, 64, 2))
    with pytest.raises(ValueError, match="one dtype"):
        mid_mm(x, torch.randn(32, 96, dtype=torch.bfloat16), None, _cfg(16, 16, 32, 1))
    with pytest.raises(ValueError, match="bias"):
        mid_mm(x, torch.randn(32, 96), torch.randn(31), _cfg(16, 16, 32, 1))
    with pytest.raises(ValueError, match="even rows"):
        mid_mm(x, torch.randn(33, 96), None, _cfg(16, 16, 32, 1), silu_mul=True)


@pytest.fixture
def table(tmp_path, monkeypatch):  # noqa: ANN001, ANN201
    entries = {"mid16/64/96/256": {"kernel": "tn", "block_n": 16, "block_k": 32, "block_m": 16, "split_k": 2},
               "mid16/160/96/256": {"kernel": "cublas", "block_n": 0, "block_k": 0},
               "mid16_silu/64/192/256": {"kernel": "tn", "block_n": 16, "block_k": 64, "block_m": 32}}
    path = tmp_path / "mid.json"
    path.write_text(json.dumps({"configs": entries}))
    monkeypatch.setenv("RADIXSERVE_GEMV_CONFIGS", str(path))
    gemv_configs.reload()
    yield
    monkeypatch.delenv("RADIXSERVE_GEMV_CONFIGS")
    gemv_configs.reload()


class _CudaLike:
    """A weight that says it is on CUDA (the lookup's device check) without being there."""

    def __init__(self, n: int, k: int) -> None:
        self.shape, self.dtype, self.is_cuda = (n, k), torch.bfloat16, True

    def dim(self) -> int:
        return 2

    def stride(self, d: int) -> int:
        return 1


def test_mid_config_follows_the_table(table) -> None:  # noqa: ANN001
    w = _CudaLike(96, 256)
    assert gemm_mid.mid_config(w, 16) is None  # one-row-GEMV territory and below
    cfg = gemm_mid.mid_config(w, 17)
    assert cfg is not None and (cfg.block_n, cfg.split_k) == (16, 2)
    assert gemm_mid.mid_config(w, 64) == cfg
    assert gemm_mid.mid_config(w, 65) is None  # the 160-row entry says cuBLAS
    assert gemm_mid.mid_config(w, 257) is None
    assert gemm_mid.mid_config(_CudaLike(128, 256), 64) is None  # a shape the table lacks
    assert gemm_mid.mid_config(w, 64, silu_mul=True) is None  # the activation's family is keyed on its own
    assert gemm_mid.mid_config(_CudaLike(192, 256), 40, silu_mul=True).block_k == 64
    cpu = torch.empty(96, 256, dtype=torch.bfloat16)
    assert gemm_mid.mid_config(cpu, 64) is None


@pytest.mark.skipif(DEV != "cuda", reason="the layer takes the kernel only for CUDA weights")
def test_linear_layer_takes_the_kernel_from_the_table(table) -> None:  # noqa: ANN001
    from radixserve.layers.linear import RowParallelLinear

    torch.manual_seed(0)
    layer = RowParallelLinear(256, 96, bias=False).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.normal_(0, 0.05)
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    calls = []
    real = gemm_mid.mid_mm
    try:
        gemm_mid.mid_mm = lambda *a, **kw: calls.append(1) or real(*a, **kw)  # noqa: E731
        out = layer(x)
    finally:
        gemm_mid.mid_mm = real
    assert calls == [1]
    torch.testing.assert_close(out.float(), x.float() @ layer.weight.float().t(), rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(DEV != "cuda", reason="the layer takes the kernel only for CUDA weights")
def test_gate_up_layer_takes_the_fused_activation_from_the_table(table) -> None:  # noqa: ANN001
    from radixserve.layers.activation import SiluAndMul
    from radixserve.layers.linear import MergedColumnParallelLinear

    torch.manual_seed(0)
    layer = MergedColumnParallelLinear(256, [96, 96], bias=False).to(device="cuda", dtype=torch.bfloat16)
    layer.weight.data.normal_(0, 0.05)
    x = torch.randn(40, 256, device="cuda", dtype=torch.bfloat16)
    fused = layer.silu_and_mul(x)
    assert fused is not None and fused.shape == (40, 96)
    assert layer.silu_and_mul(x[:16]) is None  # below 17 rows: not this kernel (16-row batches keep cuBLAS)
    torch.testing.assert_close(fused.float(), SiluAndMul()(layer(x)).float(), rtol=3e-2, atol=3e-2)


def test_committed_entries_fit_their_shapes() -> None:
    """Every "tn" entry of the committed table divides its K into split_k x block_k runs (else `mid_config` would
    drop it at run time) and uses power-of-two tiles; "cublas" entries carry no tiles."""
    path = os.path.join(os.path.dirname(gemv_configs.__file__), "gemv_configs.json")
    with open(path) as f:
        entries = {k: v for k, v in json.load(f)["configs"].items() if k.startswith("mid16")}
    assert entries
    for name, raw in entries.items():
        _, m, _n, k = (int(p) if p.isdigit() else p for p in name.split("/"))
        cfg = GemvConfig(**raw)
        assert gemm_mid.MIN_M <= m <= gemm_mid.MAX_M, name
        if cfg.kernel == "cublas":
            continue
        assert cfg.kernel == "tn", name
        assert k % (cfg.split_k * cfg.block_k) == 0, name
        for size in (cfg.block_n, cfg.block_m, cfg.block_k):
            assert size >= 16 and size & (size - 1) == 0, name
