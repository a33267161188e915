"""RecurrentStates: what ModelRunner and the radix cache ask of a hybrid model, whose linear-attention (Gated
DeltaNet) or Mamba2 layers keep a state per request in `StateBuffers` rows (`layers/linear_attention.py`): its
size, its allocation (request slots, the cache's snapshot rows, the padding row) and the buffers the cache's
`StatePool` copies. A model lists those layers in `state_layers()`."""

from __future__ import annotations

from typing import Any

import torch


class RecurrentStates:
    def state_layers(self) -> list[Any]:
        """The layers that keep a state (each has `state_bytes(dtype)`, `allocate_states(...)` and `states`)."""
        raise NotImplementedError

    def state_bytes_per_request(self, dtype: torch.dtype) -> int:
        return sum(layer.state_bytes(dtype) for layer in self.state_layers())

    def allocate_states(self, slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        for layer in self.state_layers():
            layer.allocate_states(slots, dtype, device)

    def state_buffers(self) -> list[Any]:
        """Every state layer's StateBuffers (allocated), for the radix cache's snapshots."""
        return [layer.states for layer in self.state_layers()]
