"""TpModelWorker: one tensor-parallel rank's model runner, driven by the scheduler with ModelWorkerBatches."""

from __future__ import annotations

from collections.abc import Callable
from concurrent.futures import Future
from dataclasses import dataclass
from typing import Any

import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.constrained.base_grammar_backend import bitmask_to_vocab_mask
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.model_executor.forward_batch_info import ForwardBatch
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


@dataclass
class GenerationBatchResult:
    logits_output: LogitsProcessorOutput
    next_token_ids: torch.Tensor  # on the device
    bid: int = 0


def run_model_worker_batch(runner: ModelRunner, batch: ModelWorkerBatch,
                           future_map: torch.Tensor | None = None,
                           on_launch: Callable[[], None] | None = None) -> GenerationBatchResult:
    """Apply the sampling operations, the queued request-table writes and state copies, resolve in-flight token
    ids, forward, sample and update the penalties: everything a batch does on the device, in order. `on_launch` is
    called once the forward is queued on the device (before any wait for a grammar mask)."""
    if batch.lora_loads:
        runner.lora_manager.apply_loads(batch.lora_loads)
    if batch.state_copies:
        runner.state_pool.apply(batch.state_copies)
    info = batch.sampling_info.apply(batch.sampling_ops) if batch.sampling_info is not None else None
    bitmask = batch.grammar_bitmask
    if info is not None:
        info.vocab_mask = None  # the grammar mask is of this step only
        if isinstance(bitmask, torch.Tensor):
            info.vocab_mask = _vocab_mask(bitmask, info, runner)
    forward_batch = ForwardBatch.init_new(batch, runner, sampling_info=info, future_map=future_map,
                                          req_to_token_writes=batch.req_to_token_writes)
    logits_output = runner.forward(forward_batch)
    if on_launch is not None:
        on_launch()
    if info is not None and isinstance(bitmask, Future):
        # Overlap: the scheduler builds this mask once the previous batch's tokens reached the matchers; the
        # forward above is already queued on the device while we wait. None: no row constrained any more.
        mask = bitmask.result()
        info.vocab_mask = _vocab_mask(mask, info, runner) if mask is not None else None
    if logits_output.next_token_logits is None:  # an encoder (models/bert.py): pooled rows only, nothing to sample
        next_token_ids = torch.zeros(forward_batch.batch_size, dtype=torch.int64, device=runner.device)
    else:
        next_token_ids = runner.sample(logits_output, forward_batch)
    if info is not None:
        info.vocab_mask = None  # never carried into later steps (filter/merge would drag it along)
        info.update_penalties(next_token_ids)
    return GenerationBatchResult(logits_output, next_token_ids)


def _vocab_mask(bitmask: torch.Tensor, info: Any, runner: ModelRunner) -> torch.Tensor:
    """The packed grammar bitmask as a bool [bs, vocab] mask on the device (rows line up with the batch: the
    sampling ops were replayed first)."""
    if bitmask.shape[0] != info.batch_size:
        raise ValueError(f"grammar bitmask has {bitmask.shape[0]} rows for a batch of {info.batch_size}")
    return bitmask_to_vocab_mask(bitmask, info.vocab_size, runner.device)


class TpModelWorker:
    def __init__(self, server_args: ServerArgs, model_config: ModelConfig, tp_rank: int = 0, gpu_id: int = 0) -> None:
        self.model_runner = ModelRunner(model_config, server_args, tp_rank=tp_rank, tp_size=server_args.tp_size,
                                        gpu_id=gpu_id)
        self.device = self.model_runner.device
        self.max_total_num_tokens = self.model_runner.max_total_num_tokens
        self.max_running_requests = self.model_runner.max_running_requests
        # Device table of sampled token ids that the scheduler refers to (as negative ids) before it has seen them.
        self.future_token_ids_map = self.model_runner.future_token_ids_map

    def get_memory_pool(self) -> tuple:
        return self.model_runner.req_to_token_pool, self.model_runner.token_to_kv_pool

    def forward_batch_generation(self, batch: ModelWorkerBatch, future_slots: range | torch.Tensor | None = None,
                                 on_launch: Callable[[], None] | None = None) -> GenerationBatchResult:
        """Run one batch and, under overlap, publish its sampled ids into the future map."""
        result = run_model_worker_batch(self.model_runner, batch, self.future_token_ids_map, on_launch)
        if isinstance(future_slots, range) and future_slots.step == 1:
            # consecutive slots: one slice copy on the device, no index tensor to build and upload
            self.future_token_ids_map[future_slots.start:future_slots.stop] = result.next_token_ids
        elif future_slots is not None:
            slots = future_slots.pin_memory() if self.model_runner.is_cuda else future_slots
            self.future_token_ids_map[slots.to(self.device, non_blocking=True)] = result.next_token_ids
        return result

    def forward_idle(self, dp_num_tokens: list[int], all_decode: bool) -> None:
        """DP attention: this rank's part (no tokens of its own) in a forward other ranks run."""
        from radixserve.model_executor.forward_batch_info import idle_forward_batch

        self.model_runner.forward(idle_forward_batch(self.model_runner, dp_num_tokens, all_decode))

    def copy_result_to_host(self, result: GenerationBatchResult) -> Any:
        """Start the device-to-host copies of what the scheduler reads; returns an event to wait on (or None)."""
        out = result.logits_output
        pin = self.model_runner.is_cuda

        def host(t: Any) -> Any:
            if isinstance(t, torch.Tensor):
                if not pin:
                    return t
                buf = torch.empty(t.shape, dtype=t.dtype, pin_memory=True)
                buf.copy_(t, non_blocking=True)
                return buf
            if isinstance(t, list):
                return [host(x) for x in t]
            return t

        result.next_token_ids = host(result.next_token_ids)
        out.next_token_logits = out.greedy_token_ids = None  # not needed on the host; free them early
        for name in ("next_token_logprobs", "next_token_top_logprobs_val", "next_token_top_logprobs_idx",
                     "input_token_logprobs", "input_top_logprobs_val", "input_top_logprobs_idx", "pooled_hidden"):
            setattr(out, name, host(getattr(out, name)))
        if pin:
            event = torch.cuda.Event()
            event.record()
            return event
        return None
