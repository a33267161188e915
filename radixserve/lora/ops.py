"""The LoRA delta of one base linear layer for a batch that mixes adapters: the torch reference (the CPU path, and
what the Triton kernels are tested against) and the dispatch to the Triton kernels (CUDA, or forced in tests)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers.triton_ops import use_fused

if TYPE_CHECKING:
    from radixserve.lora.batch_info import LoRABatchInfo
    from radixserve.lora.pool import LoRAMemoryPool


def lora_delta_torch(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                     out_slices: list[tuple[int, int]], groups: list[tuple[int, slice | torch.Tensor]],
                     ranks: list[int], scalings: list[float], sub_mask: list[list[bool]] | None = None) -> None:
    """out[rows, sub j] += lora_B(lora_A(x[rows])) * scaling, per group of rows sharing an adapter slot, in PEFT's
    order of operations and at each adapter's own rank (the pool pads A/B to the largest rank with zeros).

    a [S, n_sub*R, K], b [S, out, R]; `sub_mask[slot][j]`: whether that adapter targets sub-projection j."""
    R = a.shape[1] // len(out_slices)
    for slot, rows in groups:
        r = ranks[slot]
        if r == 0:
            continue
        xg = x[rows]
        for j, (off, n) in enumerate(out_slices):
            if sub_mask is not None and not sub_mask[slot][j]:
                continue
            delta = F.linear(F.linear(xg, a[slot, j * R:j * R + r]), b[slot, off:off + n, :r]) * scalings[slot]
            if isinstance(rows, slice):
                out[rows, off:off + n] += delta
            else:
                out[rows, off:off + n] = out[rows, off:off + n] + delta


def apply_lora(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
               out_slices: list[tuple[int, int]], info: LoRABatchInfo, pool: LoRAMemoryPool,
               group: str) -> torch.Tensor:
    """Add the batch's LoRA deltas to `out` (the base layer's output) in place and return it."""
    if not info.active:
        return out
    if use_fused(x):
        from radixserve.lora.triton_ops import lora_shrink_expand

        lora_shrink_expand(x, out, a, b, pool.scalings, out_slices, info.views(), info.num_groups,
                           info.max_group_len)
        return out
    if info.capturing:
        raise RuntimeError("LoRA under a CUDA graph needs the Triton kernels (RADIXSERVE_DISABLE_FUSED_KERNELS "
                           "is set); use --disable-cuda-graph")
    lora_delta_torch(x, out, a, b, out_slices, info.groups_cpu, pool.ranks, pool.scalings_cpu,
                     pool.sub_masks[group])
    return out
