"""The worker side of speculative decoding: one TARGET_VERIFY forward over each request's last token followed by its
drafts, then the target's own token at every position, and the longest agreeing run.

The forward is decode-shaped: a request with prefix p and k drafts becomes k + 1 decode rows of the same request,
row j at position p + j reading the request's KV up to p + j + 1. Every layer stores the new tokens' K/V before its
attention reads the pool, so row j sees the drafts before it and not those after: exactly the causal verify. The
rows go through the decode kernels and, on a GPU, replay the decode CUDA graph of batch size sum(k_i + 1) (captured
once per size, shared with plain decoding) instead of running an eager extend; each prefix is read k + 1 times, a
small cost next to the weights at the k of speculation.

Exactness. Position 0 of every request is sampled by the ordinary Sampler on a [bs, vocab] batch, exactly as a
decode step would (penalties, logit bias, grammar mask, seeds, logprobs, then `update_penalties`). Later positions
exist only for requests the scheduler let draft (no penalties, no seed: see `scheduler_mixin.spec_eligible`), so
their logits need only the static logit bias and, for a constrained request, its grammar's mask at that position
(the scheduler walks the matcher along the drafts, cutting them at the first token it rejects) before the same
choice the Sampler makes (argmax for greedy rows; temperature, top-k/top-p/min-p and an exponential race for the
others). A draft is accepted when the target's token at its position equals it. For greedy rows that is exact
equality with plain decoding. For sampled rows it is rejection sampling with a point-mass proposal q = 1[d]: the
draft survives with probability p(d) and otherwise the emitted token is distributed as p restricted to tokens != d,
renormalised, i.e. (p - q)+ — the target's distribution is kept.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from types import SimpleNamespace
from typing import Any

import torch

from radixserve.constrained.base_grammar_backend import bitmask_to_vocab_mask
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.layers.sampler import Sampler
from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.managers.tp_worker import _vocab_mask
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode


@dataclass
class VerifyResult:
    tokens: list[list[int]]  # per request: the emitted tokens (accepted drafts, then the target's own), >= 1
    num_drafts: list[int]  # per request: how many tokens were drafted
    logprobs: list[list[float]] | None = None  # per request, per emitted token (when any request asked)
    top_logprobs: list[list[list[tuple[float, int]]]] | None = None


def target_choice(logits: torch.Tensor, info: Any, rows: torch.Tensor, return_logprob: bool,
                  top_nums: list[int] | None, vocab_mask: torch.Tensor | None = None) -> tuple[torch.Tensor, Any]:
    """The Sampler's choice on `logits` [n, vocab], row r taking the sampling parameters of request rows[r] (no
    penalties, grammar or seed: the caller only passes rows that have none). Returns (ids [n], a
    LogitsProcessorOutput holding the logprobs when asked)."""
    logits = logits.float()
    if info.logit_bias is not None:
        logits = logits + info.logit_bias[rows]
    if vocab_mask is not None:  # a constrained request's grammar at each drafted position (True = disallowed)
        logits = logits.masked_fill(vocab_mask, float("-inf"))
    greedy = info.top_ks[rows] == 1
    out = LogitsProcessorOutput(next_token_logits=logits)
    if info.is_all_greedy:
        ids = torch.argmax(logits, dim=-1)
        logprobs = torch.log_softmax(logits, dim=-1) if return_logprob else None
    else:
        sub = SimpleNamespace(temperatures=info.temperatures[rows], top_ks=info.top_ks[rows],
                              top_ps=info.top_ps[rows], min_ps=info.min_ps[rows], need_top_k=info.need_top_k,
                              need_top_p=info.need_top_p, need_min_p_sampling=info.need_min_p_sampling,
                              has_seeded=False, seeded_indices=None, has_greedy=bool(greedy.any()))
        ids, logprobs = Sampler._sample(logits, sub, return_logprob)
    if logprobs is not None:
        Sampler._fill_logprobs(out, logprobs, ids, top_nums)
    return ids, out


def accept(drafts: list[list[int]], targets: list[list[int]]) -> list[list[int]]:
    """Per request: the target's tokens up to and including the first one that differs from the draft at its
    position (all of them when every draft agreed: the last one is a bonus token)."""
    out = []
    for d, t in zip(drafts, targets, strict=True):
        n = 0
        while n < len(d) and d[n] == t[n]:
            n += 1
        out.append(t[:n + 1])
    return out


def as_decode_rows(batch: ModelWorkerBatch) -> ModelWorkerBatch:
    """An extend batch (TARGET_VERIFY, or a short catch-up extend of a draft model) as one decode row per new token:
    the row of new token j of a request with prefix p has that request's table row, seq_len p + j + 1 and position
    p + j. The logits come back one row per token, in the extend's order."""
    ext, pre = batch.extend_seq_lens, batch.extend_prefix_lens
    if ext is None or pre is None:
        raise ValueError("as_decode_rows needs an extend batch (extend_seq_lens and extend_prefix_lens)")
    seq = [p + j + 1 for p, n in zip(pre, ext, strict=True) for j in range(n)]
    seq_t = torch.tensor(seq, dtype=torch.int64)
    counts = torch.tensor(ext, dtype=torch.int64)
    lora = None
    if batch.lora_slots is not None:
        lora = [s for s, n in zip(batch.lora_slots, ext, strict=True) for _ in range(n)]
    return dataclasses.replace(
        batch, forward_mode=ForwardMode.DECODE, req_pool_indices=batch.req_pool_indices.repeat_interleave(counts),
        seq_lens=seq_t, seq_lens_cpu=seq, seq_lens_sum=sum(seq), extend_seq_lens=None, extend_prefix_lens=None,
        extend_logprob_start_lens_cpu=None, positions=seq_t - 1, num_future_refs=None, lora_slots=lora,
        pooling=None)


def run_verify_batch(runner: Any, batch: ModelWorkerBatch, drafts: list[list[int]],
                     pos_bitmask: torch.Tensor | None = None) -> VerifyResult:
    """Everything a verify step does on the device, in the order run_model_worker_batch does it for a decode.
    pos_bitmask: the packed grammar masks of the drafted positions after the first (request order, then position),
    None when no drafting request is constrained."""
    runner.req_to_token_pool.apply_writes(batch.req_to_token_writes)
    if batch.lora_loads:
        runner.lora_manager.apply_loads(batch.lora_loads)
    info = batch.sampling_info.apply(batch.sampling_ops)
    info.vocab_mask = None
    if isinstance(batch.grammar_bitmask, torch.Tensor):
        info.vocab_mask = _vocab_mask(batch.grammar_bitmask, info, runner)
    fb = ForwardBatch.init_new(as_decode_rows(batch), runner, sampling_info=info)
    logits = runner.forward(fb).next_token_logits  # [sum(1 + k_i), vocab]
    lens = [1 + len(d) for d in drafts]
    fb.top_logprobs_nums = batch.top_logprobs_nums or [0] * len(lens)  # sampling sees one row per request
    fb.return_logprob = batch.return_logprob
    starts = [0] * len(lens)
    for i in range(1, len(lens)):
        starts[i] = starts[i - 1] + lens[i - 1]
    device = logits.device
    first = LogitsProcessorOutput(next_token_logits=logits[torch.tensor(starts, device=device)])
    t0 = runner.sample(first, fb)  # exactly a decode step's sampling
    info.vocab_mask = None
    info.update_penalties(t0)
    want_lp = batch.return_logprob
    top_nums = fb.top_logprobs_nums
    targets = [[t] for t in t0.tolist()]
    lps = [[v] for v in first.next_token_logprobs.tolist()] if want_lp else None
    tops = None
    if want_lp:
        vals, idx = first.next_token_top_logprobs_val, first.next_token_top_logprobs_idx
        tops = [[list(zip(vals[i], idx[i], strict=True))] for i in range(len(lens))]
    pos = [(i, starts[i] + j) for i, d in enumerate(drafts) for j in range(1, len(d) + 1)]
    if pos:
        rows = torch.tensor([p[0] for p in pos], device=device)
        sub_nums = [top_nums[p[0]] for p in pos]
        mask = None
        if pos_bitmask is not None:
            if pos_bitmask.shape[0] != len(pos):
                raise ValueError(f"grammar masks: {pos_bitmask.shape[0]} rows for {len(pos)} drafted positions")
            mask = bitmask_to_vocab_mask(pos_bitmask, info.vocab_size, device)
        ids, out = target_choice(logits[torch.tensor([p[1] for p in pos], device=device)], info, rows, want_lp,
                                 sub_nums, mask)
        if runner.tp_size > 1 and not info.is_all_greedy:
            from radixserve.distributed.parallel_state import broadcast_tensor_from_first_rank

            broadcast_tensor_from_first_rank(ids)  # a random draw is rank 0's to make
        ids_l = ids.tolist()
        lp_l = out.next_token_logprobs.tolist() if want_lp else None
        for r, (i, _) in enumerate(pos):
            targets[i].append(ids_l[r])
            if want_lp:
                lps[i].append(lp_l[r])
                tops[i].append(list(zip(out.next_token_top_logprobs_val[r], out.next_token_top_logprobs_idx[r],
                                        strict=True)))
    tokens = accept(drafts, targets)
    if want_lp:
        lps = [lp[:len(t)] for lp, t in zip(lps, tokens, strict=True)]
        tops = [tp[:len(t)] for tp, t in zip(tops, tokens, strict=True)]
    return VerifyResult(tokens=tokens, num_drafts=[len(d) for d in drafts], logprobs=lps, top_logprobs=tops)
