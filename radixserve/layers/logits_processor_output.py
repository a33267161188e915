"""LogitsProcessorOutput: what the logits processor hands the sampler (and the sampler fills in)."""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass
class LogitsProcessorOutput:
    # [bs, vocab] float32, the last position of each request. The sampler applies penalties/bias/mask in place.
    next_token_logits: torch.Tensor
    # [bs] int64 argmax of the raw logits, computed inside a decode CUDA graph; the sampler returns it as is when
    # nothing changes the logits and every row is greedy (no penalties, bias, grammar mask or logprobs).
    greedy_token_ids: torch.Tensor | None = None
    # Filled by the sampler when logprobs are asked for: [bs] float32 on the device, the chosen token's logprob
    # under the final (processed) distribution.
    next_token_logprobs: torch.Tensor | None = None
    # Per row, top_logprobs_nums[i] entries, best first (CPU lists).
    next_token_top_logprobs_val: list[list[float]] | None = None
    next_token_top_logprobs_idx: list[list[int]] | None = None
    # Prompt logprobs (filled by the logits processor).
    input_token_logprobs: torch.Tensor | None = None
    input_top_logprobs_val: list | None = None  # per request, per prompt position: list[float]
    input_top_logprobs_idx: list | None = None  # per request, per prompt position: list[int]
    # Embedding requests (forward_batch.pooling): [bs, hidden] float32, the final hidden state of the last extend
    # token ("last") or the sum over the extend tokens ("mean"); zeros in other rows
    pooled_hidden: torch.Tensor | None = None
