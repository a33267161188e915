"""StatePool: the snapshot rows of a hybrid model's recurrent states, for the radix cache.

A hybrid model (Qwen3-Next, Qwen3.5, Granite 4.0) keeps, per linear-attention or Mamba2 layer, one state row per
request slot and one padding row (`layers/linear_attention.py` StateBuffers). With prefix caching the same buffers
hold `size` more rows after the request slots: each keeps the state of every layer at the end of one cached prefix
(a radix node). A row is free here, held by a node of the tree, or reserved by a request whose forward fills it at
a checkpoint.
Copies run on the current stream, in order with the forwards (the overlap scheduler is off for these models).
"""

from __future__ import annotations

from typing import Any


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
        """Every layer's state (conv window and delta-rule matrix) of row `src` into row `dst`."""
        for b in self.buffers:
            b.conv[dst].copy_(b.conv[src])
            b.ssm[dst].copy_(b.ssm[src])
