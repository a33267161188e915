"""Structured output inside the scheduler: the grammar queue, per-step token masks, and advancing each request's
matcher with its sampled tokens. A mixin of Scheduler (it uses the scheduler's queues and send paths)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from radixserve.managers.finish_reason import FinishAbort, FinishMatchedToken

if TYPE_CHECKING:
    import torch

    from radixserve.managers.schedule_batch import Req

logger = logging.getLogger(__name__)


class SchedulerGrammarMixin:
    def move_ready_grammar_reqs(self) -> None:
        """Requests whose grammar is compiled go to the waiting queue (in arrival order); an invalid grammar is a
        400 for its request alone. With --tp-size > 1 rank 0 decides which are ready (the compile threads of the
        ranks finish at different times) and the other ranks wait for those, so every rank admits the same."""
        if not self.grammar_queue:
            return
        ready = {id(r) for r in self.grammar_queue if r.grammar_future.done()}
        if self.tp_size > 1:
            from radixserve.distributed.parallel_state import broadcast_pyobj

            ready_rids = broadcast_pyobj([r.rid for r in self.grammar_queue if id(r) in ready]
                                         if self.tp_rank == 0 else None)
            ready = {id(r) for r in self.grammar_queue if r.rid in set(ready_rids)}
        if not ready:
            return
        keep = []
        for req in self.grammar_queue:
            if id(req) not in ready:
                keep.append(req)
                continue
            try:
                template = req.grammar_future.result()
            except Exception as e:  # GrammarError: a bad schema / regex / EBNF
                self.send_abort(req.rid, str(e), status=400)
                continue
            finally:
                req.grammar_future = None
            req.grammar = template.copy()
            self.waiting_queue.append(req)
        self.grammar_queue = keep

    def build_grammar_bitmask(self, reqs: list[Req]) -> torch.Tensor | None:
        """The packed token bitmask of one step: a row per request, filled by the matchers of unfinished
        constrained requests, every token allowed in the other rows. None when no row is constrained."""
        rows = [(i, r) for i, r in enumerate(reqs) if r.grammar is not None and not r.finished()]
        if not rows:
            return None
        mask = self.grammar_backend.allocate_vocab_mask(len(reqs))
        for i, req in rows:
            grammar = req.grammar
            if grammar.num_accepted != len(req.output_ids) and not grammar.sync_to(req.output_ids):
                req.to_abort = "the output no longer matches the request's grammar"
                continue
            if not grammar.is_terminated():
                grammar.fill_vocab_mask(mask, i)
        return mask

    def fulfill_grammar_masks(self, processed_bid: int) -> None:
        """Build the masks that waited for batch `processed_bid` (or an earlier one) to be processed, and hand
        them to the forward thread, which waits for them before sampling. An error goes to the forward thread too
        (it fails that batch), so it never waits for ever."""
        while self.pending_grammar_masks and self.pending_grammar_masks[0][0] <= processed_bid:
            _, reqs, future = self.pending_grammar_masks.popleft()
            try:
                future.set_result(self.build_grammar_bitmask(reqs))
            except Exception as e:
                future.set_exception(e)

    def _advance_grammar(self, req: Req, token: int) -> None:
        """Feed the sampled token (already in output_ids) to the request's matcher; a complete grammar ends it."""
        grammar = req.grammar
        if grammar.num_accepted != len(req.output_ids) - 1:
            grammar.sync_to(req.output_ids[:-1])
        if not grammar.accept_token(token):
            if any(grammar.accept_token(e) for e in sorted(req.eos_token_ids)):
                # The grammar was complete (only its end allowed) while min_new_tokens still held the end back,
                # so nothing was allowed: drop the forced token and end with the complete output.
                req.output_ids.pop()
                if req.return_logprob and len(req.output_token_logprobs) > len(req.output_ids):
                    req.output_token_logprobs.pop()
                    if len(req.output_top_logprobs) > len(req.output_ids):
                        req.output_top_logprobs.pop()
                req.finished_reason = FinishMatchedToken(None)
                return
            logger.warning("request %s: sampled token %d does not match its grammar", req.rid, token)
            req.finished_reason = FinishAbort(f"the sampled token {token} does not match the request's grammar")
        elif grammar.is_terminated():
            req.finished_reason = FinishMatchedToken(token if token in req.eos_token_ids else None)
