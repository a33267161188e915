"""Sampler: processed logits -> next token ids (and their logprobs), for a whole batch at once.

Per step, on float32 logits [bs, vocab]:
1. `sampling_info.apply_logits_bias(logits)`: penalties, logit_bias, grammar mask (in place).
2. All rows greedy: exact argmax. Done.
3. Otherwise: divide by the temperature, softmax, then top-k, top-p and min-p from a single sort:
   top-k keeps the k most likely tokens; top-p keeps the smallest prefix (in sorted order) whose mass reaches
   top_p of the mass top-k kept (i.e. top-p on the top-k distribution renormalised, as Hugging Face and vLLM do);
   min-p drops tokens whose probability is below min_p times the most likely one's. The most likely token
   always survives.
4. Sample by the exponential race: argmax(p / E) with E ~ Exp(1) i.i.d. picks token t with probability
   p[t] / sum(p), so the filtered distribution needs no explicit renormalisation and nothing syncs with the host.
   Unseeded rows draw E from torch's global generator. Seeded rows draw E from a counter-based hash of
   (seed, step, token id), step = tokens the request has produced: the draw depends only on the request itself,
   never on its batch neighbours or its position in the batch. Greedy rows of a mixed batch take the exact argmax.
5. Logprobs (when asked): log-softmax of the final distribution, with filtered tokens at -inf. A greedy row's
   distribution is its processed logits at temperature 1 (no top-k/p/min-p cut).
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers import cpu_ops
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

_M32 = 0xFFFFFFFF


def _mul32(x: torch.Tensor, c: int) -> torch.Tensor:
    """(x * c) mod 2**32 for int64 x in [0, 2**32) and a 32-bit constant c, without overflowing int64.

    c is taken as its signed 32-bit value (c - 2**32 when c >= 2**31): congruent mod 2**32, and |x * c| < 2**63.
    The mask of a negative product still gives its low 32 bits (two's complement)."""
    signed = c - (1 << 32) if c >= (1 << 31) else c
    return (x * signed) & _M32


def _fmix32(x: torch.Tensor) -> torch.Tensor:
    """A 32-bit avalanche mix (a bijection on [0, 2**32)), values held in int64."""
    x = x ^ (x >> 16)
    x = _mul32(x, 0x85EBCA6B)
    x = x ^ (x >> 13)
    x = _mul32(x, 0xC2B2AE35)
    return x ^ (x >> 16)


def seeded_exponential_noise(seeds: torch.Tensor, steps: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """Exp(1) noise [n, vocab_size] float32, a pure function of (seed, step, token id) per row.

    seeds: int64 [n] in [0, 2**63); steps: int64 [n] >= 0. Runs on the seeds' device, no host sync."""
    seeds = seeds.to(torch.int64).view(-1, 1)
    steps = steps.to(torch.int64).view(-1, 1)
    seed_lo = seeds & _M32
    seed_hi = (seeds >> 32) & _M32
    a = _fmix32(_mul32(steps & _M32, 0x9E3779B1) ^ 0x7F4A7C15)
    b = _fmix32(seed_hi ^ a)
    key1 = _fmix32(seed_lo ^ b ^ 0x2545F491)
    key2 = _fmix32(key1 ^ 0x68E31DA4)
    token = torch.arange(vocab_size, dtype=torch.int64, device=seeds.device).view(1, -1)
    x = _fmix32(_mul32(token, 0x27D4EB2F) ^ key1)
    x = _fmix32(x ^ key2)
    # 23 random bits -> an odd multiple of 2**-24 strictly inside (0, 1), exact in float32.
    u = ((x >> 9) * 2 + 1).to(torch.float32) * (2.0**-24)
    return -torch.log(u)


def _removed_mask(probs: torch.Tensor, info: SamplingBatchInfo) -> torch.Tensor | None:
    """Tokens that top-k / top-p / min-p remove, as a bool mask in vocabulary order (None: nothing to do)."""
    if not (info.need_top_k or info.need_top_p or info.need_min_p_sampling):
        return None
    vocab_size = probs.shape[-1]
    # Stable: ties keep vocabulary order, so which of equal tokens survive a cut depends on the row alone.
    probs_sort, order = probs.sort(dim=-1, descending=True, stable=True)
    remove = torch.zeros_like(probs_sort, dtype=torch.bool)
    if info.need_top_k:
        ranks = torch.arange(vocab_size, device=probs.device).view(1, -1)
        remove |= ranks >= info.top_ks.view(-1, 1)
    if info.need_top_p:
        csum = probs_sort.cumsum(dim=-1)
        # The mass top-k keeps (the whole distribution when top-k is off): top-p is relative to it.
        kept_mass = csum.gather(1, (info.top_ks.clamp(1, vocab_size) - 1).view(-1, 1))
        mass_before = F.pad(csum[:, :-1], (1, 0))
        top_ps = info.top_ps.view(-1, 1)
        remove |= (mass_before >= top_ps * kept_mass) & (top_ps < 1.0)
    if info.need_min_p_sampling:
        remove |= probs_sort < info.min_ps.view(-1, 1) * probs_sort[:, :1]
    remove[:, 0] = False
    return torch.zeros_like(remove).scatter_(1, order, remove)


# the logprob reported for a token the sampling removed (its -inf is not JSON), as vLLM reports it
LOGPROB_FLOOR = -9999.0


class Sampler(nn.Module):
    def forward(self, logits_output: LogitsProcessorOutput, sampling_info: SamplingBatchInfo,
                return_logprob: bool = False, top_logprobs_nums: Sequence[int] | None = None) -> torch.Tensor:
        """Next token ids [bs] (int64, on the logits' device). Fills logits_output.next_token_logprobs and
        next_token_top_logprobs_val/idx when return_logprob."""
        if (logits_output.greedy_token_ids is not None and sampling_info.is_all_greedy and not return_logprob
                and sampling_info.logit_bias is None and sampling_info.vocab_mask is None
                and not sampling_info.penalizer_orchestrator.is_required):
            return logits_output.greedy_token_ids  # the argmax the CUDA graph already took of the same logits
        logits = logits_output.next_token_logits
        if logits.dtype != torch.float32:
            logits = logits.float()
            logits_output.next_token_logits = logits
        sampling_info.apply_logits_bias(logits)

        if sampling_info.is_all_greedy:
            next_ids = cpu_ops.argmax_rows(logits) if logits.device.type == "cpu" else None
            if next_ids is None:
                next_ids = torch.argmax(logits, dim=-1)
            logprobs = torch.log_softmax(logits, dim=-1) if return_logprob else None
        else:
            next_ids, logprobs = self._sample(logits, sampling_info, return_logprob)

        if logprobs is not None:
            self._fill_logprobs(logits_output, logprobs, next_ids, top_logprobs_nums)
        return next_ids

    @staticmethod
    def _sample(logits: torch.Tensor, info: SamplingBatchInfo,
                return_logprob: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        scaled = logits / info.temperatures
        probs = torch.softmax(scaled, dim=-1)
        removed = _removed_mask(probs, info)
        if removed is not None:
            probs = probs.masked_fill(removed, 0.0)

        noise = torch.empty_like(probs).exponential_()
        noise.clamp_min_(torch.finfo(torch.float32).tiny)
        if info.has_seeded and info.seeded_indices is not None:
            idx = info.seeded_indices
            noise[idx] = seeded_exponential_noise(info.seeds[idx], info.sampling_steps[idx], logits.shape[-1])
        next_ids = torch.argmax(probs / noise, dim=-1)

        greedy = None
        if info.has_greedy:
            greedy = info.top_ks == 1
            next_ids = torch.where(greedy, torch.argmax(logits, dim=-1), next_ids)

        if not return_logprob:
            return next_ids, None
        if removed is not None:
            if greedy is not None:
                removed = removed & ~greedy.view(-1, 1)
            scaled = scaled.masked_fill(removed, float("-inf"))
        return next_ids, torch.log_softmax(scaled, dim=-1)

    @staticmethod
    def _fill_logprobs(logits_output: LogitsProcessorOutput, logprobs: torch.Tensor, next_ids: torch.Tensor,
                       top_logprobs_nums: Sequence[int] | None) -> None:
        bs, vocab_size = logprobs.shape
        logits_output.next_token_logprobs = logprobs.gather(1, next_ids.view(-1, 1)).view(-1).clamp_min(LOGPROB_FLOOR)
        nums = [0] * bs if top_logprobs_nums is None else [int(n) for n in top_logprobs_nums]
        if len(nums) != bs:
            raise ValueError(f"top_logprobs_nums: expected {bs} entries, got {len(nums)}")
        if any(n < 0 for n in nums):
            raise ValueError(f"top_logprobs_nums: entries must be >= 0, got {nums}")
        k = min(max(nums, default=0), vocab_size)
        if k == 0:
            logits_output.next_token_top_logprobs_val = [[] for _ in range(bs)]
            logits_output.next_token_top_logprobs_idx = [[] for _ in range(bs)]
            return
        values, indices = logprobs.topk(k, dim=-1)
        # tokens a grammar, top-k or top-p removed have -inf (JSON has no infinity: it would print null), as vLLM
        values = values.clamp_min(LOGPROB_FLOOR)
        values_l, indices_l = values.tolist(), indices.tolist()  # one host sync for the whole batch
        logits_output.next_token_top_logprobs_val = [values_l[i][: nums[i]] for i in range(bs)]
        logits_output.next_token_top_logprobs_idx = [indices_l[i][: nums[i]] for i in range(bs)]
