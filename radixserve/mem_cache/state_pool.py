"""StatePool: the snapshot rows of a hybrid model's recurrent states, for the radix cache.

A hybrid model (Qwen3-Next, Qwen3.5, Granite 4.0) keeps, per linear-attention or Mamba2 layer, one state row per
request slot and one padding row (`layers/linear_attention.py` StateBuffers). With prefix caching the same buffers
hold `size` more rows after the request slots: each keeps the state of every layer at the end of one cached prefix
(a radix node). A row is free here, held by a node of the tree, or reserved by a request whose forward fills it at
a checkpoint.

The scheduler never touches the buffers itself: `copy` queues a copy, and the next batch carries the queue
(`ModelWorkerBatch.state_copies`) for the worker to apply before its forward (`apply_state_copies`). So a copy runs
after every forward launched before it was asked for and before every later one, whichever thread launches them:
with the overlap scheduler a request's state row may still be advancing on the device while the scheduler
processes an earlier result.
"""

from __future__ import annotations

from typing import Any

import torch


class StatePool:
    def __init__(self, buffers: list[Any], first_row: int, size: int) -> None:
        if size < 0:
            raise ValueError(f"state snapshots: size must be >= 0, got {size}")
        for b in buffers:
            if b.conv.shape[0] < first_row + size or b.ssm.shape[0] < first_row + size:
                raise ValueError(f"state snapshots: rows {first_row}..{first_row + size} do not fit the state "
                                 f"buffers ({b.ssm.shape[0]} rows)")
        self.buffers = buffers
        self.first_row = first_row
        self.size = size
        self.clear()

    def clear(self) -> None:
        self._free = list(range(self.first_row + self.size - 1, self.first_row - 1, -1))  # pop() gives the lowest
        self._pending: list[tuple[int, int]] = []

    def available_size(self) -> int:
        return len(self._free)

    def free_rows(self) -> list[int]:
        return list(self._free)

    def alloc(self) -> int | None:
        """A free snapshot row, or None when every row is taken."""
        return self._free.pop() if self._free else None

    def free(self, row: int) -> None:
        if not self.first_row <= row < self.first_row + self.size:
            raise ValueError(f"state snapshots: row {row} is not a snapshot row")
        if row in self._free:
            raise ValueError(f"state snapshots: row {row} freed twice")
        self._free.append(row)

    def copy(self, src: int, dst: int) -> None:
        """Queue the copy of every layer's state (conv window and recurrent matrix) of row `src` into row `dst`,
        for the next batch to carry (`take_pending`)."""
        self._pending.append((src, dst))

    def take_pending(self) -> list[tuple[int, int]]:
        """The copies queued since the last call, in order (they leave the queue)."""
        pending, self._pending = self._pending, []
        return pending

    def apply(self, copies: list[tuple[int, int]]) -> None:
        """Run copies a batch carried (the worker, before its forward): `apply_state_copies` on these buffers."""
        apply_state_copies(self.buffers, copies)


def apply_state_copies(buffers: list[Any], copies: list[tuple[int, int]]) -> None:
    """Run queued (src row, dst row) copies on every layer's state buffers, with the effect of running them one by
    one in order: consecutive copies none of which reads or writes a row another one writes go in one indexed copy
    a buffer."""
    start = 0
    while start < len(copies):
        reads: set[int] = set()
        writes: set[int] = set()
        end = start
        while end < len(copies):
            src, dst = copies[end]
            if src in writes or dst in writes or dst in reads:
                break
            reads.add(src)
            writes.add(dst)
            end += 1
        if end - start == 1:
            src, dst = copies[start]
            for b in buffers:
                b.conv[dst].copy_(b.conv[src])
                b.ssm[dst].copy_(b.ssm[src])
        elif buffers:
            rows = torch.tensor(copies[start:end], device=buffers[0].ssm.device)  # [n, 2]: src, dst
            for b in buffers:
                for buf in (b.conv, b.ssm):
                    buf.index_copy_(0, rows[:, 1], buf.index_select(0, rows[:, 0]))
        start = end
