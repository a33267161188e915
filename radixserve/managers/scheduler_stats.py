"""What the scheduler reports about itself: its counters, the prefill/decode log lines, the memory invariant, and
the state behind /get_server_info and the tests' idle checks. A mixin of Scheduler."""

from __future__ import annotations

import logging
import os
import time
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.managers.schedule_batch import ScheduleBatch

logger = logging.getLogger("radixserve.managers.scheduler")  # the batch log lines are the scheduler's


class SchedulerStatsMixin:
    def init_stats(self) -> None:
        self.invariant_violations = 0
        self.num_retractions = 0
        self.reset_stats()

    def reset_stats(self) -> None:
        """The counters of the work done (the warm-up's is forgotten)."""
        self.forward_ct = 0
        self.cache_hit_tokens = 0
        self.prompt_tokens_total = 0
        self.last_step_time = time.monotonic()
        self._log_decode_steps = 0  # decode steps and tokens since the last decode stats line
        self._log_decode_tokens = 0
        self._log_decode_since = time.monotonic()

    def log_batch_stats(self, batch: ScheduleBatch) -> None:
        """One line per prefill batch, and one per --decode-log-interval decode steps (with the throughput)."""
        pool = self.token_to_kv_pool
        if batch.forward_mode.is_extend():
            used = pool.size - pool.available_size()
            running = len(self.running_batch.reqs) if self.running_batch is not None else 0
            prefill = batch.reqs[:batch.n_prefill]  # a MIXED batch's decodes follow its prefill requests
            new_tokens = sum(r.extend_input_len for r in prefill)
            cached = sum(len(r.prefix_indices) for r in prefill)
            mixed = f", #mixed-decode {len(batch.reqs) - len(prefill)}" if batch.forward_mode.is_mixed() else ""
            logger.info("Prefill batch: #new-seq %d, #new-token %d, #cached-token %d, token usage %.2f, "
                        "#running-req %d, #queue-req %d%s", len(prefill), new_tokens, cached, used / pool.size,
                        running, len(self.waiting_queue), mixed)
            return
        self._log_decode_steps += 1
        self._log_decode_tokens += len(batch.reqs)
        if self._log_decode_steps < self.server_args.decode_log_interval:
            return
        now = time.monotonic()
        used = pool.size - pool.available_size()
        rate = self._log_decode_tokens / max(now - self._log_decode_since, 1e-9)
        spec = ""
        if self.spec_drafter is not None:  # speculative decoding: tokens per request per verify, since the last line
            spec = f", accept len {self.spec_log_accept_length():.2f}"
        logger.info("Decode batch: #running-req %d, #token %d, token usage %.2f, gen throughput (token/s) %.1f, "
                    "#queue-req %d%s", len(batch.reqs), used, used / pool.size, rate, len(self.waiting_queue), spec)
        self._log_decode_steps, self._log_decode_tokens, self._log_decode_since = 0, 0, now

    def get_internal_state(self) -> dict[str, Any]:
        cache = self.tree_cache
        return {
            "idle": self.is_idle(),
            "memory_ok": self.check_memory() if self.is_idle() else None,
            "invariant_violations": self.invariant_violations,
            "free_tokens": self.token_to_kv_pool.available_size(),
            "evictable_tokens": cache.evictable_size(),
            "protected_tokens": cache.protected_size(),
            "max_total_num_tokens": self.token_to_kv_pool.size,
            "num_running_reqs": len(self.running_batch.reqs) if self.running_batch else 0,
            "num_waiting_reqs": len(self.waiting_queue),
            "num_grammar_queue_reqs": len(self.grammar_queue),
            **(self.grammar_backend.stats() if self.grammar_backend is not None else {}),
            "num_retractions": self.num_retractions,
            "avg_spec_accept_length": self.spec_accept_length(),
            **({"lora_adapters": sorted(self.lora_manager.adapters), "lora_slots": dict(self.lora_table.slot_of),
                "lora_slot_loads": self.lora_table.num_loads} if self.lora_table is not None else {}),
            "cache_hit_tokens": self.cache_hit_tokens,
            "prompt_tokens_total": self.prompt_tokens_total,
            "forward_ct": self.forward_ct,
            "new_token_ratio": self.new_token_ratio,
            "last_step_time": self.last_step_time,
            "pid": os.getpid(),
        }

    def check_memory(self) -> bool:
        """free + evictable + protected == pool size, and every request slot free (the draft model's pools too, once
        the finished requests' draft state is released). Logged and counted if not. Called when idle."""
        cache = self.tree_cache
        free = self.token_to_kv_pool.available_size()
        total = free + cache.evictable_size() + cache.protected_size()
        ok = total == self.token_to_kv_pool.size and cache.protected_size() == 0
        ok = ok and self.req_to_token_pool.available_size() == self.req_to_token_pool.size and cache.check_states()
        if not ok:
            self.invariant_violations += 1
            logger.error("memory leak: free=%d evictable=%d protected=%d pool=%d free_req_slots=%d/%d", free,
                         cache.evictable_size(), cache.protected_size(), self.token_to_kv_pool.size,
                         self.req_to_token_pool.available_size(), self.req_to_token_pool.size)
        return self.spec_check_draft_memory() and ok

    def scheduler_info(self) -> io.SchedulerInfo:
        mr = self.worker.model_runner
        return io.SchedulerInfo(max_total_num_tokens=self.token_to_kv_pool.size,
                                max_running_requests=self.max_running_requests, context_len=self.context_len,
                                vocab_size=self.vocab_size, device=str(self.device), dtype=str(mr.dtype),
                                attention_backend=type(mr.attn_backend).__name__)
