"""A batch's adapters, row by row, in the form the LoRA kernels read.

The scheduler gives each request an adapter slot (-1: the base model). Here the batch's tokens are grouped by
slot: `token_order` lists the token rows sorted by slot (stable), and group g covers
`token_order[group_starts[g] : group_starts[g] + group_lens[g]]`, all of slot `group_slots[g]`. Rows of the base
model are in no group. A kernel program works on one group's block of rows, so it reads its adapter's weights
once for many rows. `sorted_slots[p]` is the slot of row `token_order[p]` (-1 for base rows, which sort first): the
stacked expand kernel (triton_ops.py) walks the sorted rows in blocks, each block mostly of one adapter. The five
arrays travel as one int64 tensor `[group_slots (S), group_starts (S), group_lens (S), pad, token_order (T), pad,
sorted_slots (T)]` (S = the number of slots; unused groups have length 0): one host-to-device copy per batch, and
under CUDA graphs one copy into the graph's static buffer (the graph's batch, padding rows as base rows). The pads
(one zero where the part before has an odd length) start `token_order` and `sorted_slots` on 16 bytes whatever S
and T: Triton compiles a kernel per alignment of each pointer, so without them an odd row count would be a kernel
of its own, compiled the first time a batch had one (a second of stall in the middle of serving)."""

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
    # the torch path's groups on the host (`pack_rows`), made into `groups_cpu` only when asked for
    host_groups: HostGroups | None = None
    capturing: bool = False  # recording a CUDA graph: launch the kernels whatever the groups
    req_slots: list[int] | None = None  # each request's slot (decode: one row each), to pad a graph's batch
    _views: tuple | None = field(default=None, repr=False)  # (packed, its views)
    _groups: tuple | None = field(default=None, repr=False)  # (host_groups, their groups_of)

    @property
    def groups_cpu(self) -> list[tuple[int, slice | torch.Tensor]]:
        """(slot, token rows as a slice or an index tensor) per group, for the torch path."""
        host = self.host_groups
        if host is None:
            return []
        if self._groups is None or self._groups[0] is not host:
            self._groups = (host, groups_of(*host))
        return self._groups[1]

    @property
    def active(self) -> bool:
        return self.capturing or self.num_groups > 0

    @property
    def num_rows(self) -> int:
        """The rows `packed` covers (the graph's batch under a CUDA graph)."""
        return rows_of(self.num_slots, self.packed.numel())

    def views(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
        """(group_slots, group_starts, group_lens, token_order, sorted_slots) as views of `packed` (made once per
        batch: every LoRA layer asks)."""
        p = self.packed
        if self._views is None or self._views[0] is not p:
            s, t = self.num_slots, self.num_rows
            o, so, _ = layout(s, t)
            self._views = (p, (p[:s], p[s:2 * s], p[2 * s:3 * s], p[o:o + t], p[so:so + t]))
        return self._views[1]


def layout(num_slots: int, num_rows: int) -> tuple[int, int, int]:
    """(offset of token_order, offset of sorted_slots, length) of the packed tensor: both offsets even (16 bytes)."""
    head = 3 * num_slots + (3 * num_slots) % 2
    sorted_at = head + num_rows + num_rows % 2
    return head, sorted_at, sorted_at + num_rows


def rows_of(num_slots: int, numel: int) -> int:
    """The row count of a packed tensor of `numel` values (the inverse of `layout`'s length)."""
    rest = numel - layout(num_slots, 0)[0]  # 2T (T even) or 2T + 1 (T odd)
    return rest // 2


HostGroups = tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]  # order, slots, starts, lengths of the groups


def pack_rows(req_slots: list[int], token_counts: list[int] | None, num_slots: int
              ) -> tuple[torch.Tensor, HostGroups, int]:
    """The packed host tensor, the groups on the host (for `groups_of`), and the largest group's length.

    `req_slots[i]` is request i's slot (-1: none); `token_counts[i]` its tokens in this forward (None: one each)."""
    slots = np.asarray(req_slots, dtype=np.int64)
    if len(slots) and (slots.max() >= num_slots or slots.min() < -1):
        raise ValueError(f"LoRA slot out of range 0..{num_slots - 1}: {req_slots}")
    tok_slot = slots if token_counts is None else np.repeat(slots, np.asarray(token_counts, dtype=np.int64))
    t = len(tok_slot)
    order = np.argsort(tok_slot, kind="stable")
    counts = np.bincount(tok_slot + 1, minlength=num_slots + 1)  # [base rows, slot 0, slot 1, ...]
    present = np.flatnonzero(counts[1:])  # the slots with rows, ascending
    starts = np.cumsum(counts)[present]  # rows before slot s: the base rows and slots < s
    lens = counts[present + 1]
    g = len(present)
    order_at, sorted_at, size = layout(num_slots, t)
    packed = np.zeros(size, dtype=np.int64)
    packed[:g], packed[num_slots:num_slots + g], packed[2 * num_slots:2 * num_slots + g] = present, starts, lens
    packed[order_at:order_at + t] = order
    packed[sorted_at:] = tok_slot[order]
    return torch.from_numpy(packed), (order, present, starts, lens), int(lens.max()) if g else 0


def groups_of(order: np.ndarray, slots: np.ndarray, starts: np.ndarray, lens: np.ndarray
              ) -> list[tuple[int, slice | torch.Tensor]]:
    """The torch path's groups: (slot, its token rows as a slice when consecutive, else an index tensor)."""
    groups: list[tuple[int, slice | torch.Tensor]] = []
    for slot, start, n in zip(slots.tolist(), starts.tolist(), lens.tolist(), strict=True):
        rows = order[start:start + n]
        if rows[-1] - rows[0] == n - 1:  # consecutive rows (one request, or neighbours): a slice, no gather
            groups.append((slot, slice(int(rows[0]), int(rows[0]) + n)))
        else:
            groups.append((slot, torch.from_numpy(rows.copy())))
    return groups


def group_rows(req_slots: list[int], token_counts: list[int] | None, num_slots: int
               ) -> tuple[torch.Tensor, list[tuple[int, slice | torch.Tensor]], int]:
    """`pack_rows` with the torch path's groups made at once."""
    packed, host, max_len = pack_rows(req_slots, token_counts, num_slots)
    return packed, groups_of(*host), max_len
