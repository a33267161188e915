"""Unit tests for RadixCache and ChunkCache with real pools on the CPU.

A small `Sim` plays the scheduler: it matches, locks, allocates, writes request rows, runs chunked prefill and
decode steps, and finishes or aborts requests. It records, for every KV slot it hands out, the token prefix whose
KV that slot holds, and after every operation checks that the pool's slots are partitioned exactly between the
free list, the tree and the running requests, that the size counters are exact, and that lock counts match the
running requests.
"""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
import torch

from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache, TreeNode


def make_pools(kv_size: int = 64, num_reqs: int = 8, context: int = 128) -> tuple[ReqToTokenPool, TokenToKVPool]:
    r2t = ReqToTokenPool(num_reqs, context, "cpu")
    kv = TokenToKVPool(kv_size, torch.float32, num_kv_heads=1, head_dim=2, num_layers=1, device="cpu")
    return r2t, kv


def nodes_of(cache: RadixCache) -> list[tuple[TreeNode, tuple[int, ...]]]:
    """Every non-root node with the full token prefix that ends at it."""
    out = []
    stack = [(child, tuple(child.key)) for child in cache.root.children.values()]
    while stack:
        node, prefix = stack.pop()
        out.append((node, prefix))
        stack.extend((c, prefix + tuple(c.key)) for c in node.children.values())
    return out


class Sim:
    """A miniature scheduler driving a cache with real pools."""

    def __init__(self, cache_cls: type = RadixCache, kv_size: int = 64, num_reqs: int = 8, context: int = 128,
                 disable: bool = False) -> None:
        self.r2t, self.kv = make_pools(kv_size, num_reqs, context)
        if cache_cls is RadixCache:
            self.cache = RadixCache(self.r2t, self.kv, disable=disable)
        else:
            self.cache = cache_cls(self.r2t, self.kv)
        self.shares = cache_cls is RadixCache and not disable
        self.slot_prefix: dict[int, tuple[int, ...]] = {}  # KV slot -> the token prefix whose last KV it holds
        self.running: list[SimpleNamespace] = []

    # ---------------------------------------------------------------- scheduler-like steps
    def alloc(self, n: int) -> torch.Tensor | None:
        if self.kv.available_size() < n:
            self.cache.evict(n - self.kv.available_size())
            self.check()
        return self.kv.alloc(n)

    def admit(self, ids: list[int]) -> SimpleNamespace | None:
        """Match, lock and give the request a row holding its cached prefix (no KV computed yet)."""
        # Like a real scheduler, leave at least one token to run so the forward produces logits.
        prefix, node = self.cache.match_prefix(ids[:-1])
        self.check_slots(ids, prefix)
        rows = self.r2t.alloc(1)
        if rows is None:
            return None
        self.cache.inc_lock_ref(node)
        self.r2t.write(rows[0], 0, prefix)
        req = SimpleNamespace(origin_input_ids=list(ids), output_ids=[], fill_ids=list(ids[:len(prefix)]),
                              prefix_indices=prefix, last_node=node, req_pool_idx=rows[0], kv=len(prefix))
        self.running.append(req)
        self.check()
        return req

    def extend(self, req: SimpleNamespace, upto: int) -> bool:
        """Compute KV for input tokens req.kv..upto-1 (one prefill chunk). False if out of memory."""
        ids = req.origin_input_ids
        new = self.alloc(upto - req.kv)
        if new is None:
            return False
        self.r2t.write(req.req_pool_idx, req.kv, new)
        for i, slot in enumerate(new.tolist()):
            self.slot_prefix[slot] = tuple(ids[:req.kv + i + 1])
        req.kv = upto
        req.fill_ids = list(ids[:upto])
        self.check()
        return True

    def prefill(self, req: SimpleNamespace, chunk: int | None = None) -> bool:
        """Prefill the whole prompt, in chunks of `chunk` tokens (cache_unfinished_req between chunks)."""
        n = len(req.origin_input_ids)
        while req.kv < n:
            upto = n if chunk is None else min(n, req.kv + chunk)
            if not self.extend(req, upto):
                return False
            if upto < n:
                self.cache.cache_unfinished_req(req)
                assert len(req.prefix_indices) == upto
                self.check_slots(req.fill_ids, self.r2t.read(req.req_pool_idx, 0, upto))
                self.check()
        req.output_ids.append(self.sample(req))
        return True

    def sample(self, req: SimpleNamespace) -> int:
        all_ids = req.origin_input_ids + req.output_ids
        return (sum(all_ids) * 7 + len(all_ids)) % 5  # deterministic, small vocabulary => shared continuations

    def decode(self, req: SimpleNamespace) -> bool:
        """Run the last sampled token through the model (one KV slot), then sample the next one."""
        all_ids = req.origin_input_ids + req.output_ids
        new = self.alloc(1)
        if new is None:
            return False
        self.r2t.write(req.req_pool_idx, req.kv, new)
        self.slot_prefix[int(new[0])] = tuple(all_ids)
        req.kv += 1
        req.output_ids.append(self.sample(req))
        self.check()
        return True

    def drop(self, req: SimpleNamespace) -> None:
        # By identity: SimpleNamespace equality would compare tensors.
        self.running = [r for r in self.running if r is not req]

    def finish(self, req: SimpleNamespace) -> None:
        self.drop(req)
        self.cache.cache_finished_req(req)
        self.check()

    def abort(self, req: SimpleNamespace, allocated_unwritten: torch.Tensor | None = None) -> None:
        """Abort with `kv_committed_len` set; slots allocated but never written are the caller's to free."""
        req.kv_committed_len = req.kv
        self.drop(req)
        self.cache.cache_finished_req(req)
        if allocated_unwritten is not None:
            self.kv.free(allocated_unwritten)
        self.check()

    def run(self, ids: list[int], decode_steps: int = 3, chunk: int | None = None) -> SimpleNamespace:
        req = self.admit(ids)
        assert req is not None
        assert self.prefill(req, chunk)
        for _ in range(decode_steps):
            assert self.decode(req)
        self.finish(req)
        return req

    # ---------------------------------------------------------------- checks
    def own_slots(self, req: SimpleNamespace) -> list[int]:
        start = len(req.prefix_indices) if self.shares else 0
        return self.r2t.read(req.req_pool_idx, start, req.kv).tolist()

    def check_slots(self, key: list[int], indices: torch.Tensor) -> None:
        assert indices.dtype == torch.int64 and indices.device.type == "cpu"
        assert len(indices) <= len(key)
        for i, slot in enumerate(indices.tolist()):
            assert self.slot_prefix[slot] == tuple(key[:i + 1]), f"slot {slot} holds the wrong token"

    def check(self) -> None:
        cache, kv = self.cache, self.kv
        own = [s for r in self.running for s in self.own_slots(r)]
        # The exact accounting invariant (running requests' own slots are the only other owner).
        assert kv.available_size() + cache.evictable_size() + cache.protected_size() + len(own) == kv.size
        assert cache.total_size() == cache.evictable_size() + cache.protected_size()
        if not isinstance(cache, RadixCache):
            assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0
            tree_slots: list[int] = []
        else:
            evictable = protected = 0
            tree_slots = []
            expected_locks: dict[int, int] = {}
            for r in self.running:
                node = r.last_node
                while node is not cache.root:
                    expected_locks[id(node)] = expected_locks.get(id(node), 0) + 1
                    node = node.parent
            for node, prefix in nodes_of(cache):
                assert len(node.key) > 0 and len(node.key) == len(node.value)
                assert node.parent.children[node.key[0]] is node
                assert node.lock_ref == expected_locks.get(id(node), 0)
                if node.lock_ref > 0:
                    protected += len(node.key)
                else:
                    evictable += len(node.key)
                vals = node.value.tolist()
                tree_slots += vals
                start = len(prefix) - len(vals)
                for i, slot in enumerate(vals):
                    assert self.slot_prefix[slot] == prefix[:start + i + 1]
            assert evictable == cache.evictable_size() and protected == cache.protected_size()
        # Every slot 1..size is owned exactly once: free list, tree, or a running request.
        everything = sorted(kv.free_slots.tolist() + tree_slots + own)
        assert everything == list(range(1, kv.size + 1))
        # Request rows: free rows + running rows.
        assert self.r2t.available_size() + len(self.running) == self.r2t.size
        for r in self.running:
            self.check_slots((r.origin_input_ids + r.output_ids)[:r.kv], self.r2t.read(r.req_pool_idx, 0, r.kv))


def take(kv: TokenToKVPool, n: int) -> torch.Tensor:
    out = kv.alloc(n)
    assert out is not None
    return out


# ====================================================================== insert / match
def test_insert_and_match_basic() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    v = take(kv, 5)
    assert cache.insert([1, 2, 3, 4, 5], v) == 0
    assert cache.evictable_size() == 5 and cache.protected_size() == 0 and cache.total_size() == 5
    idx, node = cache.match_prefix([1, 2, 3, 4, 5, 6, 7])
    assert idx.tolist() == v.tolist() and node.key == [1, 2, 3, 4, 5]
    idx, node = cache.match_prefix([9, 1])
    assert idx.numel() == 0 and idx.dtype == torch.int64 and node is cache.root
    idx, node = cache.match_prefix([])
    assert idx.numel() == 0 and node is cache.root
    # Tensor keys work like lists.
    idx, _ = cache.match_prefix(torch.tensor([1, 2, 3, 4, 5]))
    assert idx.tolist() == v.tolist()
    assert kv.available_size() + cache.evictable_size() == kv.size


def test_split_inside_node() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    v = take(kv, 5)
    cache.insert([1, 2, 3, 4, 5], v)
    idx, node = cache.match_prefix([1, 2, 3, 9])
    assert idx.tolist() == v[:3].tolist()
    assert node.key == [1, 2, 3] and node.value.tolist() == v[:3].tolist()
    assert list(node.children) == [4]
    child = node.children[4]
    assert child.key == [4, 5] and child.value.tolist() == v[3:].tolist() and child.parent is node
    assert cache.root.children[1] is node
    assert cache.total_size() == cache.evictable_size() == 5
    # Matching the whole key again walks both halves.
    idx, node2 = cache.match_prefix([1, 2, 3, 4, 5])
    assert idx.tolist() == v.tolist() and node2 is child


def test_insert_shared_prefix_returns_existing_len_and_splits() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    a = take(kv, 4)
    assert cache.insert([1, 2, 3, 4], a) == 0
    b = take(kv, 5)
    n = cache.insert([1, 2, 7, 8, 9], b)
    assert n == 2
    kv.free(b[:n])  # the caller frees the duplicated part of its value
    assert cache.total_size() == 4 + 3
    idx, _ = cache.match_prefix([1, 2, 7, 8, 9])
    assert idx.tolist() == a[:2].tolist() + b[2:].tolist()
    idx, _ = cache.match_prefix([1, 2, 3, 4])
    assert idx.tolist() == a.tolist()
    # Fully present key.
    c = take(kv, 3)
    assert cache.insert([1, 2, 3], c) == 3
    kv.free(c)
    # Extending a leaf.
    d = take(kv, 6)
    assert cache.insert([1, 2, 3, 4, 5, 6], d) == 4
    kv.free(d[:4])
    idx, node = cache.match_prefix([1, 2, 3, 4, 5, 6])
    assert idx.tolist() == a.tolist() + d[4:].tolist() and node.key == [5, 6]
    assert kv.available_size() + cache.evictable_size() + cache.protected_size() == kv.size


def test_insert_bad_input_raises() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    with pytest.raises(ValueError):
        cache.insert([1, 2, 3], torch.tensor([1, 2], dtype=torch.int64))
    with pytest.raises(TypeError):
        cache.insert([1, 2], [1, 2])  # type: ignore[arg-type]
    with pytest.raises(TypeError):
        cache.match_prefix(5)  # type: ignore[arg-type]
    with pytest.raises(ValueError):
        cache.evict(-1)
    assert cache.total_size() == 0


# ====================================================================== locks
def test_lock_accounting_exact() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)

    def inv() -> None:
        assert kv.available_size() + cache.evictable_size() + cache.protected_size() == kv.size
        assert cache.total_size() == cache.evictable_size() + cache.protected_size()

    cache.insert([1, 2, 3, 4], take(kv, 4))
    v = take(kv, 6)
    kv.free(v[:2])
    cache.insert([1, 2, 5, 6, 7, 8], v)
    inv()
    _, leaf_a = cache.match_prefix([1, 2, 3, 4])
    _, leaf_b = cache.match_prefix([1, 2, 5, 6, 7, 8])
    assert cache.inc_lock_ref(leaf_a) == 4  # [3,4] and the shared [1,2]
    assert cache.protected_size() == 4 and cache.evictable_size() == 4
    inv()
    assert cache.inc_lock_ref(leaf_b) == 4  # only [5..8]: [1,2] was already locked
    assert cache.protected_size() == 8 and cache.evictable_size() == 0
    inv()
    # A split inside a locked node keeps both halves locked and the counters unchanged.
    _, mid = cache.match_prefix([1, 2, 5, 6])
    assert mid.key == [5, 6] and mid.lock_ref == 1 and mid.children[7].lock_ref == 1
    assert cache.protected_size() == 8
    inv()
    assert cache.dec_lock_ref(leaf_a) == -2
    assert cache.protected_size() == 6 and cache.evictable_size() == 2
    inv()
    assert cache.dec_lock_ref(leaf_b) == -6
    assert cache.protected_size() == 0 and cache.evictable_size() == 8
    inv()
    with pytest.raises(ValueError):
        cache.dec_lock_ref(leaf_b)
    assert cache.protected_size() == 0 and cache.evictable_size() == 8  # a bad call changes nothing
    # Root and None are no-ops.
    assert cache.inc_lock_ref(cache.root) == 0 and cache.dec_lock_ref(cache.root) == 0
    assert cache.inc_lock_ref(None) == 0 and cache.dec_lock_ref(None) == 0
    with pytest.raises(TypeError):
        cache.inc_lock_ref("node")  # type: ignore[arg-type]


def test_lock_on_evicted_or_foreign_node_raises() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    cache.insert([1, 2], take(kv, 2))
    _, node = cache.match_prefix([1, 2])
    cache.evict(2)
    with pytest.raises(ValueError):
        cache.inc_lock_ref(node)
    other = RadixCache(*make_pools())
    other.insert([3], take(other.token_to_kv_pool, 1))
    _, foreign = other.match_prefix([3])
    with pytest.raises(ValueError):
        cache.inc_lock_ref(foreign)
    assert cache.protected_size() == 0 and cache.evictable_size() == 0


# ====================================================================== eviction
def test_lru_eviction_order() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    a, b, c = take(kv, 3), take(kv, 3), take(kv, 3)
    cache.insert([1, 1, 1], a)
    cache.insert([2, 2, 2], b)
    cache.insert([3, 3, 3], c)
    cache.match_prefix([1, 1, 1])  # A is now the most recently used; B the least
    assert cache.evict(1) == 3  # whole leaves go
    assert cache.match_prefix([2, 2, 2])[0].numel() == 0
    assert cache.match_prefix([1, 1, 1])[0].numel() == 3  # touches A again
    assert cache.evict(3) == 3
    assert cache.match_prefix([3, 3, 3])[0].numel() == 0
    assert cache.match_prefix([1, 1, 1])[0].numel() == 3
    assert kv.available_size() == kv.size - 3
    assert cache.evict(100) == 3
    assert kv.available_size() == kv.size and cache.total_size() == 0 and cache.evictable_size() == 0
    assert cache.evict(5) == 0


def test_evict_parent_becomes_leaf() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    cache.insert([1, 2, 3], take(kv, 3))
    v = take(kv, 3)
    kv.free(v[:2])
    cache.insert([1, 2, 4], v)
    other = take(kv, 2)
    cache.insert([9, 9], other)
    cache.match_prefix([9, 9])  # the [9,9] leaf is the most recent
    # Evicting 3 tokens takes both [3] and [4] leaves, then their parent [1,2] (older than [9,9]).
    assert cache.evict(3) == 4
    assert list(cache.root.children) == [9]
    assert cache.evictable_size() == 2
    assert kv.available_size() + cache.evictable_size() == kv.size


def test_locked_nodes_never_evicted() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    va = take(kv, 4)
    cache.insert([1, 2, 3, 4], va)
    vb = take(kv, 3)
    kv.free(vb[:2])
    cache.insert([1, 2, 8], vb)
    cache.insert([5, 6], take(kv, 2))
    _, leaf = cache.match_prefix([1, 2, 3, 4])
    cache.inc_lock_ref(leaf)
    assert cache.evict(1000) == 3  # [8] and [5,6]; the locked path [1,2]+[3,4] stays
    assert cache.match_prefix([1, 2, 3, 4])[0].tolist() == va.tolist()
    assert cache.protected_size() == 4 and cache.evictable_size() == 0
    assert kv.available_size() + cache.protected_size() == kv.size
    cache.dec_lock_ref(leaf)
    assert cache.evict(1000) == 4
    assert kv.available_size() == kv.size


# ====================================================================== request flows
@pytest.mark.parametrize("cache_cls", [RadixCache, ChunkCache])
def test_finished_requests_share_prefix(cache_cls: type) -> None:
    sim = Sim(cache_cls, kv_size=64)
    r1 = sim.run([1, 2, 3, 4, 5, 6], decode_steps=2)
    assert len(r1.output_ids) == 3
    r2 = sim.admit([1, 2, 3, 4, 9, 9])
    assert r2 is not None
    if cache_cls is RadixCache:
        assert len(r2.prefix_indices) == 4
        assert sim.cache.protected_size() == 4
    else:
        assert len(r2.prefix_indices) == 0
    assert sim.prefill(r2)
    assert sim.decode(r2)
    sim.finish(r2)
    # Idle: the exact invariant without running requests.
    cache = sim.cache
    assert sim.kv.available_size() + cache.evictable_size() + cache.protected_size() == sim.kv.size
    assert cache.protected_size() == 0
    if cache_cls is RadixCache:
        # r1 cached 6 + 2 decoded = 8 tokens; r2 adds 6 + 1 - 4 shared = 3.
        assert cache.evictable_size() == 8 + 3
    else:
        assert sim.kv.available_size() == sim.kv.size


def test_duplicate_kv_freed_when_same_prompt_runs_concurrently() -> None:
    sim = Sim(RadixCache, kv_size=64)
    ids = [4, 4, 4, 4, 4]
    r1, r2 = sim.admit(ids), sim.admit(ids)
    assert r1 is not None and r2 is not None
    assert sim.prefill(r1) and sim.prefill(r2)  # both computed the same KV in their own slots
    sim.finish(r1)
    before = sim.kv.available_size()
    sim.finish(r2)  # r2's 5 slots duplicate r1's and go back to the pool
    assert sim.kv.available_size() == before + 5
    assert sim.cache.total_size() == 5


def test_chunked_prefill_then_finish() -> None:
    sim = Sim(RadixCache, kv_size=64)
    ids = list(range(1, 21))
    req = sim.admit(ids)
    assert req is not None
    assert sim.extend(req, 8)
    sim.cache.cache_unfinished_req(req)
    sim.check()
    assert len(req.prefix_indices) == 8 and req.last_node.lock_ref == 1
    assert sim.cache.protected_size() == 8 and sim.cache.evictable_size() == 0
    # A concurrent request with the same start reuses the first chunk.
    other = sim.admit(ids[:8] + [30, 31])
    assert other is not None and len(other.prefix_indices) == 8
    assert sim.extend(req, 16)
    sim.cache.cache_unfinished_req(req)
    sim.check()
    assert len(req.prefix_indices) == 16 and sim.cache.protected_size() == 16
    assert sim.prefill(req)
    assert sim.decode(req)
    sim.finish(req)
    assert sim.cache.protected_size() == 8  # still locked by `other`
    assert sim.prefill(other)
    sim.finish(other)
    # req cached 20 prompt + 1 decoded token; other adds its own [30, 31].
    assert sim.cache.protected_size() == 0 and sim.cache.evictable_size() == 21 + 2
    assert sim.cache.match_prefix(ids)[0].numel() == 20


def test_chunked_prefill_duplicates_are_freed() -> None:
    """Two requests prefill the same prompt in chunks; the second's chunk slots duplicate the first's."""
    sim = Sim(RadixCache, kv_size=64)
    ids = list(range(1, 13))
    a, b = sim.admit(ids), sim.admit(ids)
    assert a is not None and b is not None
    assert sim.extend(a, 6) and sim.extend(b, 6)
    sim.cache.cache_unfinished_req(a)
    sim.check()
    free_before = sim.kv.available_size()
    sim.cache.cache_unfinished_req(b)  # b's 6 slots are duplicates: freed, b's row now points at a's
    sim.check()
    assert sim.kv.available_size() == free_before + 6
    assert b.prefix_indices.tolist() == a.prefix_indices.tolist()
    assert sim.r2t.read(b.req_pool_idx, 0, 6).tolist() == a.prefix_indices.tolist()
    assert b.last_node is a.last_node and a.last_node.lock_ref == 2
    assert sim.prefill(a, chunk=4) and sim.prefill(b, chunk=4)
    sim.finish(b)
    sim.finish(a)
    assert sim.cache.total_size() == 12 and sim.kv.available_size() + 12 == sim.kv.size


@pytest.mark.parametrize("cache_cls,disable", [(RadixCache, False), (RadixCache, True), (ChunkCache, False)])
def test_chunked_prefill_all_caches(cache_cls: type, disable: bool) -> None:
    sim = Sim(cache_cls, kv_size=128, disable=disable)
    for ids in ([1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11], [1, 2, 3, 4, 5, 6, 0, 0, 0], [7] * 13):
        sim.run(ids, decode_steps=2, chunk=3)
    if cache_cls is ChunkCache or disable:
        assert sim.kv.available_size() == sim.kv.size and sim.cache.total_size() == 0
    else:
        assert sim.kv.available_size() + sim.cache.evictable_size() == sim.kv.size
    assert sim.r2t.available_size() == sim.r2t.size


def test_abort_with_kv_committed_len() -> None:
    sim = Sim(RadixCache, kv_size=64)
    sim.run([1, 2, 3, 4, 5, 6])
    # Aborted after admission, before its prefill ran: slots were allocated but never written.
    req = sim.admit([1, 2, 3, 9, 9, 9])
    assert req is not None and len(req.prefix_indices) == 3
    unwritten = take(sim.kv, 3)
    sim.r2t.write(req.req_pool_idx, 3, unwritten)
    req.kv_committed_len = 0  # a scheduler may say "nothing computed"; the prefix is still the tree's
    sim.drop(req)
    sim.cache.cache_finished_req(req)
    sim.kv.free(unwritten)
    sim.check()
    assert sim.cache.match_prefix([1, 2, 3, 9, 9])[0].numel() == 3
    # Aborted after one chunk of three: only what was computed is cached.
    req = sim.admit([5, 5, 5, 5, 5, 5, 5, 5, 5])
    assert req is not None
    assert sim.extend(req, 3)
    sim.cache.cache_unfinished_req(req)
    assert sim.extend(req, 6)
    sim.abort(req)
    assert sim.cache.match_prefix([5] * 9)[0].numel() == 6
    # Overlap-style: the last sampled token's KV was written too (kv_committed_len == all tokens).
    req = sim.admit([6, 6, 6, 1])
    assert req is not None and sim.prefill(req)
    sim.decode(req)
    all_ids = req.origin_input_ids + req.output_ids
    last = take(sim.kv, 1)
    sim.r2t.write(req.req_pool_idx, req.kv, last)
    sim.slot_prefix[int(last[0])] = tuple(all_ids)
    req.kv += 1
    sim.abort(req)
    assert sim.cache.match_prefix(all_ids)[0].numel() == len(all_ids)
    # More KV than tokens is a caller bug.
    req = sim.admit([3, 3])
    assert req is not None
    req.kv_committed_len = 10
    with pytest.raises(ValueError):
        sim.cache.cache_finished_req(req)


def test_disabled_radix_cache_behaves_like_no_cache() -> None:
    sim = Sim(RadixCache, kv_size=64, disable=True)
    sim.run([1, 2, 3, 4])
    r = sim.admit([1, 2, 3, 4, 5])
    assert r is not None and r.prefix_indices.numel() == 0 and r.last_node is sim.cache.root
    assert sim.prefill(r)
    sim.finish(r)
    assert sim.kv.available_size() == sim.kv.size and sim.cache.total_size() == 0
    v = take(sim.kv, 2)
    assert sim.cache.insert([1, 2], v) == 2  # nothing kept: the caller frees everything
    sim.kv.free(v)
    assert sim.cache.evict(10) == 0


def test_chunk_cache_interface() -> None:
    r2t, kv = make_pools()
    cache = ChunkCache(r2t, kv)
    idx, node = cache.match_prefix([1, 2, 3])
    assert idx.numel() == 0 and node is cache.root
    assert cache.inc_lock_ref(node) == 0 and cache.dec_lock_ref(node) == 0
    v = take(kv, 3)
    assert cache.insert([1, 2, 3], v) == 3
    kv.free(v)
    assert cache.evict(10) == 0
    with pytest.raises(ValueError):
        cache.evict(-1)
    assert cache.evictable_size() == cache.protected_size() == cache.total_size() == 0


@pytest.mark.parametrize("cache_cls", [RadixCache, ChunkCache])
def test_reset(cache_cls: type, capsys: pytest.CaptureFixture[str]) -> None:
    sim = Sim(cache_cls, kv_size=64)
    sim.run([1, 2, 3, 4, 5])
    sim.run([1, 2, 3, 7])
    sim.cache.pretty_print()
    assert capsys.readouterr().out
    sim.cache.reset()
    assert sim.kv.available_size() == sim.kv.size and sim.r2t.available_size() == sim.r2t.size
    assert sim.cache.total_size() == sim.cache.evictable_size() == sim.cache.protected_size() == 0
    assert sim.cache.match_prefix([1, 2, 3, 4, 5])[0].numel() == 0
    sim.run([1, 2, 3, 4, 5])  # usable after the reset
    sim.check()


def test_cache_finished_req_without_row_raises() -> None:
    r2t, kv = make_pools()
    cache = RadixCache(r2t, kv)
    req = SimpleNamespace(origin_input_ids=[1, 2], output_ids=[3], fill_ids=[1, 2], prefix_indices=None,
                          last_node=None, req_pool_idx=None)
    with pytest.raises(ValueError):
        cache.cache_finished_req(req)


# ====================================================================== randomized
def _random_prompt(rng: random.Random, bases: list[list[int]]) -> list[int]:
    base = rng.choice(bases)
    cut = rng.randint(0, len(base))
    return base[:cut] + [rng.randrange(5) for _ in range(rng.randint(1, 8))]


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("cache_cls,disable", [(RadixCache, False), (RadixCache, True), (ChunkCache, False)])
def test_randomized(seed: int, cache_cls: type, disable: bool) -> None:
    rng = random.Random(seed)
    sim = Sim(cache_cls, kv_size=160, num_reqs=6, context=96, disable=disable)
    bases = [[rng.randrange(5) for _ in range(rng.randint(6, 24))] for _ in range(4)]
    phase: dict[int, str] = {}
    for _ in range(400):
        op = rng.random()
        if op < 0.25 and len(sim.running) < sim.r2t.size:
            req = sim.admit(_random_prompt(rng, bases))
            if req is not None:
                phase[id(req)] = "prefill"
        elif op < 0.65 and sim.running:
            req = rng.choice(sim.running)
            if phase[id(req)] == "prefill":
                n = len(req.origin_input_ids)
                chunk = rng.choice([None, 2, 5])
                upto = n if chunk is None else min(n, req.kv + chunk)
                ok = sim.extend(req, upto)
                if ok and upto < n:
                    sim.cache.cache_unfinished_req(req)
                    sim.check()
                elif ok:
                    req.output_ids.append(sim.sample(req))
                    phase[id(req)] = "decode"
            elif req.kv >= sim.r2t.max_context_len - 2:
                sim.finish(req)
                continue
            else:
                ok = sim.decode(req)
            if not ok:  # out of memory even after eviction: retract the request (its KV goes to the tree)
                sim.abort(req)
        elif op < 0.85 and sim.running:
            req = rng.choice(sim.running)
            if phase[id(req)] == "decode" and rng.random() < 0.8:
                sim.finish(req)
            else:
                sim.abort(req)
        elif op < 0.92:
            sim.cache.evict(rng.randint(0, 40))
            sim.check()
        else:
            key = _random_prompt(rng, bases)
            idx, node = sim.cache.match_prefix(key)
            sim.check_slots(key, idx)
            if sim.shares:
                # The match is maximal: the returned node has no child continuing the key.
                assert len(idx) == len(key) or key[len(idx)] not in node.children
            sim.check()
    while sim.running:
        sim.abort(sim.running[0])
    # Idle: exact invariant, then everything is evictable.
    cache = sim.cache
    assert cache.protected_size() == 0
    assert sim.kv.available_size() + cache.evictable_size() == sim.kv.size
    cache.evict(sim.kv.size)
    assert sim.kv.available_size() == sim.kv.size and cache.total_size() == 0
    assert sim.r2t.available_size() == sim.r2t.size
