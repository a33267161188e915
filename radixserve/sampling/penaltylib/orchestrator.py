"""BatchedPenalizerOrchestrator: the penalizers of one batch, filtered and merged with it.

Each step: `apply(logits)` before sampling, `cumulate_output_tokens(next_token_ids)` after it. A penalizer that
no row of the batch needs holds no tensors and costs nothing.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.sampling.penaltylib.base import BatchedPenalizer, host_to_device
from radixserve.sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
from radixserve.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
from radixserve.sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
from radixserve.sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer

# Applied in this order. A new penalty is one file plus an entry here.
DEFAULT_PENALIZERS: tuple[type[BatchedPenalizer], ...] = (
    BatchedRepetitionPenalizer,
    BatchedFrequencyPenalizer,
    BatchedPresencePenalizer,
    BatchedMinNewTokensPenalizer,
)


def as_index_list(keep_indices: Sequence[int] | torch.Tensor, batch_size: int) -> list[int]:
    """Keep-indices as a checked CPU list. A tensor costs a device sync: pass a list from the scheduler."""
    if isinstance(keep_indices, torch.Tensor):
        keep = [int(i) for i in keep_indices.view(-1).tolist()]
    else:
        keep = [int(i) for i in keep_indices]
    for i in keep:
        if not 0 <= i < batch_size:
            raise ValueError(f"keep_indices: index {i} out of range for a batch of {batch_size}")
    return keep


class BatchedPenalizerOrchestrator:
    def __init__(self, vocab_size: int, device: torch.device | str, reqs: Sequence[Any],
                 penalizers: Sequence[type[BatchedPenalizer]] = DEFAULT_PENALIZERS) -> None:
        """reqs: objects with `.sampling_params`, `.origin_input_ids`, `.output_ids` and `.eos_token_ids`."""
        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self.batch_size = len(reqs)
        self.penalizers: dict[type[BatchedPenalizer], BatchedPenalizer] = {}
        for cls in penalizers:
            penalizer = cls(self)
            penalizer.setup(reqs)
            self.penalizers[cls] = penalizer

    @property
    def is_required(self) -> bool:
        """True when some penalizer holds state (some row needs a penalty)."""
        return any(p.is_prepared for p in self.penalizers.values())

    def get_penalizer(self, cls: type[BatchedPenalizer]) -> BatchedPenalizer | None:
        return self.penalizers.get(cls)

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        """Account the token each row just produced (a [bs] integer tensor; on the device, no sync)."""
        if not self.is_required:
            return
        ids = next_token_ids.reshape(-1)
        if ids.shape[0] != self.batch_size:
            raise ValueError(f"next_token_ids: expected {self.batch_size} ids, got {ids.shape[0]}")
        ids = ids.to(device=self.device, dtype=torch.int64)
        for p in self.penalizers.values():
            p.cumulate_output_tokens(ids)

    def apply(self, logits: torch.Tensor) -> None:
        """Penalise float32 logits [bs, vocab] in place."""
        if not self.is_required:
            return
        if logits.dim() != 2 or logits.shape[0] != self.batch_size or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits: expected shape ({self.batch_size}, {self.vocab_size}), "
                             f"got {tuple(logits.shape)}")
        for p in self.penalizers.values():
            p.apply(logits)

    def filter(self, keep_indices: Sequence[int] | torch.Tensor) -> None:
        """Keep these rows, in this order."""
        keep = as_index_list(keep_indices, self.batch_size)
        keep_tensor = host_to_device(keep, torch.int64, self.device) if self.is_required else None
        for p in self.penalizers.values():
            p.filter(keep, keep_tensor)
        self.batch_size = len(keep)

    def merge(self, other: BatchedPenalizerOrchestrator) -> None:
        """Append other's rows after ours (other is consumed)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"merge: vocab_size {other.vocab_size} != {self.vocab_size}")
        for cls, p in self.penalizers.items():
            theirs = other.penalizers.get(cls)
            if theirs is None:  # other was built without this penalizer: its rows are neutral
                theirs = cls(other)
                theirs.required_rows = [False] * other.batch_size
            p.merge(theirs)
        for cls, theirs in other.penalizers.items():
            if cls not in self.penalizers:
                mine = cls(self)
                mine.required_rows = [False] * self.batch_size
                mine.merge(theirs)
                self.penalizers[cls] = mine
        self.batch_size += other.batch_size
