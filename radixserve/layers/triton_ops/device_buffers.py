"""Small per-device tensors that kernels keep between launches: counters a kernel leaves at zero (tickets, counts),
constants. Made once per (name, device) and kept, except when first asked for inside a CUDA graph capture: a tensor
made there is filled only when that graph replays, which is all that graph needs, so it is not kept for eager use."""

from __future__ import annotations

from collections.abc import Callable

import torch

_KEPT: dict[tuple[str, torch.device], torch.Tensor] = {}


def kept_buffer(name: str, device: torch.device, make: Callable[[torch.device], torch.Tensor]) -> torch.Tensor:
    """The tensor kept under `name` on `device`, made by make(device) the first time."""
    t = _KEPT.get((name, device))
    if t is None:
        t = make(device)
        if not (device.type == "cuda" and torch.cuda.is_current_stream_capturing()):
            _KEPT[(name, device)] = t
    return t
