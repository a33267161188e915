"""Prefill admission: which waiting requests (and which chunk of a request prefilled in chunks) the next prefill
batch takes, under the token budgets, the memory left, the request slots and the LoRA slots. With
--step-token-budget, while requests decode, the step holds at most the budget's tokens, the running decodes
included: they ride with the chunk (MIXED), so every decode advances at every step; should they not fit in memory
alongside it, they step on their own right after the chunk (`decode_turn`). A mixin of Scheduler."""

from __future__ import annotations

from radixserve.managers.finish_reason import FinishAbort
from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.managers.schedule_policy import PrefillAdder, latency_step_budget
from radixserve.mem_cache.radix_cache import _match_len


class SchedulerPrefillMixin:
    def get_new_batch_prefill(self) -> ScheduleBatch | None:
        running = self.running_batch.reqs if self.running_batch is not None else []
        if not self.waiting_queue and self.chunked_req is None:
            return None
        if len(running) >= self.max_running_requests and self.chunked_req is None:
            return None
        # a step that keeps the decodes' pace: they ride with a prefill chunk, the two within the step's token budget
        budget = latency_step_budget(self.step_token_budget, len(running), self.waiting_queue, self.chunk_size)
        mixed = (self.server_args.enable_mixed_chunk or budget is not None) and bool(running)
        max_prefill, chunk = self.server_args.max_prefill_tokens, self.chunk_size
        if budget is not None:
            max_prefill, chunk = min(max_prefill, budget), min(chunk or budget, budget)
        adder = PrefillAdder(self.tree_cache, self.token_to_kv_pool, running, self.new_token_ratio, max_prefill,
                             chunk, mixed_decode_tokens=len(running) if mixed else 0)
        self._continue_chunked_req(adder)
        admitted = self._admit_waiting(adder, running)
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
            if not r.num_retractions:  # (a retracted request admitted again was counted the first time)
                self.prompt_tokens_total += len(r.origin_input_ids)
                self.cache_hit_tokens += len(r.prefix_indices)
        if mixed and self.running_batch is not None and not self.running_batch.is_empty():
            if self.running_batch.check_decode_mem():
                batch.mix_with_running(self.running_batch)
                self.running_batch = None
        # a budgeted chunk that the running decodes could not join: they step next, before any further prefill
        self.decode_turn = budget is not None and self.running_batch is not None and not self.running_batch.is_empty()
        return batch

    def _continue_chunked_req(self, adder: PrefillAdder) -> None:
        """The request being prefilled in chunks: finish it if it was aborted, else put its next chunk first."""
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

    def _admit_waiting(self, adder: PrefillAdder, running: list[Req]) -> list[Req]:
        """Add waiting requests to `adder` in the policy's order while the budgets and slots last; returns the ones
        admitted (a request whose uncached prompt head repeats one admitted this round waits one round)."""
        # ordered after the chunk above went into the cache; a prefix-aware order matches every waiting request
        prefix_matched = self.policy.calc_priority(self.waiting_queue)
        slots_left = self.max_running_requests - len(running) - len(adder.can_run)
        # Under overlap a prefill-only request (max_new_tokens 0: n > 1's shared prompt, an embedding) leaves the
        # batch before its result is processed, and its request slot comes back only then: count the free slots too.
        free_slots = self.req_to_token_pool.available_size() - sum(r.req_pool_idx is None for r in adder.can_run)
        slots_left = min(slots_left, free_slots)
        admitted = []
        sharing = self.tree_cache.shares_prefixes
        head_len = self.in_batch_prefix_len
        # (adapter, *prompt head)s this batch, or the prefill still in flight (owner None), will put into the
        # cache -> the request admitted with it this round
        owners: dict[tuple, Req | None] = dict.fromkeys(self._heads_in_flight(head_len)) if sharing else {}
        loras = None  # LoRA: the distinct adapters of the batch must fit the device slots
        if self.lora_table is not None:
            loras = {r.lora_id for r in [*running, *adder.can_run] if r.lora_id is not None}
        lora_blocked = False
        for req in self.waiting_queue:
            if slots_left <= 0 or not adder.budget_left() or adder.new_chunked_req is not None:
                break
            if loras is not None and req.lora_id is not None and (lora_blocked or (
                    req.lora_id not in loras and len(loras) >= self.lora_table.num_slots)):
                # the first adapter request without a slot goes first: no adapter request behind it is admitted
                # (a steady stream for the adapters in the slots would keep them there for ever); base-model
                # requests need no slot and go on
                lora_blocked = True
                continue
            # A match from an earlier round may point at KV that an eviction freed since: match again unless this
            # round's ordering just did (and never lock a node no longer in the tree).
            if not prefix_matched or not self.tree_cache.is_attached(req.last_node):
                req.init_next_round_input(self.tree_cache)
            head = _uncached_head(req, head_len) if sharing else None
            if head is not None:
                # In-batch prefix sharing: a request whose uncached head repeats one already admitted this round
                # (or one in flight) waits one round, and then finds that head in the cache instead of computing it
                # again.
                if head in owners:
                    owner = owners[head]
                    if owner is not None:
                        # the hybrid caches leave a state where the owner's prompt and every waiting one part
                        common = min(_match_len(owner.fill_ids, req.fill_ids, 0), len(req.fill_ids) - 1)
                        owner.shared_len = min(owner.shared_len, common) if owner.shared_len else common
                    continue
                owners[head] = req
            if not adder.add_one_req(req):
                break
            admitted.append(req)
            slots_left -= 1
            if loras is not None and req.lora_id is not None:
                loras.add(req.lora_id)
        return admitted

    def _heads_in_flight(self, head_len: int) -> set[tuple]:
        """Under overlap the prefill launched last is still in flight while the next batch is scheduled, and its
        prompts reach the tree only when its result is processed (after the next launch). Their uncached heads
        count as this round's, so a request arriving with one waits a round and then finds it cached instead of
        computing it a second time, as it would without overlap. (A chunked prompt's chunk is cached when its next
        chunk is scheduled, before this.)"""
        heads: set[tuple] = set()
        for launched in self.result_queue:
            mode = launched.forward_mode
            if not mode.is_extend() or mode.is_target_verify():
                continue
            prefill = launched.reqs[:launched.n_prefill] if mode.is_mixed() else launched.reqs
            for req in prefill:
                head = _uncached_head(req, head_len) if req is not self.chunked_req else None
                if head is not None:
                    heads.add(head)
        return heads


def _uncached_head(req: Req, head_len: int) -> tuple | None:
    """(adapter, *the first head_len prompt tokens) when this request's cached prefix stops short of them."""
    if len(req.prefix_indices) < head_len <= len(req.fill_ids):
        return (req.lora_id, *req.fill_ids[:head_len])
    return None
