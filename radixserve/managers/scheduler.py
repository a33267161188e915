"""The scheduler: one process per TP rank. Receives tokenized requests, forms batches (prefill first, then decode),
runs them on the TpModelWorker, and sends new token ids to the detokenizer.

Here: the state, the loop (`step`), choosing the next batch and launching it. The rest is in mixins, one concern
each: scheduler_input (messages in and out), scheduler_prefill (prefill admission, the step token budget),
scheduler_output_processor (a forward's results), scheduler_grammar, scheduler_lora, speculative/scheduler_mixin,
scheduler_stats (counters, log lines, the memory invariant) and scheduler_warmup."""

from __future__ import annotations

import logging
import os
import signal
import threading
import time
from collections import deque
from concurrent.futures import Future
from typing import Any

import torch
import zmq
from tqdm import tqdm

from radixserve.configs.encoder import apply_encoder_args, embedding_normalize
from radixserve.configs.hybrid import apply_hybrid_args
from radixserve.configs.model_config import ModelConfig
from radixserve.lora.slots import LoRASlotTable
from radixserve.managers.schedule_batch import LaunchedBatch, Req, ScheduleBatch
from radixserve.managers.schedule_policy import SchedulePolicy
from radixserve.managers.scheduler_grammar import SchedulerGrammarMixin
from radixserve.managers.scheduler_input import SchedulerInputMixin
from radixserve.managers.scheduler_lora import SchedulerLoRAMixin
from radixserve.managers.scheduler_output_processor import SchedulerOutputProcessorMixin
from radixserve.managers.scheduler_prefill import SchedulerPrefillMixin
from radixserve.managers.scheduler_stats import SchedulerStatsMixin
from radixserve.managers.scheduler_warmup import SchedulerWarmupMixin
from radixserve.managers.tp_worker import TpModelWorker
from radixserve.managers.tp_worker_overlap_thread import TpModelWorkerClient
from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.hybrid_radix_cache import HybridRadixCache
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


class Scheduler(SchedulerInputMixin, SchedulerPrefillMixin, SchedulerOutputProcessorMixin, SchedulerGrammarMixin,
                SchedulerSpeculativeMixin, SchedulerLoRAMixin, SchedulerStatsMixin, SchedulerWarmupMixin):
    def __init__(self, server_args: ServerArgs, port_args: dict[str, str], tp_rank: int = 0, gpu_id: int = 0) -> None:
        self.server_args = server_args
        self.tp_rank = tp_rank
        self.model_config = ModelConfig(server_args.model_path, context_length=server_args.context_length,
                                        load_format=server_args.load_format,
                                        trust_remote_code=server_args.trust_remote_code)
        apply_encoder_args(server_args, self.model_config)  # an encoder: embeddings, no radix cache or chunking
        apply_hybrid_args(server_args, self.model_config)  # recurrent-state layers: the cache keeps state snapshots
        # embeddings are L2-normalised unless the model's sentence-transformers modules.json has no Normalize (and
        # never a cross-encoder's scores)
        self.embed_normalize = not server_args.is_embedding or embedding_normalize(
            self.model_config.model_path, self.model_config.architectures)
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
        self.tree_cache: BasePrefixCache
        state_pool = getattr(self.worker.model_runner, "state_pool", None)  # a hybrid model's state snapshots
        if server_args.disable_radix_cache:
            self.tree_cache = ChunkCache(self.req_to_token_pool, self.token_to_kv_pool)
        elif state_pool is not None:
            self.tree_cache = HybridRadixCache(self.req_to_token_pool, self.token_to_kv_pool, state_pool)
        else:
            self.tree_cache = RadixCache(self.req_to_token_pool, self.token_to_kv_pool)
        # LoRA: which adapter sits in which device slot (the worker holds the weights)
        self.lora_manager = self.worker.model_runner.lora_manager
        self.lora_table = LoRASlotTable(server_args.max_loras_per_batch) if self.lora_manager is not None else None
        self.lora_unloads: dict[str, int] = {}  # adapters to unload once no request uses them -> the ask's seq
        self.policy = SchedulePolicy(server_args.schedule_policy, self.tree_cache, server_args.random_seed)
        self.chunk_size = server_args.chunk_size
        # in-batch prefix sharing compares prompt heads of this many tokens (shorter on the CPU)
        on_cpu = str(self.device).startswith("cpu")
        self.in_batch_prefix_len = IN_BATCH_PREFIX_LEN_CPU if on_cpu else IN_BATCH_PREFIX_LEN
        self.step_token_budget = server_args.resolved_step_token_budget
        self.decode_turn = False  # the last step was a budgeted chunk the decodes did not join: they go next
        if self.step_token_budget:
            logger.info("step token budget: %d tokens a step (a prefill chunk and the decodes riding with it) while "
                        "requests decode", self.step_token_budget)
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
        self.init_stats()  # counters (scheduler_stats.py)

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
        scheduled; with it, after the next batch is launched (so the device never waits for the scheduler). The loop
        runs in inference mode, entered once (the forward and the sample would otherwise enter it every step)."""
        with torch.inference_mode():
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
            # At most one batch stays in flight: ScheduleBatch._pack reuses a decode's host array two steps later
            # and relies on the batch that used it having been processed by then.
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

    # ================================================================= batching
    def get_next_batch_to_run(self) -> ScheduleBatch | None:
        self.move_ready_grammar_reqs()
        last = self.last_batch
        if last is not None and last.forward_mode.is_extend():
            # the prefill that just ran (with its decode riders, if MIXED) becomes or joins the running batch,
            # minus finished and still-chunking requests and those that end with it (prefill only: max_new_tokens
            # 0, as embeddings and n > 1's shared prompt; under overlap its result is not processed yet)
            last.filter_batch([i for i, r in enumerate(last.reqs)
                               if r.finished_reason is None and r is not self.chunked_req
                               and (r.sampling_params.max_new_tokens or r.output_ids)])
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

    def update_running_batch(self, batch: ScheduleBatch) -> None:
        batch.filter_batch()  # drop requests that finished (known since the last result was processed)
        if not batch.is_empty() and not batch.check_decode_mem() and self.result_queue:
            # out of memory under overlap: settle what is in flight before deciding whom to retract
            self.flush_results()
            batch.filter_batch()
        if batch.is_empty():
            return
        if not batch.check_decode_mem():
            self.retract_chunked_req()
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

    def retract_chunked_req(self) -> None:
        """The decodes are short of memory and a prompt is being prefilled in chunks (it has decoded nothing, so it
        goes first, as retraction takes the fewest decoded tokens first): its chunks so far go into the cache, its
        memory back to the pool (the cached part stays evictable, for its next admission to match), and it waits
        at the head of the queue. Nothing of it is in flight here (the caller settled the results)."""
        req = self.chunked_req
        if req is None or self.tree_cache is None:
            return
        self.chunked_req = None
        if req.extend_input_len:  # its last chunk ran: cache it as the next round would have
            self.tree_cache.cache_unfinished_req(req)
        cached = len(req.prefix_indices)
        self.tree_cache.release_req(req)
        req.num_retractions += 1
        self.num_retractions += 1
        self.waiting_queue.insert(0, req)
        logger.info("KV cache full: the prompt being prefilled in chunks waits (%d of its %d tokens cached)", cached,
                    len(req.origin_input_ids))

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

    def flush_cache(self) -> bool:
        if not self.is_idle():
            return False
        self.tree_cache.reset()
        return True


def run_scheduler_process(server_args: ServerArgs, port_args: dict[str, str], tp_rank: int, gpu_id: int,
                          pipe_writer: Any) -> None:
    """Entry point of the scheduler process."""
    kill_itself_when_parent_died()
    signal.signal(signal.SIGINT, signal.SIG_IGN)  # the parent decides when we stop
    # tqdm's default lock holds a multiprocessing RLock, a named semaphore; this process ends by a signal, so the
    # resource tracker would report it leaked at every shutdown. Its bars (loading, graph capture) need a thread lock.
    tqdm.set_lock(threading.RLock())
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
