"""Programmatic dependent launch (Hopper and later) for our Triton kernels: a kernel launched with
`launch_pdl=True` may start while the kernel before it in the stream is finishing, so its launch and the ramp of its
first programs overlap that kernel's tail (in eager launches and in CUDA graphs alike).

A kernel that takes part has a `PDL: tl.constexpr = 0` parameter and begins with `pdl_prologue(PDL)`: at 1 it
waits for the kernel before it to complete (and its writes to be visible) before it does anything else, so no
hazard can arise whatever that kernel did; at 2 it then also lets the kernel after it launch (its programs wait in
their own prologue). Both instructions do nothing when the kernel was not launched that way.

`launch_opts(t)` gives the options for a launch on t's device: {} unless the level (RADIXSERVE_PDL, default 1; 0
turns it off) is 1 or 2 and the device is a CUDA GPU of compute capability 9.0 or later with a Triton that has the
instructions. Level 1 is the default because the 8B batch-1 decode graph replayed back to back (no host in the
way, timed with CUDA events) takes 4.02 ms with it against 4.16 without, and the fp8 one 2.92 against 2.97, the
same in two processes each (docs/PERFORMANCE.md); level 2 gained another 0.01 ms there. The decode graphs of up to
16 requests are captured at level 2 unless RADIXSERVE_PDL is set (`graph_level`, SMALL_GRAPH_BS).

The fp8 one-row GEMVs (`fp8_gemv`, `fp8_gemv_rope`: the fp8 and int8 weights of a batch-1 decode) also ask the
L2 for the first RADIXSERVE_PDL_PREFETCH bytes (default 512; 0 turns it off) of each of their weight rows before
they wait (`prefetch_rows`, `prefetch_bytes`): weights are never written by the kernels before them and a prefetch
is only a hint, so no result can change; at level 2 a program that starts while the kernel before is finishing then
has its first bytes on the way. The fp8 8B batch-1 decode graph took 3.019 ms with it against 3.069 without (H100;
512 bytes a row: 3.017-3.020, 256: 3.022, 128: 3.030-3.033, the whole first K step of 1-2 KB: 3.172-3.176, too much
asked at once). The 16-bit GEMVs gained nothing (8B) or lost (DeepSeek-V2-Lite 2.752 against 2.559 ms a step) and
do not prefetch (docs/perf-log.md, "2026-12-06 (night)")."""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Iterator
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
if LEVEL not in (0, 1, 2):
    raise ValueError(f"RADIXSERVE_PDL must be 0, 1 or 2, got {LEVEL}")
LEVEL_FROM_ENV = "RADIXSERVE_PDL" in os.environ
PREFETCH_BYTES = int(os.environ.get("RADIXSERVE_PDL_PREFETCH", "512"))
if PREFETCH_BYTES < 0:
    raise ValueError(f"RADIXSERVE_PDL_PREFETCH must be >= 0 bytes, got {PREFETCH_BYTES}")
LINE = 128  # bytes an L2 prefetch brings
# Decode graphs of at most this many requests are captured at level 2 while the level is the default 1: level 2
# shortened the 8B batch-1 graph (fp8 weights -2.4%, bf16 -0.3 to -0.5%; H200) and lengthened batch 64's (+0.7 to
# +1.0%) (docs/perf-log.md, "PDL level 1 against 2"); the fp8 graphs of 2 / 4 / 8 / 16 requests replayed back to
# back took 5.219 / 6.765 / 6.906 / 6.902 ms at level 2 against 5.297 / 6.810 / 6.910 / 6.956 at level 1 (H100,
# 2026-12-06). RADIXSERVE_PDL set to any level applies to every graph.
SMALL_GRAPH_BS = 16


def set_level(level: int) -> None:
    """Switch PDL for the launches that follow (0 off, 1, 2: see above); for comparisons in one process."""
    global LEVEL
    if level not in (0, 1, 2):
        raise ValueError(f"PDL level must be 0, 1 or 2, got {level}")
    LEVEL = level


def graph_level(batch_size: int) -> int:
    """The level a decode CUDA graph of `batch_size` requests is captured at (see SMALL_GRAPH_BS)."""
    if LEVEL == 1 and not LEVEL_FROM_ENV and batch_size <= SMALL_GRAPH_BS:
        return 2
    return LEVEL


@contextlib.contextmanager
def level_while(level: int) -> Iterator[None]:
    """The launches inside run at `level` (a graph's capture and the warm-up before it)."""
    global LEVEL
    before = LEVEL
    set_level(level)
    try:
        yield
    finally:
        LEVEL = before


@triton.jit
def pdl_prologue(PDL: tl.constexpr):
    if PDL > 0:
        gdc_wait()
    if PDL > 1:
        gdc_launch_dependents()


@triton.jit
def l2_prefetch(ptrs):
    """Asks the L2 for the 128-byte lines holding `ptrs` (pointers or 64-bit addresses, one a line); a hint, with no
    effect on results. (Also the fused all-reduce's prefetch of the next layer's weight, `push_all_reduce`.)"""
    tl.inline_asm_elementwise("prefetch.global.L2 [$1];\n\tmov.u32 $0, 0;", "=r,l", [ptrs], dtype=tl.int32,
                              is_pure=False, pack=1)


@triton.jit
def prefetch_rows(W, rows, stride_w, ROW_BYTES: tl.constexpr):
    """L2 prefetch of the first ROW_BYTES (a multiple of LINE) of each of `rows` of W, a weight of one-byte elements
    (fp8 / int8; rows in bounds, stride_w apart). Nothing when ROW_BYTES is 0."""
    if ROW_BYTES > 0:
        offs = tl.arange(0, ROW_BYTES // 128) * 128
        l2_prefetch(W + rows[:, None].to(tl.int64) * stride_w + offs[None, :])


def prefetch_bytes(opts: dict[str, Any], row_bytes: int) -> int:
    """ROW_BYTES for `prefetch_rows` in a launch with PDL options `opts`: PREFETCH_BYTES, at most the row's
    `row_bytes`, rounded down to a power-of-two count of lines; 0 without PDL, with the prefetch off, or for rows
    shorter than a line."""
    if not opts or not PREFETCH_BYTES:
        return 0
    lines = min(PREFETCH_BYTES, row_bytes) // LINE
    return 0 if lines < 1 else LINE * (1 << (lines.bit_length() - 1))


@functools.lru_cache(maxsize=16)
def _capable(device_index: int) -> bool:
    return AVAILABLE and torch.cuda.get_device_capability(device_index)[0] >= 9


def _takes_pdl(t: torch.Tensor) -> bool:
    """Whether a launch on t's device can use PDL: a CUDA GPU of compute capability 9.0 or later with a Triton that
    has the instructions."""
    return t.is_cuda and _capable(t.device.index if t.device.index is not None else 0)


def launch_opts(t: torch.Tensor, level: int | None = None, prefetch_row_bytes: int | None = None
                ) -> dict[str, Any]:
    """{"PDL": level, "launch_pdl": True} for a kernel with a PDL constexpr launched on t's device, or {} (PDL off,
    not CUDA, an older GPU or Triton). `level` overrides RADIXSERVE_PDL. `prefetch_row_bytes`: the kernel also has
    a PREFETCH constexpr (`prefetch_rows` of a weight with rows of that many bytes), given `prefetch_bytes`."""
    level = LEVEL if level is None else level
    if not level or not _takes_pdl(t):
        return {}
    opts: dict[str, Any] = {"PDL": level, "launch_pdl": True}
    if prefetch_row_bytes is not None:
        opts["PREFETCH"] = prefetch_bytes(opts, prefetch_row_bytes)
    return opts


__all__ = ["AVAILABLE", "LEVEL", "PREFETCH_BYTES", "gdc_launch_dependents", "gdc_wait", "graph_level", "l2_prefetch",
           "launch_opts", "level_while", "pdl_prologue", "prefetch_bytes", "prefetch_rows", "set_level"]
