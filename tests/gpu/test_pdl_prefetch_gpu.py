"""On CUDA: the fp8 one-row GEMVs, which ask the L2 for the start of their weight rows before their PDL wait
(`triton_ops/pdl.prefetch_rows`), give bit-for-bit what they give without it: the elementwise kernel (plain,
SiLU·mul, two rows, the int8 head's weight) and the q/k/v product with the rotation and KV store, each launched at
PDL level 2 after a long matmul with 0, 512 and 4,096 bytes a row (the prefetch compiled in and run; the
decode graphs' overlap itself is measured by the benchmarks, not here). Skipped without a GPU or without PDL
(compute capability < 9.0)."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch

from radixserve.layers.triton_ops import pdl

pytestmark = pytest.mark.skipif(not torch.cuda.is_available() or not pdl._capable(0), reason="needs CUDA with PDL")


def _with_and_without(monkeypatch: pytest.MonkeyPatch, fn: Callable[[], object]) -> None:
    outs = []
    monkeypatch.setattr(pdl, "LEVEL", 2)
    for nbytes in (0, 512, 4096):
        monkeypatch.setattr(pdl, "PREFETCH_BYTES", nbytes)
        busy = torch.empty(4096, 4096, device="cuda")
        torch.mm(busy, busy)  # a kernel to overlap
        got = fn()
        torch.cuda.synchronize()
        outs.append(got if isinstance(got, tuple) else (got,))
    for other in outs[1:]:
        for a, b in zip(outs[0], other, strict=True):
            assert torch.equal(a, b)


def _fp8(n: int, k: int, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    w = (torch.randn(n, k, device="cuda", generator=g) / 4).to(torch.float8_e4m3fn)
    return w, torch.rand(n, device="cuda", generator=g) + 0.5


@pytest.mark.parametrize("m,silu,int8", [(1, False, False), (1, True, False), (2, False, False), (1, False, True)])
def test_fp8_gemv(monkeypatch: pytest.MonkeyPatch, m: int, silu: bool, int8: bool) -> None:
    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator(device="cuda").manual_seed(0)
    n, k = (28672, 4096) if silu else (4096 + 64, 14336)  # (rows past the last full tile: the clamp)
    w, s = _fp8(n, k, g)
    if int8:
        w = torch.randint(-127, 128, (n, k), device="cuda", dtype=torch.int8, generator=g)
    x = torch.randn(m, k, device="cuda", generator=g).bfloat16()
    cfg = GemvConfig("ew", 8, 2048, 4, 2, "ef+r8")
    _with_and_without(monkeypatch, lambda: fp8_skinny_gemv(x, w, s, torch.bfloat16, config=cfg, silu_mul=silu))


def test_qkv_rope(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.layers.quantization.fp8_gemv_rope import fp8_qkv_rope
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
    from radixserve.layers.triton_ops import gemv_rope

    hq, hk, d, k = 32, 8, 128, 4096
    n = (hq + 2 * hk) * d
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    ang = torch.rand(4096, d // 2, device="cuda", generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    pos, loc = torch.tensor([1234], device="cuda"), torch.tensor([7], device="cuda")

    def run() -> tuple[torch.Tensor, ...]:
        kb, vb = (torch.zeros(16, hk, d, dtype=torch.bfloat16, device="cuda") for _ in range(2))
        kv = gemv_rope.KVDest(kb, vb, loc, 1.0, 1.0)
        out = fp8_qkv_rope(x, w, s, None, RopeArgs(hq, hk, d, pos, cos, sin, kv),
                           GemvConfig("ew", 4, 1024, 4, 2, "ef+r8"))
        return out, kb, vb

    w, s = _fp8(n, k, g)
    _with_and_without(monkeypatch, run)
