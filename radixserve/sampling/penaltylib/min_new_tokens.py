"""min_new_tokens: until a request has produced min_new_tokens tokens, its EOS tokens (`req.eos_token_ids`) and
its `stop_token_ids` get a logit of -inf, so it cannot end early."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.sampling.penaltylib.base import BatchedPenalizer, flatten_token_lists, host_to_device
from radixserve.sampling.sampling_params import SamplingParams


class BatchedMinNewTokensPenalizer(BatchedPenalizer):
    tensor_attrs = ("min_new_tokens", "generated", "stop_mask")
    min_new_tokens: torch.Tensor  # [bs, 1] int64, 0 = neutral
    generated: torch.Tensor  # [bs, 1] int64, tokens produced so far
    stop_mask: torch.Tensor  # [bs, vocab] bool, the row's EOS and stop token ids

    @staticmethod
    def is_required_for(params: SamplingParams) -> bool:
        return params.min_new_tokens > 0

    def _allocate(self, batch_size: int) -> None:
        self.min_new_tokens = torch.zeros((batch_size, 1), dtype=torch.int64, device=self.device)
        self.generated = torch.zeros((batch_size, 1), dtype=torch.int64, device=self.device)
        self.stop_mask = torch.zeros((batch_size, self.vocab_size), dtype=torch.bool, device=self.device)

    def _fill(self, reqs: Sequence[Any]) -> None:
        pairs = [[int(r.sampling_params.min_new_tokens), len(r.output_ids)] for r in reqs]
        state = host_to_device(pairs, torch.int64, self.device).view(-1, 2)
        self.min_new_tokens = state[:, 0:1].contiguous()
        self.generated = state[:, 1:2].contiguous()
        stop_ids: list[list[int]] = []
        for r in reqs:
            ids: set[int] = set()
            if self.is_required_for(r.sampling_params):
                ids.update(r.eos_token_ids or ())
                ids.update(r.sampling_params.stop_token_ids or ())
            stop_ids.append(sorted(ids))
        rows, toks = flatten_token_lists(stop_ids, self.vocab_size, self.device)
        self.stop_mask[rows, toks] = True

    def _cumulate(self, next_token_ids: torch.Tensor) -> None:
        self.generated = self.generated + 1

    def _apply(self, logits: torch.Tensor) -> None:
        logits.masked_fill_(self.stop_mask & (self.generated < self.min_new_tokens), float("-inf"))
