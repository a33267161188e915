"""Per-tensor scales of an fp8 KV cache, as checkpoints ship them.

The pool stores k / k_scale and v / v_scale (`RadixAttention.k_scale` / `v_scale`, 1.0 by default). Checkpoints name
the scales `model.layers.N.self_attn.k_scale` (and `.attn.k_scale`, or `k_proj.k_scale` / `k_proj.output_scale`);
`kv_scale_name(name)` recognises them so that a model's `load_weights` can route them to its attention layers. They
only take effect with `--kv-cache-dtype fp8_e4m3 / fp8_e5m2`."""

from __future__ import annotations

import re

import torch

_KV_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.(?:attn\.|k_proj\.|v_proj\.)?([kv])_scale$")
_OUTPUT_SCALE_RE = re.compile(r"^model\.layers\.(\d+)\.self_attn\.([kv])_proj\.output_scale$")


def kv_scale_name(name: str) -> tuple[int, str] | None:
    """(layer index, "k" or "v") when `name` is a checkpoint's KV-cache scale, else None."""
    m = _KV_SCALE_RE.match(name) or _OUTPUT_SCALE_RE.match(name)
    return (int(m.group(1)), m.group(2)) if m else None


def set_kv_scale(attn: torch.nn.Module, which: str, value: torch.Tensor) -> None:
    """Set `attn.k_scale` / `attn.v_scale` from a checkpoint tensor (one positive value)."""
    if value.numel() != 1:
        raise ValueError(f"a KV-cache {which}_scale must hold one value, got shape {tuple(value.shape)}")
    scale = float(value.reshape(()).float())
    if not scale > 0 or scale == float("inf"):
        raise ValueError(f"a KV-cache {which}_scale must be positive and finite, got {scale}")
    setattr(attn, f"{which}_scale", scale)
    attn.kv_scales_from_checkpoint = True  # `--calculate-kv-scales` leaves this layer as the checkpoint has it
