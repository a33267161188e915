"""Programmatic dependent launch (Hopper and later) for our Triton kernels: a kernel launched with
`launch_pdl=True` may start while the kernel before it in the stream is finishing, so its launch and the ramp of its
first programs overlap that kernel's tail (in eager launches and in CUDA graphs alike).

A kernel that takes part has a `PDL: tl.constexpr = 0` parameter and begins with `pdl_prologue(PDL)`: at 1 it
waits for the kernel before it to complete (and its writes to be visible) before it does anything else, so no
hazard can arise whatever that kernel did; at 2 it then also lets the kernel after it launch (its programs wait in
their own prologue). Both instructions do nothing when the kernel was not launched that way.

A bandwidth-bound product (the decode GEMVs) also takes `PREFETCH: tl.constexpr = False` and begins with
`weight_prologue`: its weight does not depend on the kernel before, so before waiting each program asks the L2 for
the weight rows it is about to read (`prefetch.global.L2`, no data returned). At level 2 the programs that start
during the previous kernel's tail then overlap their first weight reads with it instead of starting them after it.
`launch_opts(t, weight=True)` sets PREFETCH where PDL is on and RADIXSERVE_PDL_PREFETCH is not 0.

`launch_opts(t)` gives the options for a launch on t's device: {} unless the level (RADIXSERVE_PDL, default 1; 0
turns it off) is 1 or 2 and the device is a CUDA GPU of compute capability 9.0 or later with a Triton that has the
instructions. Level 1 is the default because the 8B batch-1 decode graph replayed back to back (no host in the
way, timed with CUDA events) takes 4.02 ms with it against 4.16 without, and the fp8 one 2.92 against 2.97, the
same in two processes each (docs/PERFORMANCE.md); level 2 gained another 0.01 ms there."""

from __future__ import annotations

import functools
import os
from typing import Any

import torch
import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # an older Triton: stand-ins, and launch_opts never asks for PDL
    AVAILABLE = False

    @triton.jit
    def gdc_wait() -> None:
        tl.static_assert(True)

    @triton.jit
    def gdc_launch_dependents() -> None:
        tl.static_assert(True)


LEVEL = int(os.environ.get("RADIXSERVE_PDL", "1"))
PREFETCH = os.environ.get("RADIXSERVE_PDL_PREFETCH", "1") not in ("0", "")
if LEVEL not in (0, 1, 2):
    raise ValueError(f"RADIXSERVE_PDL must be 0, 1 or 2, got {LEVEL}")


def set_level(level: int) -> None:
    """Switch PDL for the launches that follow (0 off, 1, 2: see above); for comparisons in one process."""
    global LEVEL
    if level not in (0, 1, 2):
        raise ValueError(f"PDL level must be 0, 1 or 2, got {level}")
    LEVEL = level


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL > 0:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()


@triton.jit
def prefetch_l2(ptrs):
    """Ask the L2 for the lines holding `ptrs` (a tensor of addresses); nothing is loaded into registers."""
    return tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n mov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def weight_prologue(PDL: tl.constexpr, PREFETCH: tl.constexpr, W, rows, stride_wn, K, LINES: tl.constexpr):
    """`pdl_prologue`, and with PREFETCH, first ask the L2 for rows `rows` of the weight W (row stride `stride_wn`
    elements, K elements a row) in steps of LINES 128-byte lines a row (a power of two). `rows` must be rows of
    the weight (clamp a masked tail's)."""
    if PREFETCH:
        per_line: tl.constexpr = 1024 // W.dtype.element_ty.primitive_bitwidth  # elements in 128 bytes
        step: tl.constexpr = LINES * per_line
        lines = tl.arange(0, LINES) * per_line
        base = W + rows[:, None].to(tl.int64) * stride_wn
        for k0 in range(0, K, step):
            prefetch_l2(base + tl.minimum(k0 + lines, K - 1)[None, :])
    pdl_prologue(PDL)


@functools.lru_cache(maxsize=16)
def _capable(device_index: int) -> bool:
    return AVAILABLE and torch.cuda.get_device_capability(device_index)[0] >= 9


def launch_opts(t: torch.Tensor, level: int | None = None, weight: bool = False) -> dict[str, Any]:
    """{"PDL": level, "launch_pdl": True} for a kernel with a PDL constexpr launched on t's device, or {} (PDL off,
    not CUDA, an older GPU or Triton). `level` overrides RADIXSERVE_PDL. `weight`: the kernel starts with
    `weight_prologue`, whose PREFETCH is set (RADIXSERVE_PDL_PREFETCH, default on)."""
    level = LEVEL if level is None else level
    if not level or not t.is_cuda or not _capable(t.device.index if t.device.index is not None else 0):
        return {}
    if weight and PREFETCH:
        return {"PDL": level, "launch_pdl": True, "PREFETCH": True}
    return {"PDL": level, "launch_pdl": True}


__all__ = ["AVAILABLE", "LEVEL", "PREFETCH", "gdc_launch_dependents", "gdc_wait", "launch_opts", "pdl_prologue",
           "prefetch_l2", "set_level", "weight_prologue"]
