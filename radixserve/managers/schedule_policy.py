"""Which waiting requests to prefill next (SchedulePolicy) and how many fit (PrefillAdder)."""

from __future__ import annotations

import logging
import random
from collections import defaultdict
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.managers.schedule_batch import Req
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
    from radixserve.mem_cache.memory_pool import TokenToKVPool
    from radixserve.mem_cache.radix_cache import TreeNode

logger = logging.getLogger(__name__)

# Above this many waiting requests, prefix matching for every one of them costs more than it saves.
LPM_MAX_QUEUE = 128
PREFIX_POLICIES = ("lpm", "dfs-weight")


class SchedulePolicy:
    def __init__(self, policy: str, tree_cache: BasePrefixCache | None, seed: int = 0) -> None:
        self.policy = policy
        self.tree_cache = tree_cache
        self.rng = random.Random(seed)
        if policy in PREFIX_POLICIES and (tree_cache is None or not tree_cache.shares_prefixes):
            logger.warning("--schedule-policy %s orders requests by their cached prefixes; with no prefix cache "
                           "(--disable-radix-cache) it runs as fcfs", policy)

    def calc_priority(self, waiting: list[Req]) -> bool:
        """Order `waiting` in place. Returns True when this call matched every waiting request's prefix against
        the cache as it is now (the prefix-aware orders), so that the caller need not match them again; False when
        it did not (other policies, or the fcfs fallback of a prefix-aware one), and the caller must."""
        policy = self.policy
        if policy in PREFIX_POLICIES and (len(waiting) > LPM_MAX_QUEUE or self.tree_cache is None
                                          or not self.tree_cache.shares_prefixes):
            policy = "fcfs"
        if policy == "fcfs":
            return False
        if policy == "lof":
            waiting.sort(key=lambda r: -r.sampling_params.max_new_tokens)
            return False
        if policy == "random":
            self.rng.shuffle(waiting)
            return False
        if policy not in PREFIX_POLICIES:
            raise ValueError(f"unknown schedule policy {policy!r}")
        for r in waiting:
            r.init_next_round_input(self.tree_cache)
        if policy == "lpm":
            waiting.sort(key=lambda r: -len(r.prefix_indices))  # stable: arrival order among equal matches
        else:
            waiting[:] = self._dfs_weight_order(waiting)
        return True

    def _dfs_weight_order(self, waiting: list[Req]) -> list[Req]:
        """Depth first over the radix tree, the subtree holding the most waiting requests first, and a node's own
        requests after its subtree's (longer matches first), so that requests sharing a prefix run together while
        it is cached. Requests with no match come last."""
        by_node: dict[int, list[Req]] = defaultdict(list)
        weight: dict[int, int] = defaultdict(int)
        for r in waiting:
            by_node[id(r.last_node)].append(r)
            node = r.last_node
            while node is not None:
                weight[id(node)] += 1
                node = node.parent
        ordered: list[Req] = []
        # iterative post-order (a deep tree must not hit the recursion limit)
        stack: list[tuple[TreeNode, bool]] = [(self.tree_cache.root, False)]
        while stack:
            node, children_done = stack.pop()
            if children_done:
                ordered.extend(by_node.get(id(node), ()))
                continue
            stack.append((node, True))
            children = [c for c in node.children.values() if weight.get(id(c), 0)]
            children.sort(key=lambda c: weight[id(c)])  # the heaviest is pushed last, so visited first
            stack.extend((c, False) for c in children)
        seen = {id(r) for r in ordered}
        return ordered + [r for r in waiting if id(r) not in seen]


def latency_step_budget(budget: int, num_running: int, waiting: list[Req], chunk_size: int | None) -> int | None:
    """The token budget of the next step when it should protect the running decodes' pace, else None (the step
    runs as the plain chunked prefill would). It applies while requests decode, their number leaves at least half of
    the budget to prefill (a larger decode batch is a throughput regime: its own step is long, and mixed with a
    prefill it would not replay its CUDA graph), and the waiting prompts fit in one chunk (a backlog is served at
    full chunk size, as an offline burst wants)."""
    if budget <= 0 or num_running == 0 or 2 * num_running > budget:
        return None
    limit = chunk_size if chunk_size is not None else budget
    waiting_tokens = 0
    for req in waiting:
        waiting_tokens += len(req.origin_input_ids)
        if waiting_tokens > limit:
            return None
    return budget


class PrefillAdder:
    """Admits requests into one prefill batch under the token budgets and the memory left.

    rem_total: KV slots we may still promise (free + evictable - what running requests will still decode, scaled by
    new_token_ratio). With pages each request may also leave up to page_size - 1 slots of its last page unused
    (`page_slack`): counted in full for a new request's prompt (its pages are taken at once), scaled like the rest
    of the reservation for a running one (a decode step short of memory retracts). rem_input: --max-prefill-tokens
    left. rem_chunk: --chunked-prefill-size left (None = off).
    """

    def __init__(self, tree_cache: BasePrefixCache | None, token_to_kv_pool: TokenToKVPool,
                 running_reqs: list[Req], new_token_ratio: float, max_prefill_tokens: int, chunk_size: int | None,
                 mixed_decode_tokens: int = 0) -> None:
        self.tree_cache = tree_cache
        self.page_size = getattr(token_to_kv_pool, "page_size", 1)
        self.page_slack = self.page_size - 1
        evictable = tree_cache.evictable_size() if tree_cache is not None else 0
        reserved = sum(min(r.sampling_params.max_new_tokens - len(r.output_ids), 4096) + self.page_slack
                       for r in running_reqs) * new_token_ratio
        self.rem_total = token_to_kv_pool.available_size() + evictable - reserved - mixed_decode_tokens
        self.rem_input = max_prefill_tokens - mixed_decode_tokens
        self.rem_chunk = None if chunk_size is None else chunk_size - mixed_decode_tokens
        self.new_token_ratio = new_token_ratio
        self.can_run: list[Req] = []
        self.new_chunked_req: Req | None = None

    def budget_left(self) -> bool:
        return self.rem_total > 0 and self.rem_input > 0 and (self.rem_chunk is None or self.rem_chunk > 0)

    def _take(self, ext: int, max_new: int) -> None:
        self.rem_total -= ext + max_new + self.page_slack
        self.rem_input -= ext
        if self.rem_chunk is not None:
            self.rem_chunk -= ext

    def add_chunked_req(self, req: Req) -> Req | None:
        """Continue a request being prefilled in chunks; returns it if it still has more chunks after this one (it
        is then this round's chunked request: nothing is admitted behind it). A chunk takes only the memory left
        (decodes riding along in mixed steps may have used what admission left it); with not even a page of room
        the request waits a round, its prompt's computed part kept."""
        ext = req.extend_input_len
        if self.rem_chunk is not None and ext > self.rem_chunk:
            ext = max(1, self.rem_chunk)
        ext = min(ext, max(1, int(self.rem_input)), max(1, int(self.rem_total) - self.page_slack))
        if ext < req.extend_input_len:
            ext = self._page_aligned_chunk(req, ext)
        if ext + self.page_slack > self.rem_total:
            req.extend_input_len = 0
            req.fill_ids = req.fill_ids[: len(req.prefix_indices)]
            self.new_chunked_req = req
            return req
        truncated = ext < req.extend_input_len
        req.extend_input_len = ext
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + ext]
        self.can_run.append(req)
        self._take(ext, 0 if truncated else self._reserve(req))
        if truncated:
            self.new_chunked_req = req
        return req if truncated else None

    def _page_aligned_chunk(self, req: Req, ext: int) -> int:
        """A chunk of about `ext` tokens that ends on a page boundary: the longest that fits in `ext`, else the one
        up to the next boundary (the tokens of a partly filled last page are recomputed with the next chunk, so a
        chunk that ended short of a page would never make progress)."""
        p, pre = self.page_size, len(req.prefix_indices)
        if p == 1:
            return ext
        aligned = (pre + ext) // p * p - pre
        if aligned <= 0:
            aligned = (pre // p + 1) * p - pre
        return min(aligned, req.extend_input_len)

    def _reserve(self, req: Req) -> int:
        return int(min(req.sampling_params.max_new_tokens - len(req.output_ids), 4096) * self.new_token_ratio)

    def add_one_req(self, req: Req) -> bool:
        """Try to admit `req`; returns False when it does not fit (the caller stops adding)."""
        ext = req.extend_input_len
        reserve = self._reserve(req)
        slack = self.page_slack
        if ext + reserve + slack > self.rem_total and self.can_run:
            return False
        if ext + slack > self.rem_total:  # not even the prompt fits, and nothing else is in the batch
            return False
        lock = self.tree_cache is not None and req.last_node is not None
        # locking the matched prefix takes it out of the evictable pool we counted on
        lock_cost = self.tree_cache.lock_cost(req.last_node) if lock else 0
        if ext + slack + lock_cost > self.rem_total:
            return False
        # prompt logprobs need the whole prompt in one extend, so such a request is never chunked
        whole = req.return_logprob and req.logprob_start_len >= 0 and not req.output_ids
        if self.rem_chunk is None or ext <= self.rem_chunk or whole:
            if ext > self.rem_input and self.can_run:
                return False
            if lock:
                self.rem_total -= self.tree_cache.inc_lock_ref(req.last_node) or 0
            self.can_run.append(req)
            self._take(ext, reserve)
            return True
        # chunk it: only the first rem_chunk tokens this round
        if self.rem_chunk <= 0:
            return False
        if lock:
            self.rem_total -= self.tree_cache.inc_lock_ref(req.last_node) or 0
        ext = self._page_aligned_chunk(req, self.rem_chunk)
        if ext >= req.extend_input_len:  # the page boundary past the budget is the prompt's end: one extend
            self.can_run.append(req)
            self._take(ext, reserve)
            return True
        req.extend_input_len = ext
        req.fill_ids = req.fill_ids[: len(req.prefix_indices) + ext]
        req.is_chunked += 1
        self.can_run.append(req)
        self.new_chunked_req = req
        self._take(ext, 0)
        return True
