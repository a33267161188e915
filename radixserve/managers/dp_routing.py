"""Data-parallel routing: which replica a generate request goes to (round_robin | shortest_queue | cache_aware),
from the replicas' load reports and an approximate prefix tree per replica kept without asking it."""

from __future__ import annotations

import heapq
import logging
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.mem_cache.radix_cache import _match_len

logger = logging.getLogger(__name__)


# ===================================================================== an approximate prefix tree per replica
class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: list[int], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = 0


class ApproxPrefixTree:
    """The token ids of the prompts routed to one replica, as a radix tree with LRU eviction down to `capacity`
    tokens: an estimate of what that replica's RadixCache holds, kept without asking it."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.root = _Node([], None)
        self.size = 0
        self._clock = 0

    def match(self, tokens: list[int]) -> int:
        """Length of the longest prefix of `tokens` in the tree."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _match_len(child.key, tokens, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: list[int]) -> int:
        """Add `tokens`, mark its path most recently used, evict if over capacity; returns the length that was
        already there."""
        self._clock += 1
        node, pos = self.root, 0
        node.last_access = self._clock
        already = len(tokens)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                already = pos
                leaf = _Node(list(tokens[pos:]), node)
                leaf.last_access = self._clock
                node.children[tokens[pos]] = leaf
                self.size += len(leaf.key)
                break
            n = _match_len(child.key, tokens, pos)
            if n < len(child.key):  # split the edge: node -> mid (key[:n]) -> child (key[n:])
                mid = _Node(child.key[:n], node)
                node.children[tokens[pos]] = mid
                child.key = child.key[n:]
                child.parent = mid
                mid.children[child.key[0]] = child
                mid.last_access = child.last_access
                child = mid
            child.last_access = self._clock
            pos += n
            node = child
        if self.capacity is not None and self.size > self.capacity:
            self.evict(self.size - int(self.capacity * 0.9))
        return already

    def evict(self, num_tokens: int) -> int:
        """Drop least recently used leaves until `num_tokens` tokens are gone (or the tree is empty)."""
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                heap.append((n.last_access, id(n), n))
            stack.extend(n.children.values())
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                continue
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.size -= len(leaf.key)
            if not parent.children and parent is not self.root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed


# ===================================================================== routing
class LoadBalancer:
    """Picks a replica for each request. Loads are request counts: the replica's last report plus the requests
    routed to it that it had not taken in at the time of that report."""

    def __init__(self, method: str, dp_size: int, capacities: list[int] | None = None, abs_threshold: int = 8,
                 rel_threshold: float = 1.5) -> None:
        if method not in ("round_robin", "shortest_queue", "cache_aware"):
            raise ValueError(f"unknown load balance method {method!r}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.method = method
        self.dp_size = dp_size
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        caps = capacities or [None] * dp_size  # type: ignore[list-item]
        self.trees = [ApproxPrefixTree(c) for c in caps] if method == "cache_aware" else []
        self.next_rr = 0
        self.routed = [0] * dp_size
        self.reported = [(0, 0)] * dp_size  # (num_reqs, num_received) from the replicas' last reports
        self.cache_routed = 0  # requests sent where their prefix was

    def on_report(self, replica: int, report: io.SchedulerLoadReport) -> None:
        self.reported[replica] = (report.num_reqs, report.num_received)

    def loads(self) -> list[int]:
        return [n + max(0, self.routed[i] - recv) for i, (n, recv) in enumerate(self.reported)]

    def _round_robin(self, among: list[int] | None = None) -> int:
        """The next replica in turn (restricted to `among` when given)."""
        for k in range(self.dp_size):
            i = (self.next_rr + k) % self.dp_size
            if among is None or i in among:
                self.next_rr = (i + 1) % self.dp_size
                return i
        raise ValueError("no replica to choose from")

    def _shortest(self, loads: list[int], among: list[int] | None = None) -> int:
        cands = among if among is not None else list(range(self.dp_size))
        low = min(loads[i] for i in cands)
        return self._round_robin([i for i in cands if loads[i] == low])

    def select(self, input_ids: list[int]) -> int:
        if self.method == "round_robin":
            choice = self._round_robin()
        elif self.method == "shortest_queue":
            choice = self._shortest(self.loads())
        else:
            choice = self._cache_aware(input_ids)
        self.routed[choice] += 1
        return choice

    def _cache_aware(self, input_ids: list[int]) -> int:
        loads = self.loads()
        matches = [t.match(input_ids) for t in self.trees]
        best_len = max(matches)
        choice = None
        if best_len > 0:
            best = [i for i in range(self.dp_size) if matches[i] == best_len]
            cand = self._shortest(loads, best)
            low = min(loads)
            overloaded = loads[cand] - low > self.abs_threshold and loads[cand] > low * self.rel_threshold
            if not overloaded:
                choice = cand
                self.cache_routed += 1
        if choice is None:
            choice = self._shortest(loads)
        self.trees[choice].insert(input_ids)
        return choice

    def stats(self) -> dict[str, Any]:
        return {"load_balance_method": self.method, "dp_routed": list(self.routed), "dp_loads": self.loads(),
                "dp_cache_routed": self.cache_routed}
