"""The base of every batched penalizer: per-row state as [bs, ...] device tensors that follow the batch.

A penalizer keeps a CPU list `required_rows` (one bool per row of the batch) and allocates its device tensors
only while some row needs it. Rows that do not need it carry neutral parameters (a penalty of 0, a factor of
1, ...), so their logits come out bit-for-bit unchanged: a request's result never depends on its neighbours.
"""

from __future__ import annotations

import itertools
from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any, ClassVar

import numpy as np
import torch

if TYPE_CHECKING:
    from radixserve.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator
    from radixserve.sampling.sampling_params import SamplingParams


def host_to_device(values: Any, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of Python values, built on the CPU and copied to `device` without waiting on the device's stream
    (a pageable-memory async copy is staged at once), so a scheduler thread never blocks on a running forward."""
    cpu = torch.tensor(values, dtype=dtype, device="cpu")
    # pinned: an async copy from pageable memory would wait for the device's stream to drain
    return cpu if device.type == "cpu" else cpu.pin_memory().to(device, non_blocking=True)


def flatten_token_lists(token_lists: Sequence[Sequence[int]], vocab_size: int,
                        device: torch.device) -> tuple[torch.Tensor, torch.Tensor]:
    """(row index, token id) pairs of ragged per-row token lists, as int64 device tensors.

    Ids outside [0, vocab_size) are dropped (they cannot index the vocabulary)."""
    lengths = torch.tensor([len(t) for t in token_lists], dtype=torch.int64, device="cpu")
    flat = np.fromiter(itertools.chain.from_iterable(token_lists), dtype=np.int64, count=int(lengths.sum()))
    toks = torch.from_numpy(flat)
    rows = torch.repeat_interleave(torch.arange(len(token_lists), dtype=torch.int64, device="cpu"), lengths)
    valid = (toks >= 0) & (toks < vocab_size)
    if not bool(valid.all()):
        rows, toks = rows[valid], toks[valid]
    pairs = torch.stack([rows, toks])
    if device.type != "cpu":
        pairs = pairs.pin_memory().to(device, non_blocking=True)
    return pairs[0], pairs[1]


class BatchedPenalizer(ABC):
    # Names of the [bs, ...] tensors that make up the state; filter/merge/teardown handle them generically.
    tensor_attrs: ClassVar[tuple[str, ...]] = ()

    def __init__(self, orchestrator: BatchedPenalizerOrchestrator) -> None:
        self.orchestrator = orchestrator
        self.required_rows: list[bool] = []
        self.is_prepared = False
        for name in self.tensor_attrs:
            setattr(self, name, None)

    # ------------------------------------------------------------------ what subclasses define
    @staticmethod
    @abstractmethod
    def is_required_for(params: SamplingParams) -> bool:
        """Whether a request with these parameters needs this penalizer."""

    @abstractmethod
    def _allocate(self, batch_size: int) -> None:
        """Create the state tensors for `batch_size` neutral rows."""

    @abstractmethod
    def _fill(self, reqs: Sequence[Any]) -> None:
        """Write the rows' parameters and the history they already have (reqs: `.sampling_params`,
        `.origin_input_ids`, `.output_ids`, and whatever the penalizer reads)."""

    @abstractmethod
    def _cumulate(self, next_token_ids: torch.Tensor) -> None:
        """Account one new token per row (int64 [bs] on the device)."""

    @abstractmethod
    def _apply(self, logits: torch.Tensor) -> None:
        """Penalise float32 logits [bs, vocab] in place."""

    # ------------------------------------------------------------------ shared machinery
    @property
    def vocab_size(self) -> int:
        return self.orchestrator.vocab_size

    @property
    def device(self) -> torch.device:
        return self.orchestrator.device

    @property
    def batch_size(self) -> int:
        return len(self.required_rows)

    @property
    def is_required(self) -> bool:
        return any(self.required_rows)

    def setup(self, reqs: Sequence[Any]) -> None:
        self.required_rows = [bool(self.is_required_for(r.sampling_params)) for r in reqs]
        if self.is_required:
            self._allocate(len(reqs))
            self._fill(reqs)
            self.is_prepared = True

    def cumulate_output_tokens(self, next_token_ids: torch.Tensor) -> None:
        if self.is_prepared:
            self._cumulate(next_token_ids)

    def apply(self, logits: torch.Tensor) -> None:
        if self.is_prepared:
            self._apply(logits)

    def filter(self, keep: list[int], keep_tensor: torch.Tensor | None) -> None:
        self.required_rows = [self.required_rows[i] for i in keep]
        if not self.is_prepared:
            return
        if not self.is_required:
            self.teardown()
            return
        if keep_tensor is None:
            raise ValueError("filter: keep_tensor is required for a prepared penalizer")
        for name in self.tensor_attrs:
            setattr(self, name, getattr(self, name)[keep_tensor])

    def merge(self, other: BatchedPenalizer) -> None:
        if type(other) is not type(self):
            raise ValueError(f"merge: cannot merge {type(other).__name__} into {type(self).__name__}")
        if self.is_prepared or other.is_prepared:
            if not self.is_prepared:
                self._allocate(self.batch_size)
                self.is_prepared = True
            if not other.is_prepared:
                other._allocate(other.batch_size)
                other.is_prepared = True
            for name in self.tensor_attrs:
                setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)], dim=0))
        self.required_rows = self.required_rows + other.required_rows

    def teardown(self) -> None:
        for name in self.tensor_attrs:
            setattr(self, name, None)
        self.is_prepared = False
