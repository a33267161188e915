"""BasePrefixCache: what the scheduler asks of a prefix cache. RadixCache shares prefixes between requests;
ChunkCache (--disable-radix-cache) shares nothing but keeps the same contract, so that the scheduler and the batch
code never ask which one they hold.

The contract on KV slots: a slot belongs to the cache (evictable when no request locks it, protected when one
does), to one running request, or to the pool's free list. When the scheduler is idle,
`free + evictable_size() + protected_size() == pool size`.
"""

from __future__ import annotations

from abc import ABC, abstractmethod
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.managers.schedule_batch import Req
    from radixserve.mem_cache.radix_cache import TreeNode


class BasePrefixCache(ABC):
    root: TreeNode  # the node an empty match ends at; never evicted, always locked

    @property
    def shares_prefixes(self) -> bool:
        """True when a match can return another request's KV (prefix-aware scheduling is worth doing)."""
        return False

    @abstractmethod
    def reset(self) -> None:
        """Empty the cache and clear both pools. Only when the scheduler is idle."""

    @abstractmethod
    def match_prefix(self, key: Sequence[int] | torch.Tensor,
                     namespace: str | None = None) -> tuple[torch.Tensor, TreeNode]:
        """The KV slots of the longest cached prefix of `key`, and the node that prefix ends at. `namespace` (a
        LoRA adapter's name; None: the base model) is part of the key: KV never crosses namespaces."""

    @abstractmethod
    def insert(self, key: Sequence[int] | torch.Tensor, value: torch.Tensor, namespace: str | None = None) -> int:
        """Take ownership of `value[returned:]`; returns how much of `key` was cached already."""

    @abstractmethod
    def cache_finished_req(self, req: Req) -> None:
        """A request ended: keep (or free) its KV, free its request slot, unlock its prefix."""

    @abstractmethod
    def cache_unfinished_req(self, req: Req) -> None:
        """A chunk of a chunked prefill ran: what was filled so far becomes the request's prefix."""

    def prepare_extend(self, reqs: list[Req], new_rows: list[Req]) -> list[tuple[int, int, int]]:
        """Before an extend of `reqs` runs (`new_rows`: those given a request slot just now). A cache that keeps
        model state besides KV (a hybrid model's recurrent states) loads it into the new rows and plans where the
        forward leaves copies of it: (index in `reqs`, tokens into the request's extend, snapshot row). KV-only
        caches have nothing to do."""
        return []

    def take_state_copies(self) -> list[tuple[int, int]]:
        """The (src row, dst row) state copies queued since the last call, for the next batch to carry to the
        worker (a hybrid model's snapshots; KV-only caches have none)."""
        return []

    @abstractmethod
    def release_req(self, req: Req) -> None:
        """A running request is retracted: free its own KV slots and its request slot, unlock its prefix (the cached
        part stays in the cache for when it is prefilled again). The request's prefix fields are cleared."""

    @abstractmethod
    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Protect the path from `node` to the root; returns how many tokens became protected."""

    @abstractmethod
    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Undo one inc_lock_ref; returns minus the tokens that became evictable again."""

    def is_attached(self, node: TreeNode | None) -> bool:
        """Whether `node` is still in the cache (an eviction may have detached a node matched earlier)."""
        while node is not None and node is not self.root:
            node = node.parent
        return node is self.root

    def lock_cost(self, node: TreeNode | None) -> int:
        """Evictable tokens that locking `node` would protect (they stop counting as memory we may evict)."""
        size = 0
        while node is not None and node is not self.root:
            if node.lock_ref == 0:
                size += len(node.key)
            node = node.parent
        return size

    def drop_namespace(self, namespace: str) -> int:
        """Free every entry under `namespace` (its LoRA adapter was unloaded); returns the tokens freed. A cache
        that keeps nothing has nothing to drop."""
        return 0

    @abstractmethod
    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` unlocked slots if there are that many; returns the number freed."""

    def check_states(self) -> bool:
        """When idle: whether the model state the cache keeps besides KV is accounted for exactly (KV-only caches
        keep none)."""
        return True

    @abstractmethod
    def evictable_size(self) -> int: ...

    @abstractmethod
    def protected_size(self) -> int: ...

    @abstractmethod
    def total_size(self) -> int: ...

    def format_tree(self) -> str:
        return type(self).__name__

    def pretty_print(self) -> None:
        print(self.format_tree())

    @staticmethod
    def _row(req: Any) -> int:
        row = getattr(req, "req_pool_idx", None)
        if row is None:
            raise ValueError("request has no req_pool_idx (no request slot to cache from)")
        return int(row)

    def _clear_prefix(self, req: Any) -> None:
        req.req_pool_idx = None
        req.prefix_indices = torch.empty(0, dtype=torch.int64)
        req.last_node = None
        req.kv_committed_len = None
