"""The scheduler: one process per TP rank. Receives tokenized requests, forms batches (prefill first, then decode),
runs them on the TpModelWorker, and sends new token ids to the detokenizer."""

from __future__ import annotations

import logging
import os
import signal
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch
import zmq

from radixserve.configs.model_config import ModelConfig
from radixserve.lora.slots import LoRASlotTable
from radixserve.managers import io_struct as io
from radixserve.managers.finish_reason import FinishAbort
from radixserve.managers.schedule_batch import LaunchedBatch, Req, ScheduleBatch
from radixserve.managers.schedule_policy import PrefillAdder, SchedulePolicy, latency_step_budget
from radixserve.managers.scheduler_grammar import SchedulerGrammarMixin
from radixserve.managers.scheduler_lora import SchedulerLoRAMixin
from radixserve.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from radixserve.managers.scheduler_stats import SchedulerStatsMixin
from radixserve.managers.scheduler_warmup import SchedulerWarmupMixin
from radixserve.managers.tp_worker import TpModelWorker
from radixserve.managers.tp_worker_overlap_thread import TpModelWorkerClient
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.server_args import ServerArgs
from radixserve.speculative.scheduler_mixin import SchedulerSpeculativeMixin
from radixserve.utils import get_zmq_socket, kill_itself_when_parent_died

logger = logging.getLogger(__name__)

INIT_NEW_TOKEN_RATIO = 0.7
MIN_NEW_TOKEN_RATIO = 0.1
IN_BATCH_PREFIX_LEN = 32  # prompt head length compared for in-batch prefix sharing
# On the CPU a prompt token costs about a millisecond of prefill (SmolLM2-135M, 2 cores), so a shorter shared head
# is worth the round a deferred request waits: a chat template's system prompt (24 tokens for SmolLM2's) qualifies.
IN_BATCH_PREFIX_LEN_CPU = 16
NEW_TOKEN_RATIO_DECAY = 0.001


class Scheduler(SchedulerGrammarMixin, SchedulerOutputProcessorMixin, SchedulerWarmupMixin, SchedulerSpeculativeMixin,
                SchedulerLoRAMixin, SchedulerStatsMixin):
    def __init__(self, server_args: ServerArgs, port_args: dict[str, str], tp_rank: int = 0, gpu_id: int = 0) -> None:
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.model_config = ModelConfig(server_args.model_path, context_length=server_args.context_length,
                                        load_format=server_args.load_format,
                                        trust_remote_code=server_args.trust_remote_code)
        self.worker = TpModelWorker(server_args, self.model_config, tp_rank=tp_rank, gpu_id=gpu_id)
        self.enable_overlap = server_args.use_overlap
        self.worker_client = TpModelWorkerClient(self.worker) if self.enable_overlap else None
        self.result_queue: deque[LaunchedBatch] = deque()  # launched, results not processed yet
        # (bid of the batch whose results the mask waits for, the batch's requests, the mask's future)
        self.pending_grammar_masks: deque[tuple[int, list[Req], Future]] = deque()
        self.device = self.worker.device
        self.req_to_token_pool, self.token_to_kv_pool = self.worker.get_memory_pool()
        self.max_running_requests = self.worker.max_running_requests
        self.vocab_size = self.model_config.vocab_size
        self.context_len = self.model_config.context_len
        cache_cls = ChunkCache if server_args.disable_radix_cache else RadixCache
        self.tree_cache: BasePrefixCache = cache_cls(self.req_to_token_pool, self.token_to_kv_pool)
        # LoRA: which adapter sits in which device slot (the worker holds the weights)
        self.lora_manager = self.worker.model_runner.lora_manager
        self.lora_table = LoRASlotTable(server_args.max_loras_per_batch) if self.lora_manager is not None else None
        self.lora_unloads: list[str] = []  # adapters to unload once no request uses them
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, server_args.random_seed)
        self.chunk_size = server_args.chunk_size
        self.step_token_budget = server_args.resolved_step_token_budget
        self.decode_turn = False  # the last step was a budgeted prefill chunk: the running decodes go next
        if self.step_token_budget:
            logger.info("step token budget: %d tokens a prefill chunk while requests decode", self.step_token_budget)
        self.tokenizer = None
        if not server_args.skip_tokenizer_init:
            from radixserve.managers.tokenizer_utils import get_tokenizer

            self.tokenizer = get_tokenizer(server_args.tokenizer_path or self.model_config.tokenizer_path,
                                           trust_remote_code=server_args.trust_remote_code)
        # structured output: constrained requests wait in grammar_queue until their grammar is compiled
        self.grammar_backend: Any = None
        if server_args.grammar_backend != "none" and self.tokenizer is not None:
            from radixserve.constrained import create_grammar_backend

            try:
                self.grammar_backend = create_grammar_backend(server_args, self.tokenizer, self.vocab_size,
                                                              eos_token_ids=self.model_config.eos_token_ids)
            except Exception as e:  # the server still serves everything else
                logger.warning("structured output is off: the grammar backend failed to start: %s: %s",
                               type(e).__name__, e)
        self.grammar_queue: list[Req] = []

        self.waiting_queue: list[Req] = []
        self.running_batch: ScheduleBatch | None = None
        self.last_batch: ScheduleBatch | None = None
        self.chunked_req: Req | None = None
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * server_args.schedule_conservativeness
        self.forward_ct = 0
        self.invariant_violations = 0
        self.num_retractions = 0
        self.cache_hit_tokens = 0
        self.prompt_tokens_total = 0
        self.last_step_time = time.monotonic()
        self._log_decode_steps = 0  # decode steps and tokens since the last decode stats line
        self._log_decode_tokens = 0
        self._log_decode_since = time.monotonic()

        self.init_speculative()  # --speculative-algorithm (radixserve/speculative/scheduler_mixin.py)
        self.outbox: list[Any] = []  # messages kept in-process when there is no detokenizer socket (tests)
        self.recv_from_tokenizer = None
        self.send_to_detokenizer = None
        # tensor parallelism: rank 0 receives and broadcasts to the other ranks, which run the same batches
        self.tp_size = server_args.tp_size
        # DP attention: every rank receives, schedules and answers its own requests (the DP controller routes them)
        # and the ranks sync once a step so that all of them run a forward (IDLE when they have nothing) or none
        self.dp_attention = server_args.enable_dp_attention
        self.dp_peers_busy = False
        # data parallelism: control replies and load reports go to the controller (when it set this socket)
        self.send_to_controller = None
        self.num_generate_received = 0
        self.last_load_report: tuple[int, int] | None = None
        if (tp_rank == 0 or self.dp_attention) and port_args:
            ctx = zmq.Context(2)
            self.recv_from_tokenizer = get_zmq_socket(ctx, zmq.PULL, port_args["scheduler_input"], bind=True)
            self.send_to_detokenizer = get_zmq_socket(ctx, zmq.PUSH, port_args["detokenizer_input"], bind=False)
            if port_args.get("controller_input"):
                self.send_to_controller = get_zmq_socket(ctx, zmq.PUSH, port_args["controller_input"], bind=False)

    # ================================================================= the loop
    def event_loop(self) -> None:
        """receive → step, forever. Without overlap each batch's results are processed before the next batch is
        scheduled; with it, after the next batch is launched (so the device never waits for the scheduler)."""
        while True:
            self.process_input_requests(self.recv_requests())
            if not self.step():
                self.on_idle()

    def step(self) -> bool:
        """One iteration of the loop after receiving: schedule a batch, launch it, process results (under overlap
        the previous batch's, the tokens still in flight being referred to by future ids). The event loop, the
        warm-up, the benchmarks and the tests all run this. False when there was nothing to run."""
        batch = self.get_next_batch_to_run()
        if self.dp_attention and not self.dp_attention_sync(batch):
            self.flush_results()
            self.last_batch = None
            return True  # an IDLE forward ran: other ranks had work
        if batch is not None:
            self.result_queue.append(self.run_batch(batch))
            if not self.enable_overlap or len(self.result_queue) > 1:
                self.process_batch_result(self.result_queue.popleft())
        else:
            self.flush_results()
        self.last_batch = batch
        return batch is not None

    def dp_attention_sync(self, batch: ScheduleBatch | None) -> bool:
        """DP attention: tell every rank how many tokens this rank's next forward has; returns False when this rank
        has none and ran an IDLE forward (others had work), True otherwise (`batch` knows every rank's count)."""
        from radixserve.distributed.parallel_state import all_gather_ints

        mine = [0, 1] if batch is None else [int(batch.input_ids.numel()), int(batch.forward_mode.is_decode())]
        everyone = all_gather_ints(mine)
        counts = [n for n, _ in everyone]
        all_decode = all(d for _, d in everyone)  # decode or idle everywhere: the ranks may replay a CUDA graph
        self.dp_peers_busy = any(counts)
        if batch is not None:
            batch.dp_num_tokens, batch.dp_all_decode = counts, all_decode
            return True
        if not self.dp_peers_busy:
            return True  # nobody has work: no forward anywhere
        (self.worker_client or self.worker).forward_idle(counts, all_decode)
        return False

    def flush_results(self) -> None:
        while self.result_queue:
            self.process_batch_result(self.result_queue.popleft())

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

    # ================================================================= requests
    def process_input_requests(self, reqs: list[Any]) -> None:
        for obj in reqs:
            try:
                if isinstance(obj, io.TokenizedGenerateReqInput):
                    self.handle_generate_request(obj)
                elif isinstance(obj, io.AbortReq):
                    self.abort_request(obj.rid, obj.message)
                elif isinstance(obj, io.FlushCacheReq):
                    self.send_out(io.FlushCacheReqOutput(success=self.flush_cache()))
                elif isinstance(obj, io.GetInternalStateReq):
                    self.send_out(io.GetInternalStateReqOutput(state=self.get_internal_state()))
                elif isinstance(obj, io.LoadLoRAAdapterReq):
                    self.load_lora_adapter(obj)
                elif isinstance(obj, io.UnloadLoRAAdapterReq):
                    self.lora_unloads.append(obj.name)  # done when no request uses it (finish_lora_unloads)
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
        elif len(ids) >= self.context_len:
            error = f"the prompt has {len(ids)} tokens, at least the context length {self.context_len}"
        elif min(ids) < 0 or max(ids) >= self.vocab_size:
            error = f"token ids must be in [0, {self.vocab_size}); got one out of range"
        elif len(ids) + self.token_to_kv_pool.page_size > self.token_to_kv_pool.size:  # + a page's slack
            error = f"the prompt ({len(ids)} tokens) does not fit the KV pool ({self.token_to_kv_pool.size} tokens)"
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
        sp.max_new_tokens = min(sp.max_new_tokens, self.context_len - len(ids))
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

    # ================================================================= batching
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        self.move_ready_grammar_reqs()
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            # the prefill that just ran (with its decode riders, if MIXED) becomes or joins the running batch,
            # minus finished and still-chunking requests
            last.filter_batch(chunked_req=self.chunked_req)
            if not last.is_empty():
                last.forward_mode = ForwardMode.DECODE
                if self.running_batch is None or self.running_batch.is_empty():
                    self.running_batch = last
                else:
                    self.running_batch.merge_batch(last)
            self.last_batch = None
        if self.running_batch is not None:
            self.running_batch.filter_batch()  # requests whose finish is already known
        decoding = self.running_batch is not None and not self.running_batch.is_empty()
        # after a budgeted chunk the running decodes step before the next chunk (the step token budget's pacing)
        new_batch = None if self.decode_turn and decoding else self.get_new_batch_prefill()
        if new_batch is not None:
            return new_batch
        self.decode_turn = False
        if not decoding:
            self.running_batch = None
            return None
        self.update_running_batch(self.running_batch)
        if self.running_batch.is_empty():
            self.running_batch = None
            return None
        return self.running_batch

    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        running = self.running_batch.reqs if self.running_batch is not None else []
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if len(running) >= self.max_running_requests and self.chunked_req is None:
            return None
        # a step that keeps the decodes' pace: they ride with a prefill chunk cut to the step's token budget
        budget = latency_step_budget(self.step_token_budget, len(running), self.waiting_queue, self.chunk_size)
        mixed = self.server_args.enable_mixed_chunk and bool(running)
        max_prefill, chunk = self.server_args.max_prefill_tokens, self.chunk_size
        if budget is not None:
            max_prefill, chunk = min(max_prefill, budget), min(chunk or budget, budget)
        adder = PrefillAdder(self.tree_cache, self.token_to_kv_pool, running, self.new_token_ratio, max_prefill,
                             chunk, mixed_decode_tokens=len(running) if mixed else 0)
        if self.chunked_req is not None and self.chunked_req.to_abort is not None:
            req, self.chunked_req = self.chunked_req, None
            req.finished_reason = FinishAbort(req.to_abort)
            self.tree_cache.cache_finished_req(req)
            self.stream_output([req])
        if self.chunked_req is not None:
            # the chunk that just ran (or is running) goes into the cache and becomes this request's prefix;
            # only CPU state is touched, so this need not wait for the device
            self.tree_cache.cache_unfinished_req(self.chunked_req)
            # the part already prefilled sits in the tree (or the chunk cache) as this request's prefix
            self.chunked_req.fill_ids = self.chunked_req.origin_input_ids + self.chunked_req.output_ids
            self.chunked_req.extend_input_len = len(self.chunked_req.fill_ids) - len(self.chunked_req.prefix_indices)
            self.chunked_req = adder.add_chunked_req(self.chunked_req)
        # ordered after the chunk above went into the cache; a prefix-aware order matches every waiting request
        prefix_matched = self.policy.calc_priority(self.waiting_queue)
        slots_left = self.max_running_requests - len(running) - len(adder.can_run)
        admitted = []
        uncached_heads: set[tuple] = set()  # (adapter, *prompt head)s this batch will put into the cache
        sharing = self.tree_cache.shares_prefixes
        head_len = IN_BATCH_PREFIX_LEN_CPU if str(self.device).startswith("cpu") else IN_BATCH_PREFIX_LEN
        loras = None  # LoRA: the distinct adapters of the batch must fit the device slots
        if self.lora_table is not None:
            loras = {r.lora_id for r in [*running, *adder.can_run] if r.lora_id is not None}
        for req in self.waiting_queue:
            if slots_left <= 0 or not adder.budget_left() or adder.new_chunked_req is not None:
                break
            if loras is not None and req.lora_id is not None and req.lora_id not in loras \
                    and len(loras) >= self.lora_table.num_slots:
                continue
            # A match from an earlier round may point at KV that an eviction freed since: match again unless this
            # round's ordering just did (and never lock a node no longer in the tree).
            if not prefix_matched or not self.tree_cache.is_attached(req.last_node):
                req.init_next_round_input(self.tree_cache)
            if sharing and len(req.prefix_indices) < head_len <= len(req.fill_ids):
                # In-batch prefix sharing: a request whose uncached head repeats one already admitted this round
                # waits one round, and then finds that head in the cache instead of computing it again.
                head = (req.lora_id, *req.fill_ids[:head_len])
                if head in uncached_heads:
                    continue
                uncached_heads.add(head)
            if not adder.add_one_req(req):
                break
            admitted.append(req)
            slots_left -= 1
            if loras is not None and req.lora_id is not None:
                loras.add(req.lora_id)
        if adder.new_chunked_req is not None:
            self.chunked_req = adder.new_chunked_req
        if not adder.can_run:
            return None
        ids = {id(r) for r in admitted}
        self.waiting_queue = [r for r in self.waiting_queue if id(r) not in ids]
        batch = ScheduleBatch(adder.can_run, self.req_to_token_pool, self.token_to_kv_pool, self.tree_cache,
                              self.device, self.vocab_size)
        batch.lora_table = self.lora_table
        batch.prepare_for_extend()
        for r in admitted:
            self.prompt_tokens_total += len(r.origin_input_ids)
            self.cache_hit_tokens += len(r.prefix_indices)
        if mixed and self.running_batch is not None and not self.running_batch.is_empty():
            if self.running_batch.check_decode_mem():
                batch.mix_with_running(self.running_batch)
                self.running_batch = None
        # a budgeted chunk while requests decode: they step next, before any further prefill
        self.decode_turn = budget is not None and self.running_batch is not None and not self.running_batch.is_empty()
        return batch

    def update_running_batch(self, batch: ScheduleBatch) -> None:
        batch.filter_batch()  # drop requests that finished (known since the last result was processed)
        if not batch.is_empty() and not batch.check_decode_mem() and self.result_queue:
            # out of memory under overlap: settle what is in flight before deciding whom to retract
            self.flush_results()
            batch.filter_batch()
        if batch.is_empty():
            return
        if not batch.check_decode_mem():
            retracted, ratio = batch.retract_decode()
            self.new_token_ratio = max(self.new_token_ratio, ratio)
            self.num_retractions += len(retracted)
            logger.info("KV cache full: retracted %d request(s); new_token_ratio=%.3f", len(retracted),
                        self.new_token_ratio)
            self.waiting_queue = retracted + self.waiting_queue
        else:
            self.new_token_ratio = max(self.new_token_ratio - NEW_TOKEN_RATIO_DECAY,
                                       MIN_NEW_TOKEN_RATIO * self.server_args.schedule_conservativeness)
        if not batch.is_empty():
            batch.prepare_for_decode()

    # ================================================================= running
    def run_batch(self, batch: ScheduleBatch) -> LaunchedBatch:
        """Launch `batch`; returns what its results will be processed against (with the result itself, unless
        under overlap)."""
        if self.spec_drafter is not None and batch.forward_mode.is_decode():
            spec = self.run_spec_batch(batch)  # a verify step, or None: nobody drafted, a plain decode
            if spec is not None:
                return spec
        self.forward_ct += 1
        self.last_step_time = time.monotonic()
        bid = self.forward_ct
        if self.tp_rank == 0 and logger.isEnabledFor(logging.INFO):
            self.log_batch_stats(batch)
        mwb = batch.get_model_worker_batch()
        mwb.dp_num_tokens, mwb.dp_all_decode = batch.dp_num_tokens, batch.dp_all_decode
        reqs = batch.reqs
        chunked_req = self.chunked_req
        view = LaunchedBatch(bid=bid, reqs=list(reqs), forward_mode=batch.forward_mode, n_prefill=batch.n_prefill,
                             return_logprob=mwb.return_logprob,
                             chunked_req=chunked_req if chunked_req is not None and chunked_req in reqs else None)
        if self.grammar_backend is not None and any(r.grammar is not None for r in reqs):
            if self.result_queue and any(r.grammar is not None and r.pending_token is not None for r in reqs):
                # Overlap: this step's mask needs the tokens still in flight accepted by the matchers first. The
                # mask is needed only at sampling, after this batch's forward, so launch now and hand it over when
                # the batch in flight has been processed (`fulfill_grammar_masks`); the device keeps working.
                mwb.grammar_bitmask = Future()
                self.pending_grammar_masks.append((self.result_queue[-1].bid, view.reqs, mwb.grammar_bitmask))
            else:
                mwb.grammar_bitmask = self.build_grammar_bitmask(reqs)
        if self.worker_client is None:
            view.result = self.worker.forward_batch_generation(mwb)
            return view
        slots = self.worker_client.forward_batch_generation(mwb)  # a range of future slots
        for req, slot in zip(reqs, slots, strict=True):
            if req is not chunked_req and req.finished_reason is None:  # not req.finished()
                req.pending_token = (bid, slot)
        return view

    # ================================================================= idle, state, cache
    def on_idle(self) -> None:
        if self.is_idle():
            self.check_memory()
        self.new_token_ratio = INIT_NEW_TOKEN_RATIO * self.server_args.schedule_conservativeness

    def is_idle(self) -> bool:
        def empty(b: ScheduleBatch | None) -> bool:
            return b is None or all(r.finished() for r in b.reqs)

        return not self.waiting_queue and self.chunked_req is None and empty(self.running_batch) \
            and empty(self.last_batch) and not self.result_queue and not self.grammar_queue

    def check_memory(self) -> bool:
        """free + evictable + protected == pool size, and every request slot free. Logged and counted if not."""
        cache = self.tree_cache
        free = self.token_to_kv_pool.available_size()
        total = free + cache.evictable_size() + cache.protected_size()
        ok = total == self.token_to_kv_pool.size and cache.protected_size() == 0
        ok = ok and self.req_to_token_pool.available_size() == self.req_to_token_pool.size
        if not ok:
            self.invariant_violations += 1
            logger.error("memory leak: free=%d evictable=%d protected=%d pool=%d free_req_slots=%d/%d", free,
                         cache.evictable_size(), cache.protected_size(), self.token_to_kv_pool.size,
                         self.req_to_token_pool.available_size(), self.req_to_token_pool.size)
        return ok

    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        self.tree_cache.reset()
        return True

    def scheduler_info(self) -> io.SchedulerInfo:
        mr = self.worker.model_runner
        return io.SchedulerInfo(max_total_num_tokens=self.token_to_kv_pool.size,
                                max_running_requests=self.max_running_requests, context_len=self.context_len,
                                vocab_size=self.vocab_size, device=str(self.device), dtype=str(mr.dtype),
                                attention_backend=type(mr.attn_backend).__name__)


def run_scheduler_process(server_args: ServerArgs, port_args: dict[str, str], tp_rank: int, gpu_id: int,
                          pipe_writer: Any) -> None:
    """Entry point of the scheduler process."""
    kill_itself_when_parent_died()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    logging.basicConfig(level=server_args.log_level.upper(),
                        format=f"[%(asctime)s scheduler TP{tp_rank}] %(levelname)s %(message)s")
    try:
        scheduler = Scheduler(server_args, port_args, tp_rank, gpu_id)
        if scheduler.device != "cpu" and not server_args.skip_server_warmup:
            t0 = time.monotonic()
            scheduler.warmup()
            logger.info("warm-up done in %.1f s", time.monotonic() - t0)
        pipe_writer.send({"status": "ready", "info": scheduler.scheduler_info()})
    except Exception as e:
        logger.exception("scheduler failed to start")
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    try:
        scheduler.event_loop()
    except Exception as e:
        # With TP a collective fails when another rank died (at once) or hangs (after --dist-timeout): exit, so
        # that the engine sees a dead process (/health 503) and the other ranks' collectives fail in turn.
        if server_args.tp_size > 1 and _is_collective_error(e):
            logger.critical("TP rank %d of %d is exiting: another TP rank died or hung for more than --dist-timeout "
                            "%g s (%s: %s)", tp_rank, server_args.tp_size, server_args.dist_timeout,
                            type(e).__name__, e)
        elif server_args.tp_size > 1:
            logger.critical("TP rank %d of %d is exiting on an error: %s: %s", tp_rank, server_args.tp_size,
                            type(e).__name__, e, exc_info=True)
        else:
            logger.critical("the scheduler is exiting: %s: %s", type(e).__name__, e, exc_info=True)
        logging.shutdown()
        os._exit(1)


def _is_collective_error(e: BaseException) -> bool:
    if isinstance(e, getattr(torch.distributed, "DistError", ())):
        return True
    text = str(e)
    return any(k in text for k in ("Connection closed by peer", "Connection reset", "Timed out", "timed out",
                                   "NCCL", "gloo"))
