"""ChunkCache: the cache used with --disable-radix-cache. No prefix sharing between requests.

The BasePrefixCache contract, like RadixCache. Each request owns all of its KV slots: a finished request frees
them all (and its request slot); an unfinished one (chunked prefill) keeps its own slots and records them as its
prefix, so that the next chunk extends on top of them. Nothing is ever evictable or protected.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.radix_cache import TreeNode, _as_key, _as_value, _empty_indices, _kv_len


class ChunkCache(BasePrefixCache):
    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        # A stand-in root, so callers can pass `last_node` around (and lock it) exactly as with RadixCache.
        self.root = TreeNode()
        self.root.lock_ref = 1

    def reset(self) -> None:
        """Clear both pools (every KV slot and request slot becomes free). Only when idle."""
        self.req_to_token_pool.clear()
        self.token_to_kv_pool.clear()

    def match_prefix(self, key: Sequence[int] | torch.Tensor,
                     namespace: str | None = None) -> tuple[torch.Tensor, TreeNode]:
        _as_key(key)
        return _empty_indices(), self.root

    def insert(self, key: Sequence[int] | torch.Tensor, value: torch.Tensor, namespace: str | None = None) -> int:
        """Keeps nothing: returns len(key), so that the caller frees its whole value."""
        key = _as_key(key)
        _as_value(value, len(key))
        return len(key)

    def cache_finished_req(self, req: Any) -> None:
        """Free all of the request's KV slots and its request slot."""
        all_len = len(req.origin_input_ids) + len(req.output_ids)
        row = self._row(req)
        prefix = getattr(req, "prefix_indices", None)
        prefix_len = 0 if prefix is None else len(prefix)
        kv_len = max(_kv_len(req, max(all_len - 1, 0)), prefix_len)
        if kv_len > all_len:
            raise ValueError(f"request has KV for {kv_len} tokens but only {all_len} token ids")
        self.token_to_kv_pool.free(self.req_to_token_pool.read(row, 0, kv_len))
        self.req_to_token_pool.free(row)

    def cache_unfinished_req(self, req: Any) -> None:
        """Keep the request's own slots for `fill_ids` as its prefix; the next chunk extends on top of them."""
        fill_ids = _as_key(req.fill_ids)
        row = self._row(req)
        req.prefix_indices = self.req_to_token_pool.read(row, 0, len(fill_ids))
        if getattr(req, "last_node", None) is None:
            req.last_node = self.root

    def release_req(self, req: Any) -> None:
        """Retraction: every KV slot of the request is its own (chunks included); free them all."""
        row = self._row(req)
        self.token_to_kv_pool.free(self.req_to_token_pool.read(row, 0, _kv_len(req, 0)))
        self.req_to_token_pool.free(row)
        self._clear_prefix(req)

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        return 0

    def evict(self, num_tokens: int) -> int:
        if num_tokens < 0:
            raise ValueError(f"cannot evict {num_tokens} tokens")
        return 0

    def evictable_size(self) -> int:
        return 0

    def protected_size(self) -> int:
        return 0

    def total_size(self) -> int:
        return 0

    def format_tree(self) -> str:
        return "ChunkCache (no prefix tree)"
