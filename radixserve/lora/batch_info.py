"""A batch's adapters, row by row, in the form the LoRA kernels read.

The scheduler gives each request an adapter slot (-1: the base model). Here the batch's tokens are grouped by
slot: `token_order` lists the token rows sorted by slot (stable), and group g covers
`token_order[group_starts[g] : group_starts[g] + group_lens[g]]`, all of slot `group_slots[g]`. Rows of the base
model are in no group. A kernel program works on one group's block of rows, so it reads its adapter's weights
once for many rows. `sorted_slots[p]` is the slot of row `token_order[p]` (-1 for base rows, which sort first): the
stacked expand kernel (triton_ops.py) walks the sorted rows in blocks, each block mostly of one adapter. The five
arrays travel as one int64 tensor `[group_slots (S), group_starts (S), group_lens (S), token_order (T),
sorted_slots (T)]` (S = the number of slots; unused groups have length 0): one host-to-device copy per batch, and
under CUDA graphs one copy into the graph's static buffer (the graph's batch, padding rows as base rows)."""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch


@dataclass
class LoRABatchInfo:
    num_slots: int
    num_groups: int = 0  # groups with rows (the grid; under a CUDA graph min(S, batch size): an upper bound)
    max_group_len: int = 0  # rows of the largest group (the grid's row blocks; the batch size under a graph)
    packed: torch.Tensor | None = None  # the int64 arrays above, on the device
    # host view for the torch path: (slot, rank, scaling, token rows as a slice or an index tensor) per group
    groups_cpu: list[tuple[int, slice | torch.Tensor]] = field(default_factory=list)
    capturing: bool = False  # recording a CUDA graph: launch the kernels whatever the groups
    req_slots: list[int] | None = None  # each request's slot (decode: one row each), to pad a graph's batch
    _views: tuple | None = field(default=None, repr=False)  # (packed, its views)

    @property
    def active(self) -> bool:
        return self.capturing or self.num_groups > 0

    @property
    def num_rows(self) -> int:
        """The rows `packed` covers (the graph's batch under a CUDA graph)."""
        return (self.packed.numel() - 3 * self.num_slots) // 2

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(group_slots, group_starts, group_lens, token_order, sorted_slots) as views of `packed` (made once per
        batch: every LoRA layer asks)."""
        p = self.packed
        if self._views is None or self._views[0] is not p:
            s, t = self.num_slots, self.num_rows
            self._views = (p, (p[:s], p[s:2 * s], p[2 * s:3 * s], p[3 * s:3 * s + t], p[3 * s + t:3 * s + 2 * t]))
        return self._views[1]


def group_rows(req_slots: list[int], token_counts: list[int] | None, num_slots: int
               ) -> tuple[torch.Tensor, list[tuple[int, slice | torch.Tensor]], int]:
    """The packed host tensor, the groups for the torch path, and the largest group's length.

    `req_slots[i]` is request i's slot (-1: none); `token_counts[i]` its tokens in this forward (None: one each)."""
    slots = np.asarray(req_slots, dtype=np.int64)
    if len(slots) and (slots.max() >= num_slots or slots.min() < -1):
        raise ValueError(f"LoRA slot out of range 0..{num_slots - 1}: {req_slots}")
    tok_slot = slots if token_counts is None else np.repeat(slots, np.asarray(token_counts, dtype=np.int64))
    order = np.argsort(tok_slot, kind="stable")
    sorted_slots = tok_slot[order]
    uniq, starts, lens = np.unique(sorted_slots, return_index=True, return_counts=True)
    keep = uniq >= 0
    uniq, starts, lens = uniq[keep], starts[keep], lens[keep]
    head = np.zeros((3, num_slots), dtype=np.int64)
    g = len(uniq)
    head[0, :g], head[1, :g], head[2, :g] = uniq, starts, lens
    packed = torch.from_numpy(np.concatenate([head.reshape(-1), order.astype(np.int64), sorted_slots]))
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot, start, n in zip(uniq.tolist(), starts.tolist(), lens.tolist(), strict=True):
        rows = order[start:start + n]
        if rows[-1] - rows[0] == n - 1:  # consecutive rows (one request, or neighbours): a slice, no gather
            groups.append((slot, slice(int(rows[0]), int(rows[0]) + n)))
        else:
            groups.append((slot, torch.from_numpy(rows.copy())))
    return packed, groups, int(lens.max()) if g else 0
