"""TpModelWorkerClient: runs the TpModelWorker on a forward thread so that the scheduler can prepare batch N+1
while batch N is on the device.

The scheduler calls forward_batch_generation(batch): the batch is queued and the call returns, as soon as the forward
thread has queued its forward on the device, with the future slots where its sampled ids will appear (a range: one
batch's slots are consecutive); later batches refer to those ids as -(slot). resolve_batch_result waits only for
that batch's device-to-host copy.

Waiting for the launch matters because both threads share the GIL: a forward thread woken while the scheduler runs
Python (building the next batch, processing results) would wait for the scheduler to block or for the interpreter's
switch interval (5 ms) before launching, and the device would idle meanwhile (a prefill after an idle spell, or any
eager forward). The scheduler's own work then runs while the device computes. The wait is bounded
(`LAUNCH_WAIT_S`): a forward thread still busy with an earlier batch only delays the hand-over. Only on CUDA, where
a launch returns before the work is done: on the CPU the forward computes as it is called, and waiting for it would
undo the overlap."""

from __future__ import annotations

import logging
import queue
import threading
from typing import Any

import torch

from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.managers.step_trace import StepTrace
from radixserve.managers.tp_worker import GenerationBatchResult, TpModelWorker

logger = logging.getLogger(__name__)

LAUNCH_WAIT_S = 0.05  # the longest the scheduler waits for the forward thread to launch a batch it queued


class TpModelWorkerClient:
    def __init__(self, worker: TpModelWorker) -> None:
        self.worker = worker
        self.device = worker.device
        self.max_total_num_tokens = worker.max_total_num_tokens
        self.max_running_requests = worker.max_running_requests
        self.model_runner = worker.model_runner
        self.future_size = worker.future_token_ids_map.shape[0]
        self.future_ct = 0
        self.input_queue: queue.Queue = queue.Queue()
        self.output_queue: queue.Queue = queue.Queue()
        self.launched = threading.Semaphore(0)  # released once per batch, when its forward is on the device
        self.wait_for_launch = bool(worker.model_runner.is_cuda)
        self.error: BaseException | None = None
        self.trace = StepTrace.from_env(self.wait_for_launch)  # RADIXSERVE_STEP_TRACE: one JSON line a step
        self.thread = threading.Thread(target=self._loop, daemon=True, name="radixserve-forward")
        self.thread.start()

    def get_memory_pool(self) -> tuple:
        return self.worker.get_memory_pool()

    def _alloc_future_slots(self, n: int) -> range:
        """n consecutive slots among 1..size-1 of the ring (0 is never used, so -slot is always negative)."""
        if self.future_ct + n >= self.future_size:
            self.future_ct = 0
        start = self.future_ct + 1
        self.future_ct += n
        return range(start, start + n)

    def forward_batch_generation(self, batch: ModelWorkerBatch) -> range:
        """Queue `batch`; returns its future slots (consecutive, one per request)."""
        slots = self._alloc_future_slots(len(batch.seq_lens))
        self.input_queue.put((batch, slots))
        if self.wait_for_launch:  # (a late release lets the next batch's acquire pass at once)
            self.launched.acquire(timeout=LAUNCH_WAIT_S)
        return slots

    def forward_idle(self, dp_num_tokens: list[int], all_decode: bool) -> None:
        """DP attention: queue this rank's IDLE forward behind the batches already queued (it has no result)."""
        self.input_queue.put(((dp_num_tokens, all_decode), None))

    def resolve_batch_result(self) -> GenerationBatchResult:
        """The oldest unresolved batch's result, with its tensors on the host."""
        item = self.output_queue.get()
        if isinstance(item, BaseException):
            raise item
        result, event = item
        if event is not None:
            event.synchronize()
        if self.trace is not None:
            self.trace.taken()
        return result

    def _loop(self) -> None:
        if self.worker.model_runner.is_cuda:
            torch.cuda.set_device(self.worker.model_runner.device)
        with torch.inference_mode():
            while True:
                batch, slots = self.input_queue.get()
                if batch is None:
                    return
                if isinstance(batch, tuple):  # an IDLE forward: nothing to hand back unless it fails
                    try:
                        self.worker.forward_idle(*batch)
                    except BaseException as e:  # the scheduler's next wait for a result raises it
                        logger.exception("forward thread failed")
                        self.output_queue.put(e)
                    continue
                signalled = [False]
                rec = self.trace.begin(batch) if self.trace is not None else None

                def launched(signalled: list[bool] = signalled, rec: dict | None = rec) -> None:
                    if not signalled[0] and self.wait_for_launch:
                        signalled[0] = True
                        if rec is not None:
                            self.trace.launched(rec)
                        self.launched.release()

                try:
                    result = self.worker.forward_batch_generation(batch, future_slots=slots, on_launch=launched)
                    event = self.worker.copy_result_to_host(result)
                    if rec is not None:
                        self.trace.end(rec)
                    self.output_queue.put((result, event))
                except BaseException as e:  # surfaced in the scheduler thread
                    logger.exception("forward thread failed")
                    self.output_queue.put(e)
                finally:
                    launched()

    def shutdown(self) -> None:
        self.input_queue.put((None, None))

    def __getattr__(self, name: str) -> Any:
        return getattr(self.worker, name)
