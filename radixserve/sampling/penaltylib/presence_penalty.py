"""Presence penalty (OpenAI): logit[t] -= presence_penalty once t has appeared in the output.

Only generated tokens count, not the prompt."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.sampling.penaltylib.base import BatchedPenalizer, flatten_token_lists, host_to_device
from radixserve.sampling.sampling_params import SamplingParams


class BatchedPresencePenalizer(BatchedPenalizer):
    tensor_attrs = ("penalties", "present")
    penalties: torch.Tensor  # [bs, 1] float32, 0 = neutral
    present: torch.Tensor  # [bs, vocab] float32, 1.0 where the token is in the output

    @staticmethod
    def is_required_for(params: SamplingParams) -> bool:
        return params.presence_penalty != 0

    def _allocate(self, batch_size: int) -> None:
        self.penalties = torch.zeros((batch_size, 1), dtype=torch.float32, device=self.device)
        self.present = torch.zeros((batch_size, self.vocab_size), dtype=torch.float32, device=self.device)

    def _fill(self, reqs: Sequence[Any]) -> None:
        values = [float(r.sampling_params.presence_penalty) for r in reqs]
        self.penalties = host_to_device(values, torch.float32, self.device).view(-1, 1)
        history = [r.output_ids if self.is_required_for(r.sampling_params) else [] for r in reqs]
        rows, toks = flatten_token_lists(history, self.vocab_size, self.device)
        self.present[rows, toks] = 1.0

    def _cumulate(self, next_token_ids: torch.Tensor) -> None:
        self.present.scatter_(1, next_token_ids.view(-1, 1), 1.0)

    def _apply(self, logits: torch.Tensor) -> None:
        logits.addcmul_(self.present, self.penalties, value=-1.0)
