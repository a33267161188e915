"""What the scheduler does with a finished forward: append sampled tokens and logprobs, check stops, cache or
free the requests' KV, and send new tokens to the detokenizer. A mixin of Scheduler."""

from __future__ import annotations

import time
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.managers.finish_reason import FinishAbort, FinishLength, FinishMatchedToken
from radixserve.managers.schedule_batch import LaunchedBatch, Req


class SchedulerOutputProcessorMixin:
    def process_batch_result(self, batch: LaunchedBatch) -> None:
        try:
            self._process_batch_result(batch)
        finally:
            if self.pending_grammar_masks:  # masks of the next batch waited for these tokens
                self.fulfill_grammar_masks(batch.bid)

    def _process_batch_result(self, batch: LaunchedBatch) -> None:
        if batch.forward_mode.is_target_verify():
            self.process_spec_result(batch)  # speculative decoding (radixserve/speculative/)
            return
        result = batch.result
        if result is None:  # overlap: the forward thread's results come back in launch order
            result = self.worker_client.resolve_batch_result()
        logits_output, next_token_ids = result.logits_output, result.next_token_ids
        bid = batch.bid
        for req in batch.reqs:
            pending = req.pending_token
            if pending is not None and pending[0] == bid:
                req.pending_token = None
        next_ids = next_token_ids.tolist()
        want_lp = batch.return_logprob
        lp = logits_output.next_token_logprobs.tolist() if want_lp and logits_output.next_token_logprobs is not None \
            else None
        # loop invariants hoisted: this loop runs once per request per step
        mode = batch.forward_mode
        extend = mode.is_extend()
        mixed = mode.is_mixed()
        n_prefill = batch.n_prefill
        chunked_req = batch.chunked_req
        tokenizer = self.tokenizer
        tree_cache = self.tree_cache
        now = time.time() if extend else 0.0
        for i, req in enumerate(batch.reqs):
            if req is chunked_req:
                if req.pooling is not None:
                    self._add_pooled(req, logits_output, i)
                continue  # a middle chunk: no token is sampled (it is cached when its next chunk is scheduled)
            if req.finished_reason is not None:  # req.finished()
                continue
            if extend and (not mixed or i < n_prefill):  # (a decode riding along has no prompt logprobs)
                self._record_input_logprobs(req, logits_output, i)
                if req.time_first_token is None:  # the first token comes out of an extend (the last chunk)
                    req.time_first_token = now
            if req.sampling_params.max_new_tokens == 0 and not req.output_ids:
                req.finished_reason = FinishLength(0)
                if req.pooling is not None and extend and req.to_abort is None:
                    self._add_pooled(req, logits_output, i)
                    pooled = req.pool_sum / max(1, req.pool_count)
                    req.embedding = _normalized(pooled) if self.embed_normalize else pooled.tolist()
                    req.finished_reason = FinishMatchedToken(None)
            else:
                tok = next_ids[i]
                req.output_ids.append(tok)
                if lp is not None and req.return_logprob:
                    req.output_token_logprobs.append((lp[i], tok))
                    if req.top_logprobs_num:
                        vals = logits_output.next_token_top_logprobs_val[i]
                        idx = logits_output.next_token_top_logprobs_idx[i]
                        req.output_top_logprobs.append(list(zip(_tolist(vals), _tolist(idx), strict=True)))
                if req.grammar is not None:
                    self._advance_grammar(req, tok)
                req.check_finished(tokenizer)
            if req.to_abort is not None and req.finished_reason is None:
                req.finished_reason = FinishAbort(req.to_abort)
            if req.finished_reason is not None:
                tree_cache.cache_finished_req(req)
            elif extend and (not mixed or i < n_prefill):
                tree_cache.cache_unfinished_req(req)
        self.stream_output(batch.reqs)

    @staticmethod
    def _add_pooled(req: Req, logits_output: Any, i: int) -> None:
        """An embedding request's share of this forward: a mean adds up its chunks' sums (over all prompt tokens:
        a mean-pooled request never takes a cached prefix); "last" / "cls" keep the one token's hidden state."""
        row = logits_output.pooled_hidden[i].float()
        if req.pooling == "mean":
            req.pool_sum = row if req.pool_sum is None else req.pool_sum + row
            req.pool_count = len(req.origin_input_ids)
        else:
            req.pool_sum, req.pool_count = row, 1

    def _record_input_logprobs(self, req: Req, logits_output: Any, i: int) -> None:
        vals = logits_output.input_token_logprobs
        if vals is None or i >= len(vals) or vals[i] is None:
            return
        start = req.logprob_start_len
        ids = req.origin_input_ids
        lps = _tolist(vals[i])
        # the first token at logprob_start_len has no logprob (nothing precedes it within the computed range)
        entries: list[tuple[float | None, int]] = [(None, ids[start])] if start < len(ids) else []
        entries += [(v, ids[start + 1 + j]) for j, v in enumerate(lps)]
        req.input_token_logprobs = entries
        if req.top_logprobs_num and logits_output.input_top_logprobs_val[i] is not None:
            tv = _tolist(logits_output.input_top_logprobs_val[i])
            ti = _tolist(logits_output.input_top_logprobs_idx[i])
            req.input_top_logprobs = [None] + [list(zip(a, b, strict=True)) for a, b in zip(tv, ti, strict=True)]

    # ================================================================= output
    def stream_output(self, reqs: list[Req]) -> None:
        interval = self.server_args.stream_interval
        rids: list[str] = []
        new_token_ids: list[list[int]] = []
        finished_reasons: list[dict[str, Any] | None] = []
        meta_infos: list[dict[str, Any]] = []
        skip_special_tokens: list[bool] = []
        spaces_between_special_tokens: list[bool] = []
        no_stop_trim: list[bool] = []
        stop_strs: list[list[str]] = []
        for req in reqs:
            finished_reason = req.finished_reason
            output_ids = req.output_ids
            sent = req.sent_offset
            if finished_reason is None:
                if not (req.stream and (len(output_ids) - sent) >= interval):
                    continue
            elif sent < 0:  # already sent its end
                continue
            meta: dict[str, Any] = {"prompt_tokens": len(req.origin_input_ids),
                                    "completion_tokens": len(output_ids),
                                    "cached_tokens": req.cached_tokens}
            if sent == 0 and req.time_first_token is not None:  # its first output: the stages of its TTFT
                meta["_timing"] = (req.time_recv, req.time_prefill, req.time_first_token)
            if req.embedding is not None:
                meta["embedding"] = req.embedding
            if req.spec_verify_ct:  # speculative decoding: verify steps and mean tokens committed per step
                meta["spec_verify_ct"] = req.spec_verify_ct
                meta["spec_accept_length"] = req.spec_tokens / req.spec_verify_ct
            if req.return_logprob:
                meta["output_token_logprobs"] = req.output_token_logprobs[req.sent_logprob_offset:]
                meta["output_top_logprobs"] = req.output_top_logprobs[req.sent_logprob_offset:]
                if req.sent_logprob_offset == 0 and req.input_token_logprobs is not None:
                    meta["input_token_logprobs"] = req.input_token_logprobs
                    meta["input_top_logprobs"] = req.input_top_logprobs
                req.sent_logprob_offset = len(req.output_token_logprobs)
            rids.append(req.rid)
            new_token_ids.append(output_ids[sent:])
            finished_reasons.append(None if finished_reason is None else finished_reason.to_json())
            meta_infos.append(meta)
            sp = req.sampling_params
            skip_special_tokens.append(sp.skip_special_tokens)
            spaces_between_special_tokens.append(sp.spaces_between_special_tokens)
            no_stop_trim.append(sp.no_stop_trim)
            stop_strs.append(req.stop_strs)
            req.sent_offset = len(output_ids) if finished_reason is None else -1
        if rids:
            self.send_out(io.BatchTokenIDOut(rids, new_token_ids, finished_reasons, meta_infos, skip_special_tokens,
                                             spaces_between_special_tokens, no_stop_trim, stop_strs))


def _normalized(v: Any) -> list[float]:
    """The L2-normalised vector as a list of floats."""
    norm = float(v.norm())
    return (v / norm if norm > 0 else v).tolist()


def _tolist(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)
