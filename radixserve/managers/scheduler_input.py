"""The scheduler's inbox and outbox: receiving messages (rank 0 broadcasts them under tensor parallelism), checking
and queueing generate requests, aborts, load reports to the data-parallel controller, and sending results out. A
mixin of Scheduler."""

from __future__ import annotations

import logging
from typing import Any

import zmq

from radixserve.managers import io_struct as io
from radixserve.managers.finish_reason import FinishAbort
from radixserve.managers.schedule_batch import Req

logger = logging.getLogger("radixserve.managers.scheduler")  # its log lines are the scheduler's


class SchedulerInputMixin:
    def recv_requests(self) -> list[Any]:
        """The messages that arrived since the last call. With --tp-size > 1 rank 0 receives them and broadcasts
        the list to the other ranks (over the CPU group), so that every rank runs the same batches."""
        if self.tp_size > 1 and not self.dp_attention:
            from radixserve.distributed.parallel_state import broadcast_pyobj

            return broadcast_pyobj(self._recv_from_tokenizer() if self.tp_rank == 0 else None)
        return self._recv_from_tokenizer()

    def _recv_from_tokenizer(self) -> list[Any]:
        if self.recv_from_tokenizer is None:
            return []
        self.report_load()
        out = []
        busy = (self.running_batch is not None or self.waiting_queue or self.chunked_req is not None
                or self.last_batch is not None  # a prefill that just ran becomes the running batch next
                or self.dp_peers_busy)  # DP attention: another rank waits for this one's next forward
        # requests waiting only for their grammar: poll briefly, so they start as soon as it is compiled
        # DP attention: the other ranks wait in the next step's sync while this one polls, so poll briefly
        idle_poll_ms = 20 if self.dp_attention else 1000
        if not busy and self.recv_from_tokenizer.poll(timeout=5 if self.grammar_queue else idle_poll_ms) == 0:
            return out
        while True:
            try:
                out.append(self.recv_from_tokenizer.recv_pyobj(zmq.NOBLOCK))
            except zmq.ZMQError:
                break
        self.num_generate_received += sum(isinstance(o, io.TokenizedGenerateReqInput) for o in out)
        return out

    def report_load(self) -> None:
        """Tell the data-parallel controller how many requests this replica holds, and how many it has taken in so
        far (so the controller can count the ones still on their way). Sent only when it changed."""
        if self.send_to_controller is None:
            return
        num_reqs = len(self.waiting_queue) + (len(self.running_batch.reqs) if self.running_batch else 0)
        num_reqs += (self.chunked_req is not None) + len(self.grammar_queue)
        report = (num_reqs, self.num_generate_received)
        if report != self.last_load_report:
            self.last_load_report = report
            self.send_to_controller.send_pyobj(io.SchedulerLoadReport(num_reqs=num_reqs,
                                                                      num_received=self.num_generate_received))

    def process_input_requests(self, reqs: list[Any]) -> None:
        for obj in reqs:
            try:
                if isinstance(obj, io.TokenizedGenerateReqInput):
                    self.handle_generate_request(obj)
                elif isinstance(obj, io.AbortReq):
                    self.abort_request(obj.rid, obj.message)
                elif isinstance(obj, io.FlushCacheReq):
                    self.send_out(io.FlushCacheReqOutput(success=self.flush_cache(), seq=obj.seq))
                elif isinstance(obj, io.GetInternalStateReq):
                    self.send_out(io.GetInternalStateReqOutput(state=self.get_internal_state(), seq=obj.seq))
                elif isinstance(obj, io.LoadLoRAAdapterReq):
                    self.load_lora_adapter(obj)
                elif isinstance(obj, io.UnloadLoRAAdapterReq):
                    self.lora_unloads[obj.name] = obj.seq  # done when no request uses it (finish_lora_unloads)
                else:
                    logger.error("scheduler got an unknown message %r", type(obj))
            except Exception as e:  # one bad message never takes the scheduler down
                logger.exception("error handling %s", type(obj).__name__)
                rid = getattr(obj, "rid", None)
                if rid is not None:
                    self.send_abort(rid, f"internal error: {e}")
        if self.lora_unloads:
            self.finish_lora_unloads()

    def handle_generate_request(self, recv: io.TokenizedGenerateReqInput) -> None:
        ids = recv.input_ids
        error = None
        if not ids:
            error = "the prompt is empty"
        elif len(ids) >= self.context_len + (recv.pooling is not None):  # an embedding may fill the context
            error = f"the prompt has {len(ids)} tokens; the context length is {self.context_len}"
        elif min(ids) < 0 or max(ids) >= self.vocab_size:
            error = f"token ids must be in [0, {self.vocab_size}); got one out of range"
        elif len(ids) + self.token_to_kv_pool.page_size > self.token_to_kv_pool.size:  # + a page's slack
            error = self._prompt_too_long_for_pool(len(ids))
        status = 400
        lora_error = self.check_lora_id(recv.lora_id)
        if error is None and lora_error is not None:
            error, status = lora_error, 400 if self.lora_manager is None else 404
        if error is not None:
            self.send_abort(recv.rid, error, status=status)
            return
        limit = self.server_args.max_queued_requests
        if limit is not None and len(self.waiting_queue) + len(self.grammar_queue) >= limit:
            self.send_abort(recv.rid, f"the server is overloaded: {limit} requests are waiting "
                            f"(--max-queued-requests {limit}); retry later", status=503)
            return
        sp = recv.sampling_params
        # within the context and the KV pool: a request alone always fits (its KV, with the one more token a decode
        # step in flight may write under overlap, in whole pages of a pool of whole pages), so retraction, which
        # keeps the last running request, never has to make room the pool does not have
        pool_room = self.token_to_kv_pool.size - len(ids)
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - len(ids), max(pool_room, 0))
        req = Req(recv.rid, ids, sp, eos_token_ids=self.model_config.eos_token_ids,
                  return_logprob=recv.return_logprob, logprob_start_len=recv.logprob_start_len,
                  top_logprobs_num=recv.top_logprobs_num, stream=recv.stream, lora_id=recv.lora_id)
        req.pooling = recv.pooling
        grammar = sp.grammar
        if grammar is not None:
            if self.grammar_backend is None:
                self.send_abort(recv.rid, f"{grammar[0]}: structured output is not available on this server "
                                "(no grammar backend: --grammar-backend none, --skip-tokenizer-init, or xgrammar "
                                "is not installed)", status=400)
                return
            req.grammar_future = self.grammar_backend.get_future(*grammar)
            self.grammar_queue.append(req)
            return
        self.waiting_queue.append(req)

    def _prompt_too_long_for_pool(self, prompt_len: int) -> str:
        """The error of a prompt the KV pool cannot take: admission counts a page of slack beside it (its last page
        may be partly filled), so the pool takes prompts of at most its size less one page."""
        size, page = self.token_to_kv_pool.size, self.token_to_kv_pool.page_size
        pages = f" in pages of {page}" if page > 1 else ""
        return (f"the prompt ({prompt_len} tokens) does not fit the KV pool ({size} tokens{pages}: at most "
                f"{size - page} prompt tokens)")

    def _live_reqs(self) -> list[Req]:
        reqs = [*self.waiting_queue, *self.grammar_queue]
        for b in (self.running_batch, self.last_batch):
            if b is not None:
                reqs += b.reqs
        if self.chunked_req is not None:
            reqs.append(self.chunked_req)
        for launched in self.result_queue:
            reqs += launched.reqs
        return reqs

    def abort_request(self, rid: str, message: str = "aborted") -> None:
        for i, req in enumerate(self.grammar_queue):
            if req.rid == rid:
                del self.grammar_queue[i]
                req.grammar_future = None
                req.finished_reason = FinishAbort(message)
                self.stream_output([req])
                return
        for i, req in enumerate(self.waiting_queue):
            if req.rid == rid:
                del self.waiting_queue[i]
                req.finished_reason = FinishAbort(message)
                self.stream_output([req])
                return
        # running (or being prefilled in chunks): finished at the next result processing
        candidates = list(self.running_batch.reqs) if self.running_batch else []
        if self.chunked_req is not None:
            candidates.append(self.chunked_req)
        if self.last_batch is not None:
            candidates += self.last_batch.reqs
        for req in candidates:
            if req.rid == rid and not req.finished():
                req.to_abort = message

    def send_abort(self, rid: str, message: str, status: int = 400) -> None:
        out = io.BatchTokenIDOut(rids=[rid], new_token_ids=[[]],
                                 finished_reasons=[FinishAbort(message, status).to_json()],
                                 meta_infos=[{"prompt_tokens": 0, "completion_tokens": 0, "cached_tokens": 0}],
                                 skip_special_tokens=[True], spaces_between_special_tokens=[True], no_stop_trim=[False],
                                 stop_strs=[[]])
        self.send_out(out)

    def send_out(self, obj: Any) -> None:
        if self.tp_rank != 0 and not self.dp_attention:
            return  # every rank computes the outputs; rank 0 alone sends them
        if self.send_to_controller is not None and isinstance(obj, io.FlushCacheReqOutput |
                                                              io.GetInternalStateReqOutput):
            self.send_to_controller.send_pyobj(obj)  # the DP controller merges the replicas' replies
        elif self.send_to_detokenizer is not None:
            self.send_to_detokenizer.send_pyobj(obj)
        else:
            self.outbox.append(obj)
