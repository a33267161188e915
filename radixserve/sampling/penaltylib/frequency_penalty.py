"""Frequency penalty (OpenAI): logit[t] -= frequency_penalty * (times t appeared in the output so far).

Only generated tokens count, not the prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.sampling.penaltylib.base import BatchedPenalizer, flatten_token_lists, host_to_device
from radixserve.sampling.sampling_params import SamplingParams


class BatchedFrequencyPenalizer(BatchedPenalizer):
    tensor_attrs = ("penalties", "counts")
    penalties: torch.Tensor  # [bs, 1] float32, 0 = neutral
    counts: torch.Tensor  # [bs, vocab] float32, occurrences in the output

    @staticmethod
    def is_required_for(params: SamplingParams) -> bool:
        return params.frequency_penalty != 0

    def _allocate(self, batch_size: int) -> None:
        self.penalties = torch.zeros((batch_size, 1), dtype=torch.float32, device=self.device)
        self.counts = torch.zeros((batch_size, self.vocab_size), dtype=torch.float32, device=self.device)

    def _fill(self, reqs: Sequence[Any]) -> None:
        values = [float(r.sampling_params.frequency_penalty) for r in reqs]
        self.penalties = host_to_device(values, torch.float32, self.device).view(-1, 1)
        history = [r.output_ids if self.is_required_for(r.sampling_params) else [] for r in reqs]
        rows, toks = flatten_token_lists(history, self.vocab_size, self.device)
        self.counts.index_put_((rows, toks), torch.ones_like(rows, dtype=torch.float32), accumulate=True)

    def _cumulate(self, next_token_ids: torch.Tensor) -> None:
        ids = next_token_ids.view(-1, 1)
        self.counts.scatter_add_(1, ids, torch.ones(ids.shape, dtype=torch.float32, device=self.device))

    def _apply(self, logits: torch.Tensor) -> None:
        logits.addcmul_(self.counts, self.penalties, value=-1.0)
