"""Repetition penalty (CTRL / Hugging Face): for every token seen in the prompt or the output so far, a positive
logit is divided by the factor and a negative one multiplied by it. A factor of 1 is neutral."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.sampling.penaltylib.base import BatchedPenalizer, flatten_token_lists, host_to_device
from radixserve.sampling.sampling_params import SamplingParams


class BatchedRepetitionPenalizer(BatchedPenalizer):
    tensor_attrs = ("factors", "seen")
    factors: torch.Tensor  # [bs, 1] float32, 1 = neutral
    seen: torch.Tensor  # [bs, vocab] bool, token in prompt or output

    @staticmethod
    def is_required_for(params: SamplingParams) -> bool:
        return params.repetition_penalty != 1

    def _allocate(self, batch_size: int) -> None:
        self.factors = torch.ones((batch_size, 1), dtype=torch.float32, device=self.device)
        self.seen = torch.zeros((batch_size, self.vocab_size), dtype=torch.bool, device=self.device)

    def _fill(self, reqs: Sequence[Any]) -> None:
        values = [float(r.sampling_params.repetition_penalty) for r in reqs]
        self.factors = host_to_device(values, torch.float32, self.device).view(-1, 1)
        # Neutral rows need no history: their factor is 1 wherever they have seen a token.
        history = [list(r.origin_input_ids) + list(r.output_ids) if self.is_required_for(r.sampling_params) else []
                   for r in reqs]
        rows, toks = flatten_token_lists(history, self.vocab_size, self.device)
        self.seen[rows, toks] = True

    def _cumulate(self, next_token_ids: torch.Tensor) -> None:
        self.seen.scatter_(1, next_token_ids.view(-1, 1), True)

    def _apply(self, logits: torch.Tensor) -> None:
        factors = torch.where(self.seen, self.factors, 1.0)
        logits.copy_(torch.where(logits > 0, logits / factors, logits * factors))
