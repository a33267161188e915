"""Programmatic dependent launch (Hopper and later) for our Triton kernels: a kernel launched with
`launch_pdl=True` may start while the kernel before it in the stream is finishing, so its launch and the ramp of its
first programs overlap that kernel's tail. Such a kernel must call `gdc_wait()` before it reads anything the kernel
before it wrote (and before it writes anything that kernel reads); `gdc_launch_dependents()` lets the kernel after
it launch early. Both are no-ops when the kernel was not launched that way. This Triton's own ops where it has them;
otherwise stand-ins that do nothing (no kernel here is then launched with `launch_pdl`)."""

from __future__ import annotations

import triton
import triton.language as tl

try:
    from triton.language.extra.cuda import gdc_launch_dependents, gdc_wait

    AVAILABLE = True
except ImportError:  # an older Triton
    AVAILABLE = False

    @triton.jit
    def gdc_wait() -> None:
        tl.static_assert(True)

    @triton.jit
    def gdc_launch_dependents() -> None:
        tl.static_assert(True)


__all__ = ["AVAILABLE", "gdc_launch_dependents", "gdc_wait"]
