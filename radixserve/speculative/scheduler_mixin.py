"""The scheduler side of speculative decoding (a mixin of Scheduler; active with --speculative-algorithm).

A decode step becomes a verify step: each eligible request drafts up to k tokens, gets k more KV slots right after
its decode slot, and the batch runs as one TARGET_VERIFY extend (prefix = the request's KV, new tokens = its last
token and its drafts). The accepted tokens are appended one at a time with the usual finish checks (stop ids and
strings, max_new_tokens); the slots of every position past the last kept token go back to the free list in the same
step, so the idle invariant holds. When no request drafts anything, the step is a plain decode (CUDA graph and
all), so speculation costs nothing where it finds nothing to guess.

Adaptive back-off: a request whose drafts keep failing (fewer than BACKOFF_MIN_ACCEPT accepted per verify over
its last BACKOFF_WINDOW verifies) stops drafting for a pause that doubles each time it happens again (up to
BACKOFF_MAX_PAUSE steps), then tries again.

Overlap scheduling is off with speculation (the next step's drafts need this step's accepted tokens on the host).
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass

import torch

from radixserve.managers.schedule_batch import LaunchedBatch, Req, ScheduleBatch
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.speculative.verify import VerifyResult, run_verify_batch

logger = logging.getLogger(__name__)

BACKOFF_WINDOW = 4  # verifies looked at
BACKOFF_MIN_ACCEPT = 0.5  # accepted drafts per verify below which a request pauses drafting
BACKOFF_FIRST_PAUSE = 8  # decode steps
BACKOFF_MAX_PAUSE = 256


@dataclass
class SpecStep:
    """What a verify step's result is processed against (LaunchedBatch.spec)."""

    seq_lens: list[int]  # each request's length before the step (its decode slot sits at seq_len - 1)
    extra: list[torch.Tensor]  # each request's drafts' KV slots (positions seq_len .. seq_len + k - 1)


def spec_eligible(req: Req) -> bool:
    """Whether a request may draft: its later positions are then chosen from the logits alone (plus its static
    logit bias and its grammar's mask at each drafted position), which is exact only without penalties, seed or a
    pending min_new_tokens."""
    sp = req.sampling_params
    return (sp.seed is None and sp.frequency_penalty == 0.0 and sp.presence_penalty == 0.0
            and sp.repetition_penalty == 1.0 and len(req.output_ids) >= sp.min_new_tokens)


class SchedulerSpeculativeMixin:
    def init_speculative(self) -> None:
        args = self.server_args
        self.spec_drafter = None
        self.spec_num_verify = 0  # verify steps and the tokens they produced (all requests), for the stats
        self.spec_num_tokens = 0
        self.spec_num_rows = 0  # request-steps in verify batches
        if args.speculative_algorithm is None:
            return
        from radixserve.speculative import create_drafter

        self.spec_drafter = create_drafter(args.speculative_algorithm, args, pool_size=self.token_to_kv_pool.size,
                                           max_running_requests=self.max_running_requests)
        if hasattr(self.spec_drafter, "check_target"):
            self.spec_drafter.check_target(self.vocab_size)
        self.spec_k = args.speculative_num_draft_tokens
        if args.enable_overlap_schedule or self.device != "cpu":
            logger.info("speculative decoding (%s) runs without overlap scheduling: each step's drafts are made from "
                        "the previous step's accepted tokens, which must be on the host first",
                        args.speculative_algorithm)

    # ---------------------------------------------------------------- drafting
    def spec_num_to_draft(self, req: Req, seq_len: int) -> int:
        if not spec_eligible(req):
            return 0
        if req.spec_pause > 0:
            req.spec_pause -= 1
            return 0
        left = req.sampling_params.max_new_tokens - len(req.output_ids) - 1  # the last token is the target's own
        return max(0, min(self.spec_k, left, self.context_len - seq_len - 1))

    def spec_backoff(self, req: Req, accepted: int) -> None:
        hist = req.spec_history
        hist.append(accepted)
        if len(hist) > BACKOFF_WINDOW:
            del hist[0]
        if len(hist) == BACKOFF_WINDOW and sum(hist) / BACKOFF_WINDOW < BACKOFF_MIN_ACCEPT:
            req.spec_backoff = min(BACKOFF_MAX_PAUSE, max(BACKOFF_FIRST_PAUSE, 2 * req.spec_backoff))
            req.spec_pause = req.spec_backoff
            hist.clear()
        elif accepted > 0:
            req.spec_backoff = max(0, req.spec_backoff // 2)

    # ---------------------------------------------------------------- the step
    def run_spec_batch(self, batch: ScheduleBatch) -> LaunchedBatch | None:
        """Turn a prepared decode batch into a verify step and run it; None when nobody drafted (run it as a plain
        decode then)."""
        reqs = batch.reqs
        seq = batch.seq_lens_list if batch.seq_lens_list is not None else batch.seq_lens.tolist()
        drafts = self.spec_drafter.propose_batch(reqs, [self.spec_num_to_draft(r, n)
                                                        for r, n in zip(reqs, seq, strict=True)])
        pos_bitmask = self.spec_grammar_masks(reqs, drafts)
        n_extra = sum(len(d) for d in drafts)
        if n_extra == 0:
            return None
        extra = self.token_to_kv_pool.alloc(n_extra)
        if extra is None:
            self.tree_cache.evict(n_extra - self.token_to_kv_pool.available_size())
            extra = self.token_to_kv_pool.alloc(n_extra)
        if extra is None:
            return None  # no room for drafts: a plain decode step
        self.forward_ct += 1
        self.last_step_time = time.monotonic()
        if self.tp_rank == 0 and logger.isEnabledFor(logging.INFO):
            self.log_batch_stats(batch)
        k = [len(d) for d in drafts]
        extra_per_req = list(torch.split(extra, k))
        # the request table: drafts' slots right after the decode slot (position seq_len - 1)
        rows = [(r.req_pool_idx, n, n_k) for r, n, n_k in zip(reqs, seq, k, strict=True) if n_k]
        batch._write_req_to_token([x[0] for x in rows], [x[1] for x in rows], [x[2] for x in rows], extra)
        ids = batch.input_ids.tolist()
        dec_loc = batch.out_cache_loc
        batch.input_ids = torch.tensor([t for i, d in enumerate(drafts) for t in (ids[i], *d)], dtype=torch.int64)
        batch.out_cache_loc = torch.cat([p for i in range(len(reqs)) for p in (dec_loc[i:i + 1], extra_per_req[i])])
        batch.prefix_lens = [n - 1 for n in seq]
        batch.extend_lens = [1 + n_k for n_k in k]
        batch.seq_lens_list = [n + n_k for n, n_k in zip(seq, k, strict=True)]
        batch.seq_lens = torch.tensor(batch.seq_lens_list, dtype=torch.int64)
        batch.positions = None
        batch.decode_pack = None
        batch.forward_mode = ForwardMode.TARGET_VERIFY
        try:
            mwb = batch.get_model_worker_batch()
        finally:
            batch.forward_mode = ForwardMode.DECODE
        if self.grammar_backend is not None and any(r.grammar is not None for r in reqs):
            mwb.grammar_bitmask = self.build_grammar_bitmask(reqs)
        for r, n in zip(reqs, seq, strict=True):
            r.kv_committed_len = n  # until the result says how many drafts are kept
        view = LaunchedBatch(bid=self.forward_ct, reqs=list(reqs), forward_mode=ForwardMode.TARGET_VERIFY,
                             n_prefill=0, return_logprob=mwb.return_logprob, chunked_req=None,
                             spec=SpecStep(seq_lens=seq, extra=extra_per_req))
        try:
            view.result = run_verify_batch(self.worker.model_runner, mwb, drafts, pos_bitmask)
        except BaseException:
            self.token_to_kv_pool.free(extra)
            raise
        return view

    def spec_grammar_masks(self, reqs: list[Req], drafts: list[list[int]]) -> torch.Tensor | None:
        """Constrained requests: cut each draft at its first token the request's matcher rejects (in place), and
        return the packed masks of every drafted position after the first (rows in request order, then position;
        every token allowed in the rows of unconstrained requests). The matchers are rolled back after; None when
        no drafting request is constrained."""
        if not any(r.grammar is not None and d for r, d in zip(reqs, drafts, strict=True)):
            return None
        masks = []
        for i, req in enumerate(reqs):
            d, g = drafts[i], req.grammar
            m = self.grammar_backend.allocate_vocab_mask(len(d))
            if g is not None and d:
                if g.num_accepted != len(req.output_ids) and not g.sync_to(req.output_ids):
                    d.clear()
                    continue
                n = 0
                for tok in d:
                    if g.is_terminated() or not g.accept_token(tok):
                        break
                    if not g.is_terminated():  # the mask of the position after this draft (row n)
                        g.fill_vocab_mask(m, n)
                    n += 1
                g.rollback(n)
                del d[n:]
            masks.append(m[:len(d)])
        return torch.cat(masks) if masks else None

    def process_spec_result(self, batch: LaunchedBatch) -> None:
        """Commit each request's accepted tokens (stopping at its first finish), free the KV slots of every
        position past its last kept token, then cache finished requests and stream."""
        result: VerifyResult = batch.result
        step: SpecStep = batch.spec
        tokenizer = self.tokenizer
        to_free = []
        newly_finished = []
        for i, req in enumerate(batch.reqs):
            extra = step.extra[i]
            if req.finished_reason is not None:  # finished before this step (not expected in a running batch)
                if len(extra):
                    to_free.append(extra)
                continue
            toks = result.tokens[i]
            kept = 0
            for j, tok in enumerate(toks):
                req.output_ids.append(tok)
                kept += 1
                if result.logprobs is not None and req.return_logprob:
                    req.output_token_logprobs.append((result.logprobs[i][j], tok))
                    if req.top_logprobs_num:
                        req.output_top_logprobs.append(result.top_logprobs[i][j][:req.top_logprobs_num])
                if req.grammar is not None:
                    self._advance_grammar(req, tok)
                req.check_finished(tokenizer)
                if req.finished_reason is not None:
                    break
            if result.num_drafts[i]:
                self.spec_backoff(req, len(toks) - 1)
            req.spec_verify_ct += 1
            req.spec_tokens += kept
            self.spec_num_tokens += kept
            # positions seq-1 .. seq+kept-2 hold the KV of the kept tokens but the last (which never ran through
            # the model); the drafts' slots past that go back to the free list now
            if len(extra) > kept - 1:
                to_free.append(extra[kept - 1:])
            req.kv_committed_len = step.seq_lens[i] + kept - 1
            if req.finished_reason is not None:
                newly_finished.append(req)
        if to_free:
            self.token_to_kv_pool.free(torch.cat(to_free))
        for req in newly_finished:
            self.tree_cache.cache_finished_req(req)
            if hasattr(self.spec_drafter, "release"):
                self.spec_drafter.release(req)
        self.spec_num_verify += 1
        self.spec_num_rows += len(batch.reqs)
        self._log_decode_tokens += sum(len(t) for t in result.tokens) - len(batch.reqs)
        self.stream_output(batch.reqs)

    def spec_check_draft_memory(self) -> bool:
        """When idle: release the draft state of the requests that finished outside a verify step (a plain decode, an
        abort; otherwise held until the next round of drafting), then check that the draft model's KV pool and request
        table are all free. Logged and counted if not; True without a draft model."""
        d = self.spec_drafter
        if d is None or not hasattr(d, "token_to_kv_pool"):
            return True
        d.gc()
        kv, rows = d.token_to_kv_pool, d.req_to_token_pool
        if not d.states and kv.available_size() == kv.size and rows.available_size() == rows.size:
            return True
        self.invariant_violations += 1
        logger.error("draft model memory leak: %d request states, free=%d of %d tokens, free_req_slots=%d/%d",
                     len(d.states), kv.available_size(), kv.size, rows.available_size(), rows.size)
        return False

    def spec_log_accept_length(self) -> float:
        """Mean tokens per request per verify step since the previous call (1.0 when no verify ran: every token
        came from a plain step)."""
        last = getattr(self, "_spec_log_mark", (0, 0))
        tokens, rows = self.spec_num_tokens - last[0], self.spec_num_rows - last[1]
        self._spec_log_mark = (self.spec_num_tokens, self.spec_num_rows)
        return tokens / rows if rows else 1.0

    def spec_accept_length(self) -> float | None:
        """Mean tokens per request per verify step so far (None before the first)."""
        return self.spec_num_tokens / self.spec_num_rows if self.spec_num_rows else None
