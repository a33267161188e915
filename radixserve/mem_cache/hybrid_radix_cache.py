"""HybridRadixCache: prefix caching for hybrid models, whose linear-attention layers carry a recurrent state.

A cached prefix is only usable where the tree also holds the state of every linear-attention layer at its end: the
KV of the full-attention layers alone cannot restart the recurrence. So nodes may carry a state snapshot (a row of
the `StatePool`), and a match ends at the deepest node on the path that has one; the request's row is loaded from
that snapshot before its extend. Snapshots are taken
- inside a forward, at checkpoints the cache plans in `prepare_extend`: at the end of a request's prefill (its
  last chunk), where the request's tokens leave the KV already cached (a shared system prompt: the second request
  that shares it leaves the state there for every later one), where a request waiting behind it in the same round
  shares its tokens up to (`req.shared_len`, set by the scheduler's in-batch prefix check: two requests arriving
  together with a new system prompt compute it once), and one token before the end of a prefill-only request
  (n > 1's shared prompt: its samples match all but their last prompt token);
- at every other insert whose length the request's state covers exactly (`req.kv_committed_len`): after a middle
  chunk, and when a request ends (its KV and its state then cover `prompt + output[:-1]`, or all of its tokens
  where, with the overlap scheduler, one more decode step ran before its end was seen), so a conversation's next
  turn resumes where the last one stopped.
Every copy of a state row goes through the pool's queue, applied before the next forward (`state_pool.py`): so a
snapshot taken after a forward sees the state as of every forward launched so far, which is what
`kv_committed_len` counts, with or without the overlap scheduler.
When every snapshot row is taken the least recently used unlocked node gives its snapshot up (its KV stays, for
the LRU eviction); eviction of a node frees its snapshot. A node's snapshot stays with the lower part of a split.

Accounting: a snapshot row is free, held by exactly one node, or reserved by one request's planned checkpoint
(`req.state_checkpoints`) until its next cache call, so when the scheduler is idle
`states.available_size() + len(state_nodes) == states.size`.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode, _as_key, _match_len, _namespace
from radixserve.mem_cache.state_pool import StatePool


class HybridRadixCache(RadixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool, states: StatePool,
                 disable: bool = False) -> None:
        self.states = states
        self.state_nodes: set[TreeNode] = set()
        super().__init__(req_to_token_pool, token_to_kv_pool, disable)

    def reset(self) -> None:
        super().reset()
        self.states.clear()
        self.state_nodes = set()

    # ------------------------------------------------------------------ matching
    def match_prefix(self, key: Sequence[int] | torch.Tensor,
                     namespace: str | None = None) -> tuple[torch.Tensor, TreeNode]:
        """The longest cached prefix of `key` that ends at a node with a state snapshot (the root: none)."""
        indices, node = super().match_prefix(key, namespace)
        keep = len(indices)
        while node.state is None and node.parent is not None:
            keep -= len(node.key)
            node = node.parent
        if node.parent is None or keep == 0:  # the root or a namespace's top node: nothing usable
            return indices[:0], node
        return indices[:keep], node

    def is_attached(self, node: TreeNode | None) -> bool:
        """A match is still good while its node is in the tree and keeps its snapshot (the root needs none)."""
        if node is not None and node is not self.root and node.state is None and node.key:
            return False
        return super().is_attached(node)

    def cached_len(self, key: Sequence[int], namespace: str | None = None) -> int:
        """How many tokens of `key` have KV in the tree, snapshots or not (no node is split or touched)."""
        key = _as_key(key)
        node = self._namespace_root(namespace, create=False)
        pos = 0
        while node is not None and pos < len(key):
            child = node.children.get(self._child_key(key, pos)) if len(key) - pos >= self.page_size else None
            if child is None:
                break
            k = self._aligned(_match_len(child.key, key, pos))
            pos += k
            if k < len(child.key):
                break
            node = child
        return pos

    # ------------------------------------------------------------------ extend
    def prepare_extend(self, reqs: list[Any], new_rows: list[Any]) -> list[tuple[int, int, int]]:
        fresh = {id(r) for r in new_rows}
        for r in reqs:  # a cached prefix: the request's row starts from the snapshot where it ends
            if id(r) in fresh and len(r.prefix_indices):
                node = r.last_node
                if node is None or node.state is None:
                    raise RuntimeError(f"hybrid radix cache: request {r.rid} has a {len(r.prefix_indices)}-token "
                                       "prefix without a state snapshot")
                self.states.copy(node.state, r.req_pool_idx)
        plans = []
        for i, r in enumerate(reqs):
            self._drop_checkpoints(r)  # (a previous plan not settled: should not happen)
            for at in self._checkpoints(r):
                row = self._alloc_state()
                if row is None:
                    break
                r.state_checkpoints.append((at, row))
                plans.append((i, at - len(r.prefix_indices), row))
        return plans

    def _checkpoints(self, req: Any) -> list[int]:
        """Where inside this extend the request's state is worth keeping (lengths of its tokens, ascending)."""
        prefix, end = len(req.prefix_indices), len(req.fill_ids)
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        targets = {self._aligned(self.cached_len(tokens[:len(tokens) - 1], _namespace(req)))}
        if req.shared_len:  # a request admitted after it waits to share this much (the scheduler's in-batch check)
            targets.add(self._aligned(req.shared_len))
        prefill_only = req.sampling_params.max_new_tokens == 0 and req.pooling is None
        if prefill_only:
            targets.add(self._aligned(len(tokens) - 1))
        inside = {t for t in targets if prefix < t < end}
        if end == len(tokens) and end == self._aligned(end) and not prefill_only:
            inside.add(end)  # the prefill's end (its result is seen after the next decode step with overlap)
        return sorted(inside)

    def take_state_copies(self) -> list[tuple[int, int]]:
        return self.states.take_pending()

    # ------------------------------------------------------------------ caching
    def cache_finished_req(self, req: Any) -> None:
        tokens = list(req.origin_input_ids) + list(req.output_ids)
        row, covered, namespace = self._row(req), req.kv_committed_len, _namespace(req)
        super().cache_finished_req(req)  # (frees the request slot; its state row is intact until reused)
        req.chunk_snapshot = None
        self._keep(req, tokens, row, covered, namespace)

    def cache_unfinished_req(self, req: Any) -> None:
        before = req.chunk_snapshot
        super().cache_unfinished_req(req)
        taken = self._keep(req, _as_key(req.fill_ids), self._row(req), req.kv_committed_len, _namespace(req))
        if before is not None and before is not req.last_node and before.state is not None and before.lock_ref <= 1:
            # the snapshot this request took after its previous chunk, wanted by no other running request, is given
            # back: a later request sharing those tokens leaves a state where it leaves them (a checkpoint)
            self._release(before)
            before = None
        req.chunk_snapshot = taken or before

    def release_req(self, req: Any) -> None:
        self._drop_checkpoints(req)
        req.chunk_snapshot = None
        super().release_req(req)

    def _keep(self, req: Any, tokens: list[int], row: int, covered: int | None,
              namespace: str | None) -> TreeNode | None:
        """After an insert: hang the request's planned checkpoint on its node, and snapshot its state at the end
        of what was inserted when the state covers exactly that (returns the node of that snapshot)."""
        if self.disable:
            self._drop_checkpoints(req)
            return None
        taken = None
        for at, snap in req.state_checkpoints:
            node = self._node_at(tokens[:at], namespace)
            if node is not None and node.state is None:
                self._hold(node, snap)
                taken = node if at == len(tokens) else taken
            else:
                self.states.free(snap)
        req.state_checkpoints = []
        if covered and covered == self._aligned(covered) and covered <= len(tokens):
            node = self._node_at(tokens[:covered], namespace)
            if node is not None and node.state is None and (snap := self._alloc_state(keep=node)) is not None:
                self.states.copy(row, snap)
                self._hold(node, snap)
                return node
        return taken

    def _drop_checkpoints(self, req: Any) -> None:
        for _, snap in req.state_checkpoints:
            self.states.free(snap)
        req.state_checkpoints = []

    def _node_at(self, key: list[int], namespace: str | None) -> TreeNode | None:
        """The node that ends exactly after `key` (splitting one if needed), None if the tree lacks part of it."""
        node = self._namespace_root(namespace, create=False)
        pos = 0
        while node is not None and pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                return None
            k = _match_len(child.key, key, pos)
            if k < len(child.key):
                if pos + k < len(key) or k == 0 or k % self.page_size:
                    return None
                child = self._split(child, k)
            node, pos = child, pos + k
        return node if pos == len(key) and node is not None and node.key else None

    # ------------------------------------------------------------------ snapshot rows
    def _hold(self, node: TreeNode, snap: int) -> None:
        node.state = snap
        self.state_nodes.add(node)

    def _release(self, node: TreeNode) -> None:
        if node.state is not None:
            self.states.free(node.state)
            node.state = None
            self.state_nodes.discard(node)

    def _alloc_state(self, keep: TreeNode | None = None) -> int | None:
        """A free snapshot row; when there is none, the least recently used unlocked node (not `keep`) gives its
        snapshot up. None when every snapshot is locked."""
        row = self.states.alloc()
        if row is not None:
            return row
        candidates = [n for n in self.state_nodes if n.lock_ref == 0 and n is not keep]
        if not candidates:
            return None
        victim = min(candidates, key=lambda n: n.last_access_time)
        self._release(victim)
        return self.states.alloc()

    def _free_node(self, node: TreeNode) -> None:
        super()._free_node(node)
        self._release(node)

    def check_states(self) -> bool:
        """Every snapshot row is free or held by one node in the tree, and no other node claims one."""
        holders = [n for n in self._nodes() if n.state is not None]
        rows = [n.state for n in holders]
        return (set(holders) == self.state_nodes and len(set(rows)) == len(rows)
                and len(rows) + self.states.available_size() == self.states.size
                and not set(rows) & set(self.states.free_rows()))

    def format_tree(self) -> str:
        return (f"{super().format_tree()}\nstate snapshots: {len(self.state_nodes)} held, "
                f"{self.states.available_size()} free of {self.states.size}")
