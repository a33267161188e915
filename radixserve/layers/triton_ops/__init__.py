"""Fused elementwise Triton kernels for the layers (RMSNorm, rotary, SiLU·mul, KV store).

The layers call them only for CUDA tensors (`use_fused(x)`); on the CPU they keep their plain torch code, which is
also the reference the kernels are tested against (under TRITON_INTERPRET=1 on the CPU, and on the GPU). Triton is
imported lazily, so a CPU install never needs it on the hot path. RADIXSERVE_DISABLE_FUSED_KERNELS=1 turns them off
(for comparisons); tests force them on for CPU tensors with `set_fused_kernels(True)`."""

from __future__ import annotations

import os

import torch

_mode: bool | None = False if os.environ.get("RADIXSERVE_DISABLE_FUSED_KERNELS", "") not in ("", "0") else None


def set_fused_kernels(enabled: bool | None) -> None:
    """None: on for CUDA tensors (the default); True: on for every tensor (CPU tests under TRITON_INTERPRET=1);
    False: off."""
    global _mode
    _mode = enabled


def use_fused(x: torch.Tensor) -> bool:
    """Whether the layers should run their fused Triton kernel for this tensor (never inside torch.compile, which
    generates and fuses the same elementwise work from the layers' torch code)."""
    if torch.compiler.is_compiling():
        return False
    cuda = x.is_cuda  # read whatever the mode, so a caller passing no tensor fails on the CPU too
    return cuda if _mode is None else _mode


_decode_gemv = os.environ.get("RADIXSERVE_DISABLE_DECODE_GEMV", "") in ("", "0")


def set_decode_gemv(enabled: bool) -> None:
    """Turn the one-row GEMV (`gemv.py`) on or off for the layers that opt in (comparisons)."""
    global _decode_gemv
    _decode_gemv = enabled


def decode_gemv_enabled(x: torch.Tensor) -> bool:
    """Whether layers that opt in should multiply a one-row `x` with the one-row GEMV (`gemv.py`;
    RADIXSERVE_DISABLE_DECODE_GEMV=1 or `set_decode_gemv(False)`: cuBLAS instead)."""
    return _decode_gemv and use_fused(x)
