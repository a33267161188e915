"""The radix (prefix) cache: a radix tree over token ids whose values are KV slot indices.

Every node owns the KV slots of its own key segment; the path from the root to a node spells a token prefix
whose KV slots are the concatenation of the values along that path. Requests that share a prompt prefix share
those slots: a new request matches its prompt against the tree (`match_prefix`), locks the matched path
(`inc_lock_ref`) so that it cannot be evicted while the request runs, and gives its KV back to the tree when it
ends (`cache_finished_req`) or after each chunk of a chunked prefill (`cache_unfinished_req`).

Ownership of KV slots (the one rule that keeps the pool free of leaks and double frees): a slot is owned either by
the tree (it is in exactly one node's value), by a running request (it is in the request's row beyond
`len(req.prefix_indices)`), or by the pool's free list. `insert` takes ownership of the part of `value` that was
not in the tree yet and returns the length of the part that was; the caller frees that duplicated part of its own
value (unless it is the tree's own slots, i.e. the request's `prefix_indices`).

Namespaces: a request served by a LoRA adapter computes other KV for the same tokens, so each adapter has a
subtree of its own (`namespace` = the adapter's name; None = the base model at the root). A namespace's top node
hangs under the root with an empty key and is never evicted; `drop_namespace` frees a whole subtree when its adapter
is unloaded.

Pages (--page-size P > 1): every key in the tree is a whole number of pages, a node's children are keyed by their
first page of tokens, a match or a split only ever ends on a page boundary, and `insert` takes page-aligned keys.
So a page is owned whole by the tree or by one request: a request's partly filled last page is never shared, and
after a chunk of a chunked prefill the tokens past the last whole page are recomputed with the next chunk.

Accounting: `evictable_size()` is the number of tokens in unlocked nodes (lock_ref == 0), `protected_size()` the
number in locked nodes. Both are kept exact on every operation, so that when the scheduler is idle
`token_to_kv_pool.available_size() + evictable_size() + protected_size() == token_to_kv_pool.size`.
"""

from __future__ import annotations

import heapq
import itertools
from collections.abc import Iterator, Sequence
from typing import Any

import torch

from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool

# A process-wide logical clock for LRU: strictly increasing, so that two touches never tie (time.monotonic can).
_clock = itertools.count()


def _tick() -> int:
    return next(_clock)


def _empty_indices() -> torch.Tensor:
    return torch.empty((0,), dtype=torch.int64)


def _as_key(key: Any) -> list[int]:
    """Normalise a key to a list of Python ints (dict lookups by tensor elements would silently miss)."""
    if isinstance(key, list):
        return key
    if isinstance(key, torch.Tensor):
        if key.dim() != 1:
            raise ValueError(f"a key must be one-dimensional; got shape {tuple(key.shape)}")
        return key.tolist()
    if isinstance(key, (str, bytes)) or not isinstance(key, Sequence):
        raise TypeError(f"a key must be a sequence of token ids; got {type(key).__name__}")
    return list(key)


def _as_value(value: Any, length: int) -> torch.Tensor:
    if not isinstance(value, torch.Tensor):
        raise TypeError(f"a value must be a tensor of KV slots; got {type(value).__name__}")
    if value.dim() != 1:
        raise ValueError(f"a value must be one-dimensional; got shape {tuple(value.shape)}")
    if value.numel() != length:
        raise ValueError(f"key and value lengths differ: {length} tokens, {value.numel()} KV slots")
    if value.dtype != torch.int64 or value.device.type != "cpu":
        value = value.to("cpu", torch.int64)
    return value


def _match_len(node_key: list[int], key: list[int], pos: int) -> int:
    """Length of the common prefix of `node_key` and `key[pos:]` (without copying the rest of `key`)."""
    n = min(len(node_key), len(key) - pos)
    # Fast path (C-speed list compare): the whole shorter part matches.
    if node_key[:n] == key[pos:pos + n]:
        return n
    i = 0
    while i < n and node_key[i] == key[pos + i]:
        i += 1
    return i


def _namespace(req: Any) -> str | None:
    """The cache namespace of a request: its LoRA adapter (None: the base model)."""
    return getattr(req, "lora_id", None)


def _kv_len(req: Any, num_tokens: int) -> int:
    """Number of KV tokens the request actually has in its row: `req.kv_committed_len` if set, else `num_tokens`."""
    committed = getattr(req, "kv_committed_len", None)
    if committed is None:
        return num_tokens
    committed = int(committed)
    if committed < 0:
        raise ValueError(f"kv_committed_len is negative: {committed}")
    return committed


class TreeNode:
    """A node of the radix tree. `key` is this node's token segment, `value` its KV slots (CPU int64)."""

    __slots__ = ("children", "parent", "key", "value", "lock_ref", "last_access_time", "state")

    def __init__(self, key: list[int] | None = None, value: torch.Tensor | None = None,
                 parent: TreeNode | None = None) -> None:
        self.children: dict[int, TreeNode] = {}
        self.parent: TreeNode | None = parent
        self.key: list[int] = key if key is not None else []
        self.value: torch.Tensor = value if value is not None else _empty_indices()
        self.lock_ref: int = 0
        self.last_access_time: int = _tick()
        self.state: int | None = None  # a hybrid model's state snapshot at this node's end (HybridRadixCache)

    def __len__(self) -> int:
        return len(self.key)

    def __repr__(self) -> str:
        head = self.key[:8]
        more = "..." if len(self.key) > 8 else ""
        return f"TreeNode(len={len(self.key)}, key={head}{more}, lock_ref={self.lock_ref})"


class RadixCache(BasePrefixCache):
    """Prefix cache over the KV pool. With `disable=True` it caches nothing (match_prefix always misses)."""

    def __init__(self, req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool,
                 disable: bool = False) -> None:
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.disable = disable
        self.page_size = getattr(token_to_kv_pool, "page_size", 1)
        self._init_tree()

    def _init_tree(self) -> None:
        self.root = TreeNode()
        self.root.lock_ref = 1  # the root is never evicted; its key is empty so it counts nowhere
        self._evictable_size = 0
        self._protected_size = 0

    # ------------------------------------------------------------------ public API
    @property
    def shares_prefixes(self) -> bool:
        return not self.disable

    def reset(self) -> None:
        """Empty the tree and clear both pools (every KV slot and request slot becomes free). Only when idle."""
        self._init_tree()
        self.req_to_token_pool.clear()
        self.token_to_kv_pool.clear()

    def match_prefix(self, key: Sequence[int] | torch.Tensor,
                     namespace: str | None = None) -> tuple[torch.Tensor, TreeNode]:
        """The KV slots of the longest cached prefix of `key` (under `namespace`) and the node where it ends.

        If the prefix ends inside a node, the node is split there so that the returned node ends exactly at the
        prefix (the caller locks it). Touches every node on the path (LRU).
        """
        return self._match(key, namespace)

    def _match(self, key: Sequence[int] | torch.Tensor, namespace: str | None) -> tuple[torch.Tensor, TreeNode]:
        key = _as_key(key)
        if self.page_size > 1:
            key = key[:self._aligned(len(key))]
        node = self._namespace_root(namespace, create=False)
        if self.disable or not key or node is None:
            return _empty_indices(), self.root
        values: list[torch.Tensor] = []
        node.last_access_time = _tick()
        pos = 0
        while pos < len(key):
            child = node.children.get(self._child_key(key, pos))
            if child is None:
                break
            k = self._aligned(_match_len(child.key, key, pos))
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access_time = _tick()
            values.append(child.value)
            node = child
            pos += k
        if not values:
            return _empty_indices(), node
        return (torch.cat(values) if len(values) > 1 else values[0].clone()), node

    def insert(self, key: Sequence[int] | torch.Tensor, value: torch.Tensor, namespace: str | None = None) -> int:
        """Insert `key` with KV slots `value`; return the length of the prefix of `key` that was already cached.

        The tree takes ownership of `value[returned:]`; the caller keeps (and normally frees) `value[:returned]`.
        When the cache is disabled nothing is kept and `len(key)` is returned, so the caller frees everything.
        """
        key = _as_key(key)
        value = _as_value(value, len(key))
        if self.disable:
            return len(key)
        if len(key) % self.page_size:
            raise ValueError(f"radix cache: insert of {len(key)} tokens, not a whole number of "
                             f"{self.page_size}-token pages")
        node = self._namespace_root(namespace, create=True)
        node.last_access_time = _tick()
        pos = 0
        while pos < len(key):
            ck = self._child_key(key, pos)
            child = node.children.get(ck)
            if child is None:
                new = TreeNode(key[pos:], value[pos:].clone(), parent=node)
                node.children[ck] = new
                self._evictable_size += len(new.key)
                return pos
            k = self._aligned(_match_len(child.key, key, pos))
            if k < len(child.key):
                child = self._split(child, k)
            child.last_access_time = _tick()
            node = child
            pos += k
        return pos

    def cache_finished_req(self, req: Any) -> None:
        """Give a finished (or aborted) request's KV to the tree, free its duplicates and its request slot.

        The KV covers `(origin_input_ids + output_ids)[:-1]` (the last sampled token never ran through the model),
        unless `req.kv_committed_len` is set, in which case exactly that many tokens of the row hold written KV
        and are cached. Slots in the row beyond that are not touched: whoever allocated them frees them.
        """
        all_ids = list(req.origin_input_ids) + list(req.output_ids)
        row = self._row(req)
        prefix_len = self._prefix_len(req)
        # The matched prefix is in the row (and in the tree) even if nothing new ran; cover at least that.
        kv_len = max(_kv_len(req, max(len(all_ids) - 1, 0)), prefix_len)
        if kv_len > len(all_ids):
            raise ValueError(f"request has KV for {kv_len} tokens but only {len(all_ids)} token ids")
        indices = self.req_to_token_pool.read(row, 0, kv_len)
        if self.disable:
            # Nothing is in the tree: every slot of the row is the request's own (chunks included).
            self.token_to_kv_pool.free(indices)
        else:
            aligned = self._aligned(kv_len)  # whole pages go to the tree, the partly filled last one is freed
            new_prefix_len = self.insert(all_ids[:aligned], indices[:aligned], _namespace(req))
            if new_prefix_len < prefix_len:
                raise RuntimeError(f"radix cache lost a locked prefix: matched {prefix_len}, found {new_prefix_len}")
            self.token_to_kv_pool.free(indices[prefix_len:new_prefix_len])
            self.token_to_kv_pool.free(indices[aligned:])
        self.req_to_token_pool.free(row)
        self.dec_lock_ref(req.last_node)

    def cache_unfinished_req(self, req: Any) -> None:
        """After a chunk of a chunked prefill: cache `req.fill_ids`, and make the request run on the tree's slots.

        Inserts the chunk's tokens, frees the request's slots that duplicate cached ones, rewrites the request's
        row with the tree's slots, moves the lock from the old last node to the new one, and updates
        `req.prefix_indices` / `req.last_node`. With pages only the whole pages are cached: the slots of a partly
        filled last page stay the request's own (past its prefix in the row), for its decode steps to continue;
        a next chunk recomputes those tokens (`ScheduleBatch.prepare_for_extend` frees them first).
        """
        fill_ids = _as_key(req.fill_ids)
        row = self._row(req)
        prefix_len = self._prefix_len(req)
        if len(fill_ids) < prefix_len:
            raise ValueError(f"fill_ids ({len(fill_ids)} tokens) is shorter than the prefix ({prefix_len})")
        indices = self.req_to_token_pool.read(row, 0, len(fill_ids))
        if self.disable:
            req.prefix_indices = indices
            if getattr(req, "last_node", None) is None:
                req.last_node = self.root
            return
        fill_ids = fill_ids[:self._aligned(len(fill_ids))]
        new_prefix_len = self.insert(fill_ids, indices[:len(fill_ids)], _namespace(req))
        if new_prefix_len < prefix_len:
            raise RuntimeError(f"radix cache lost a locked prefix: matched {prefix_len}, found {new_prefix_len}")
        self.token_to_kv_pool.free(indices[prefix_len:new_prefix_len])
        new_indices, new_last_node = self._match(fill_ids, _namespace(req))
        if len(new_indices) != len(fill_ids):
            raise RuntimeError(f"radix cache: re-match after insert found {len(new_indices)} of {len(fill_ids)}")
        self.req_to_token_pool.write(row, prefix_len, new_indices[prefix_len:])
        # Lock the new path before unlocking the old one, so shared ancestors stay protected throughout.
        self.inc_lock_ref(new_last_node)
        self.dec_lock_ref(req.last_node)
        req.prefix_indices = new_indices
        req.last_node = new_last_node

    def release_req(self, req: Any) -> None:
        """Retraction: free the request's own slots past its cached prefix and its request slot; unlock the prefix,
        which stays in the tree (evictable) for when the request is prefilled again."""
        row = self._row(req)
        indices = self.req_to_token_pool.read(row, 0, _kv_len(req, 0))
        # disabled: every slot of the row is the request's own, prefix included (chunks)
        own_from = 0 if self.disable else self._prefix_len(req)
        self.token_to_kv_pool.free(indices[own_from:])
        self.dec_lock_ref(req.last_node)
        self.req_to_token_pool.free(row)
        self._clear_prefix(req)

    def inc_lock_ref(self, node: TreeNode | None) -> int:
        """Lock the path from `node` to the root; returns the change in protected size (>= 0)."""
        if self.disable or node is None:
            return 0
        delta = 0
        for n in self._path_to_root(node):
            if n.lock_ref == 0:
                size = len(n.key)
                self._evictable_size -= size
                self._protected_size += size
                delta += size
            n.lock_ref += 1
        return delta

    def dec_lock_ref(self, node: TreeNode | None) -> int:
        """Unlock the path from `node` to the root; returns the change in protected size (<= 0)."""
        if self.disable or node is None:
            return 0
        path = self._path_to_root(node)
        for n in path:  # check first, so that a bad call changes nothing
            if n.lock_ref <= 0:
                raise ValueError(f"dec_lock_ref on an unlocked node {n!r}")
        delta = 0
        for n in path:
            n.lock_ref -= 1
            if n.lock_ref == 0:
                size = len(n.key)
                self._evictable_size += size
                self._protected_size -= size
                delta -= size
        return delta

    def evict(self, num_tokens: int) -> int:
        """Free at least `num_tokens` KV slots (if that many are evictable), least recently used leaves first.

        Locked nodes are never evicted. Returns the number of tokens actually evicted.
        """
        if num_tokens < 0:
            raise ValueError(f"cannot evict {num_tokens} tokens")
        if self.disable or num_tokens == 0:
            return 0
        heap = [(leaf.last_access_time, id(leaf), leaf) for leaf in self._evictable_leaves()]
        heapq.heapify(heap)
        evicted = 0
        while evicted < num_tokens and heap:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                raise RuntimeError("radix cache: a leaf with no parent in the eviction heap")
            self._free_node(leaf)
            del parent.children[self._child_key(leaf.key, 0)]
            leaf.parent = None
            n = len(leaf.key)
            self._evictable_size -= n
            evicted += n
            if parent is not self.root and parent.lock_ref == 0 and not parent.children:
                heapq.heappush(heap, (parent.last_access_time, id(parent), parent))
        return evicted

    def drop_namespace(self, namespace: str) -> int:
        """Free every entry under `namespace` (its adapter was unloaded); returns the tokens freed. Raises if a
        running request still holds one of them."""
        top = self.root.children.get(namespace)
        if top is None:
            return 0
        nodes = [top]
        stack = list(top.children.values())
        while stack:
            n = stack.pop()
            if n.lock_ref:
                raise ValueError(f"radix cache: namespace {namespace!r} is still in use")
            nodes.append(n)
            stack.extend(n.children.values())
        freed = 0
        for n in nodes[1:]:
            self._free_node(n)
            freed += len(n.key)
            n.parent = None
        self._evictable_size -= freed
        del self.root.children[namespace]
        top.parent = None
        return freed

    def evictable_size(self) -> int:
        return self._evictable_size

    def protected_size(self) -> int:
        return self._protected_size

    def total_size(self) -> int:
        """Tokens held by the tree, counted by walking it (equals evictable_size() + protected_size())."""
        return sum(len(node.key) for node in self._nodes())

    def format_tree(self) -> str:
        lines: list[str] = []
        stack: list[tuple[TreeNode, int]] = [(self.root, 0)]
        while stack:
            node, depth = stack.pop()
            if node is self.root:
                lines.append(f"root (evictable={self._evictable_size}, protected={self._protected_size})")
            else:
                head = node.key[:10]
                more = "..." if len(node.key) > 10 else ""
                lines.append(f"{'  ' * depth}{len(node.key)} {head}{more} lock_ref={node.lock_ref} "
                             f"t={node.last_access_time}")
            for child in sorted(node.children.values(), key=lambda c: (0, c.key[0]) if c.key else (1, 0),
                                reverse=True):
                stack.append((child, depth + 1))
        return "\n".join(lines)

    def pretty_print(self) -> None:
        print(self.format_tree())
        print(f"#tokens: {self.total_size()}")

    # ------------------------------------------------------------------ internals
    def _child_key(self, key: list[int], pos: int) -> int | tuple[int, ...]:
        """A child's key in its parent's dict: its first token, or its first page of tokens."""
        return key[pos] if self.page_size == 1 else tuple(key[pos:pos + self.page_size])

    def _aligned(self, n: int) -> int:
        return n - n % self.page_size

    def _namespace_root(self, namespace: str | None, create: bool) -> TreeNode | None:
        """The node under which `namespace`'s keys live (the root for None); made on first insert."""
        if namespace is None:
            return self.root
        if not isinstance(namespace, str):
            raise TypeError(f"a namespace is an adapter name; got {type(namespace).__name__}")
        top = self.root.children.get(namespace)
        if top is None and create:
            top = TreeNode(parent=self.root)
            top.lock_ref = 1  # never evicted; its key is empty so it counts nowhere
            self.root.children[namespace] = top  # type: ignore[index]  # a str never equals a token id
        return top

    def _free_node(self, node: TreeNode) -> None:
        """A node leaves the tree (eviction, a dropped namespace): what it owns goes back to the pools."""
        self.token_to_kv_pool.free(node.value)

    def _split(self, child: TreeNode, k: int) -> TreeNode:
        """Split `child` after its first `k` tokens (0 < k < len); returns the new upper node."""
        if not 0 < k < len(child.key) or k % self.page_size:
            raise RuntimeError(f"radix cache: bad split at {k} of a {len(child.key)}-token node")
        parent = child.parent
        if parent is None:
            raise RuntimeError("radix cache: cannot split a detached node")
        upper = TreeNode(child.key[:k], child.value[:k], parent=parent)
        upper.lock_ref = child.lock_ref  # every lock through child also covers its first k tokens
        upper.last_access_time = child.last_access_time
        child.key = child.key[k:]
        child.value = child.value[k:]
        child.parent = upper
        upper.children[self._child_key(child.key, 0)] = child
        parent.children[self._child_key(upper.key, 0)] = upper
        return upper

    def _path_to_root(self, node: TreeNode) -> list[TreeNode]:
        """The nodes from `node` up to (not including) the root; raises if `node` is not in this tree."""
        if not isinstance(node, TreeNode):
            raise TypeError(f"expected a TreeNode; got {type(node).__name__}")
        path: list[TreeNode] = []
        cur: TreeNode | None = node
        while cur is not self.root:
            if cur is None:
                raise ValueError(f"{node!r} is not in this radix cache (evicted or from another tree)")
            path.append(cur)
            cur = cur.parent
        return path

    def _nodes(self) -> Iterator[TreeNode]:
        stack = list(self.root.children.values())
        while stack:
            node = stack.pop()
            yield node
            stack.extend(node.children.values())

    def _evictable_leaves(self) -> list[TreeNode]:
        return [n for n in self._nodes() if not n.children and n.lock_ref == 0]

    @staticmethod
    def _prefix_len(req: Any) -> int:
        prefix = getattr(req, "prefix_indices", None)
        return 0 if prefix is None else len(prefix)
