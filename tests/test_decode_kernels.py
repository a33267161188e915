"""The batch-1 decode kernels: the one-row Triton GEMV (plain and with SiLU·mul in its epilogue) and the two-kernel
row argmax, against torch. On the CPU they run under TRITON_INTERPRET=1 (set in conftest); on CUDA, natively. Also
that the linear layers pick the GEMV only where the table has the shape."""

from __future__ import annotations

import json

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.triton_ops.argmax import row_argmax
from radixserve.layers.triton_ops.gemv import gemv_row

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("n,k,bn,bk,bias", [(24, 128, 2, 64, False), (7, 96, 4, 32, True), (16, 256, 8, 128, True),
                                          (10, 80, 2, 64, False)])  # the last: K not a multiple of the tile
def test_gemv_row_matches_linear(n: int, k: int, bn: int, bk: int, bias: bool) -> None:
    g = torch.Generator().manual_seed(n * k)
    x = torch.randn(1, k, generator=g)
    w = torch.randn(n, k, generator=g) * 0.1
    b = torch.randn(n, generator=g) if bias else None
    out = gemv_row(x.to(DEV), w.to(DEV), None if b is None else b.to(DEV), GemvConfig("ew", bn, bk)).cpu()
    torch.testing.assert_close(out, F.linear(x, w, b), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gemv_row_silu_mul_matches_unfused(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    d, k = 12, 64
    x = torch.randn(1, k, generator=g).to(dtype)
    w = (torch.randn(2 * d, k, generator=g) * 0.2).to(dtype)
    out = gemv_row(x.to(DEV), w.to(DEV), None, GemvConfig("ew", 4, 32), silu_mul=True).cpu()
    gate_up = F.linear(x.float(), w.float()).to(dtype)
    ref = (F.silu(gate_up[:, :d].float()).to(dtype).float() * gate_up[:, d:].float()).to(dtype)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    assert out.shape == (1, d)
    torch.testing.assert_close(out.float(), ref.float(), rtol=tol, atol=tol)


def test_gemv_row_rejects_bad_shapes() -> None:
    with pytest.raises(ValueError, match="x \\[1, K\\]"):
        gemv_row(torch.zeros(2, 16), torch.zeros(4, 16))
    with pytest.raises(ValueError, match="even rows"):
        gemv_row(torch.zeros(1, 16), torch.zeros(5, 16), silu_mul=True)


@pytest.mark.parametrize("b,v,block", [(1, 1000, 256), (3, 4096, 512), (2, 77, 4096)])
def test_row_argmax_matches_torch(b: int, v: int, block: int) -> None:
    g = torch.Generator().manual_seed(v)
    x = torch.randn(b, v, generator=g)
    x[0, v // 3] = 50.0
    x[0, v - 1] = 50.0  # a tie: the lowest column wins, as in torch
    if b > 1:
        x[1] = float("-inf")  # a row of -inf: column 0, as in torch
    out = row_argmax(x.to(DEV), block=block).cpu()
    assert out.dtype == torch.int64
    assert torch.equal(out, torch.argmax(x, dim=-1))
    assert torch.equal(row_argmax(x.to(torch.bfloat16).to(DEV), block=block).cpu(),
                       torch.argmax(x.to(torch.bfloat16), dim=-1))


def test_linear_uses_gemv_only_where_the_table_has_the_shape(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    from radixserve.layers.linear import MergedColumnParallelLinear, ReplicatedLinear
    from radixserve.layers.triton_ops import gemv

    table = tmp_path / "picks.json"
    table.write_text(json.dumps({"configs": {gemv_configs.key("row16", 1, 8, 32): GemvConfig("ew", 2, 16).to_dict(),
                                             gemv_configs.key("row16_silu", 1, 16, 32):
                                                 GemvConfig("ew", 2, 16).to_dict()}}))
    monkeypatch.setenv("RADIXSERVE_GEMV_CONFIGS", str(table))
    gemv_configs.reload()
    try:
        picked = ReplicatedLinear(32, 8)
        picked.weight.data = torch.randn(8, 32, dtype=torch.bfloat16)
        other = ReplicatedLinear(32, 12)
        other.weight.data = torch.randn(12, 32, dtype=torch.bfloat16)
        mlp = MergedColumnParallelLinear(32, [8, 8])
        mlp.weight.data = torch.randn(16, 32, dtype=torch.bfloat16)
        w = picked.weight
        assert gemv.gemv_config(w.cuda() if DEV == "cuda" else w) == (GemvConfig("ew", 2, 16) if DEV == "cuda"
                                                                      else None)  # CUDA weights only
        if DEV == "cuda":
            for layer in (picked, other, mlp):
                layer.cuda()
            x = torch.randn(1, 32, dtype=torch.bfloat16, device="cuda")
            torch.testing.assert_close(picked(x).float(), F.linear(x, picked.weight).float(), rtol=2e-2, atol=2e-2)
            assert picked._gemv_cfg[False] is not None and other(x) is not None
            assert other._gemv_cfg[False] is None
            assert mlp.silu_and_mul(x) is not None and mlp.silu_and_mul(torch.cat([x, x])) is None
    finally:
        monkeypatch.delenv("RADIXSERVE_GEMV_CONFIGS")
        gemv_configs.reload()
