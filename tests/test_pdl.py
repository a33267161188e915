"""The programmatic-dependent-launch level a launch gets (`triton_ops/pdl.py`): decode graphs of a few requests at
level 2 while the level is the default, every graph at RADIXSERVE_PDL's level where it is set, and a capture's
level undone after it; the bytes a row the fp8 GEMVs prefetch before their wait, and which launches pass them."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.triton_ops import pdl


@pytest.mark.parametrize("level,from_env,want_small,want_large", [
    (1, False, 2, 1),  # the default: small decode graphs at 2
    (1, True, 1, 1),  # RADIXSERVE_PDL=1: every graph at 1
    (2, True, 2, 2),
    (0, True, 0, 0),
    (0, False, 0, 0),  # switched off in the process (set_level(0)): off everywhere
])
def test_graph_level(monkeypatch: pytest.MonkeyPatch, level: int, from_env: bool, want_small: int,
                     want_large: int) -> None:
    monkeypatch.setattr(pdl, "LEVEL", level)
    monkeypatch.setattr(pdl, "LEVEL_FROM_ENV", from_env)
    assert [pdl.graph_level(bs) for bs in (1, pdl.SMALL_GRAPH_BS)] == [want_small] * 2
    assert pdl.graph_level(pdl.SMALL_GRAPH_BS + 1) == want_large


def test_level_while_restores_the_level(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(pdl, "LEVEL", 1)
    with pdl.level_while(2):
        assert pdl.LEVEL == 2
    assert pdl.LEVEL == 1
    with pytest.raises(RuntimeError), pdl.level_while(0):
        assert pdl.LEVEL == 0
        raise RuntimeError("a failed capture")
    assert pdl.LEVEL == 1
    with pytest.raises(ValueError, match="0, 1 or 2"), pdl.level_while(3):
        pass
    assert pdl.LEVEL == 1


def test_no_pdl_on_the_cpu() -> None:
    with pdl.level_while(2):
        assert pdl.launch_opts(torch.zeros(1)) == {}


@pytest.mark.parametrize("opts,nbytes,row_bytes,want", [
    ({}, 512, 4096, 0),  # no PDL: no prefetch
    ({"PDL": 1}, 0, 4096, 0),  # RADIXSERVE_PDL_PREFETCH=0
    ({"PDL": 2}, 512, 4096, 512),  # the default
    ({"PDL": 1}, 8192, 4096, 4096),  # never past the row
    ({"PDL": 1}, 1536, 14336, 1024),  # 12 lines: down to a power of two (8)
    ({"PDL": 1}, 512, 200, 128),
    ({"PDL": 1}, 512, 64, 0),  # a row shorter than a line
])
def test_prefetch_bytes(monkeypatch: pytest.MonkeyPatch, opts: dict, nbytes: int, row_bytes: int, want: int) -> None:
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", nbytes)
    got = pdl.prefetch_bytes(opts, row_bytes)
    assert got == want
    assert got == 0 or (got % pdl.LINE == 0 and (got // pdl.LINE) & (got // pdl.LINE - 1) == 0 and got <= row_bytes)


@pytest.mark.parametrize("nbytes", [512, 0])
def test_the_fp8_gemvs_pass_the_prefetch_with_pdl(monkeypatch: pytest.MonkeyPatch, nbytes: int) -> None:
    """With PDL options for the launch (as on a Hopper GPU), the fp8 elementwise GEMV (plain and SiLU·mul) and the
    fp8 q/k/v + rotation kernel are launched with PREFETCH = the configured bytes a row; the tensor-core GEMV and
    launches without PDL get none. (The kernels are recorded, not run.)"""
    from radixserve.layers.quantization import fp8_gemv, fp8_gemv_rope
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs

    launched: list[tuple[str, dict]] = []
    for mod in (fp8_gemv, fp8_gemv_rope):
        monkeypatch.setattr(mod, "launch", lambda fn, grid, *a, **kw: launched.append((fn.__name__, kw)))
    monkeypatch.setattr(pdl, "PREFETCH_BYTES", nbytes)
    k = 4096
    x = torch.randn(1, k).bfloat16()
    w = torch.randn(512, k).to(torch.float8_e4m3fn)
    s = torch.ones(512)
    ew = GemvConfig("ew", 4, 1024, 4, 2, "ef+r8")
    for with_pdl in (True, False):
        monkeypatch.setattr(pdl, "_takes_pdl", lambda t, on=with_pdl: on)  # (as on a Hopper GPU, or not)
        monkeypatch.setattr(pdl, "LEVEL", 2)
        fp8_gemv.fp8_skinny_gemv(x, w, s, torch.bfloat16, config=ew)
        fp8_gemv.fp8_skinny_gemv(x, w, torch.ones(512), torch.bfloat16, config=ew, silu_mul=True)
        fp8_gemv.fp8_skinny_gemv(x, w, s, torch.bfloat16, config=GemvConfig("dot", 32, 256))
        fp8_gemv_rope.fp8_qkv_rope(x, w, s, None, RopeArgs(2, 1, 128, torch.zeros(1, dtype=torch.long),
                                                           torch.ones(8, 64), torch.zeros(8, 64), None), ew)
    got = [(name, kw.get("PREFETCH")) for name, kw in launched]
    assert got == [("_fp8_gemv_ew_kernel", nbytes), ("_fp8_gemv_ew_kernel", nbytes), ("_fp8_gemv_dot_kernel", None),
                   ("_fp8_gemv_rope_kernel", nbytes), ("_fp8_gemv_ew_kernel", None), ("_fp8_gemv_ew_kernel", None),
                   ("_fp8_gemv_dot_kernel", None), ("_fp8_gemv_rope_kernel", None)]
