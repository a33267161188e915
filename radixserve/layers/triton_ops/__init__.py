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
    return x.is_cuda if _mode is None else _mode
