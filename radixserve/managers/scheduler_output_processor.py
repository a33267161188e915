"""What the scheduler does with a finished forward: append sampled tokens and logprobs, check stops, cache or
free the requests' KV, and send new tokens to the detokenizer. A mixin of Scheduler."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.managers.schedule_batch import Req
from radixserve.managers.tp_worker import GenerationBatchResult


class SchedulerOutputProcessorMixin:
    def process_batch_result(self, batch: SimpleNamespace, result: GenerationBatchResult | int) -> None:
        if not isinstance(result, GenerationBatchResult):
            result = self.worker_client.resolve_batch_result()
        logits_output, next_token_ids = result.logits_output, result.next_token_ids
        for req in batch.reqs:
            if req.pending_token is not None and req.pending_token[0] == batch.bid:
                req.pending_token = None
        next_ids = next_token_ids.tolist()
        want_lp = batch.return_logprob
        lp = logits_output.next_token_logprobs.tolist() if want_lp and logits_output.next_token_logprobs is not None \
            else None
        for i, req in enumerate(batch.reqs):
            if req is batch.chunked_req:
                continue  # a middle chunk: no token is sampled (it is cached when its next chunk is scheduled)
            if req.finished():
                continue
            if batch.forward_mode.is_extend():
                self._record_input_logprobs(req, logits_output, i)
            if req.sampling_params.max_new_tokens == 0 and not req.output_ids:
                req.finished_reason = {"type": "length", "length": 0}
            else:
                req.output_ids.append(next_ids[i])
                if req.return_logprob and lp is not None:
                    req.output_token_logprobs.append((lp[i], next_ids[i]))
                    if req.top_logprobs_num:
                        vals = logits_output.next_token_top_logprobs_val[i]
                        idx = logits_output.next_token_top_logprobs_idx[i]
                        req.output_top_logprobs.append(list(zip(_tolist(vals), _tolist(idx), strict=True)))
                if req.grammar is not None:
                    self._advance_grammar(req, next_ids[i])
                req.check_finished(self.tokenizer)
            if req.to_abort is not None and not req.finished():
                req.finished_reason = {"type": "abort", "message": req.to_abort}
            if req.finished():
                self.tree_cache.cache_finished_req(req)
            elif batch.forward_mode.is_extend() and (not batch.forward_mode.is_mixed() or i < batch.n_prefill):
                self.tree_cache.cache_unfinished_req(req)
        self.stream_output(batch.reqs)

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
        out = io.BatchTokenIDOut([], [], [], [], [], [], [], [])
        interval = self.server_args.stream_interval
        for req in reqs:
            if not req.finished() and not (req.stream and (len(req.output_ids) - req.sent_offset) >= interval):
                continue
            if req.finished() and req.sent_offset < 0:  # already sent its end
                continue
            new_ids = req.output_ids[req.sent_offset:]
            meta: dict[str, Any] = {"prompt_tokens": len(req.origin_input_ids),
                                    "completion_tokens": len(req.output_ids),
                                    "cached_tokens": req.cached_tokens}
            if req.return_logprob:
                meta["output_token_logprobs"] = req.output_token_logprobs[req.sent_logprob_offset:]
                meta["output_top_logprobs"] = req.output_top_logprobs[req.sent_logprob_offset:]
                if req.sent_logprob_offset == 0 and req.input_token_logprobs is not None:
                    meta["input_token_logprobs"] = req.input_token_logprobs
                    meta["input_top_logprobs"] = req.input_top_logprobs
                req.sent_logprob_offset = len(req.output_token_logprobs)
            out.rids.append(req.rid)
            out.new_token_ids.append(new_ids)
            out.finished_reasons.append(req.finished_reason)
            out.meta_infos.append(meta)
            sp = req.sampling_params
            out.skip_special_tokens.append(sp.skip_special_tokens)
            out.spaces_between_special_tokens.append(sp.spaces_between_special_tokens)
            out.no_stop_trim.append(sp.no_stop_trim)
            out.stop_strs.append(req.stop_strs)
            req.sent_offset = len(req.output_ids) if not req.finished() else -1
        if out.rids:
            self.send_out(out)


def _tolist(x: Any) -> list:
    return x.tolist() if hasattr(x, "tolist") else list(x)
