"""SchedulePolicy (the order each policy gives on a hand-built radix tree), PrefillAdder (budgets, chunking, the
cost of locking a matched prefix) and DeferredSamplingInfo (operations recorded by the scheduler, replayed in order
by the worker), with real pools on the CPU and no model."""

from __future__ import annotations

import pytest
import torch

from radixserve.managers.deferred_sampling import DeferredSamplingInfo
from radixserve.managers.schedule_batch import Req
from radixserve.managers.schedule_policy import LPM_MAX_QUEUE, PrefillAdder, SchedulePolicy
from radixserve.mem_cache.chunk_cache import ChunkCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.sampling.sampling_params import SamplingParams

P = list(range(100, 120))  # 20 tokens
Q = list(range(200, 212))  # 12 tokens


def pools(kv_size: int = 256) -> tuple[ReqToTokenPool, TokenToKVPool]:
    return ReqToTokenPool(8, 256, "cpu"), TokenToKVPool(kv_size, torch.float32, num_kv_heads=1, head_dim=2,
                                                           num_layers=1, device="cpu")


def cache_with(*prefixes: list[int], kv_size: int = 256) -> RadixCache:
    """A radix cache holding `prefixes` (unlocked, as if their requests had finished)."""
    cache = RadixCache(*pools(kv_size))
    for key in prefixes:
        value = cache.token_to_kv_pool.alloc(len(key))
        done = cache.insert(key, value)
        cache.token_to_kv_pool.free(value[:done])
    return cache


def req(rid: str, prompt: list[int], max_new: int = 8, **sp) -> Req:
    return Req(rid, prompt, SamplingParams.from_dict({"max_new_tokens": max_new, **sp}))


def rids(reqs: list[Req]) -> list[str]:
    return [r.rid for r in reqs]


def test_lpm_orders_by_longest_cached_prefix_and_says_it_matched() -> None:
    cache = cache_with(P, P[:8] + Q)
    waiting = [req("none", [7, 8, 9]), req("short", P[:8] + [1, 2]), req("q", P[:8] + Q + [5]),
               req("long", P + [3]), req("long2", P + [4])]
    assert SchedulePolicy("lpm", cache).calc_priority(waiting) is True
    assert rids(waiting) == ["q", "long", "long2", "short", "none"]  # 20, 20, 20, 8, 0 (ties: arrival order)
    assert [len(r.prefix_indices) for r in waiting] == [20, 20, 20, 8, 0]
    assert all(r.extend_input_len == len(r.fill_ids) - len(r.prefix_indices) for r in waiting)


def test_dfs_weight_runs_the_heaviest_subtree_first_deepest_matches_first() -> None:
    cache = cache_with(P, Q)
    waiting = [req("p1", P + [1]), req("n1", [7, 8]), req("q1", Q + [1]), req("p2", P[:10] + [9]),
               req("q2", Q + [2]), req("q3", Q[:5] + [3])]
    assert SchedulePolicy("dfs-weight", cache).calc_priority(waiting) is True
    # Q's subtree holds three waiting requests, P's two; within a subtree the deeper node's requests come first
    assert rids(waiting) == ["q1", "q2", "q3", "p1", "p2", "n1"]


@pytest.mark.parametrize("policy", ["fcfs", "lof", "random"])
def test_other_policies_do_not_match(policy) -> None:
    cache = cache_with(P)
    waiting = [req("a", [1, 2, 3], 4), req("b", P + [1], 30), req("c", [4, 5], 10)]
    assert SchedulePolicy(policy, cache, seed=3).calc_priority(waiting) is False
    assert all(r.last_node is None for r in waiting)
    if policy == "fcfs":
        assert rids(waiting) == ["a", "b", "c"]
    elif policy == "lof":
        assert rids(waiting) == ["b", "c", "a"]
    else:
        assert sorted(rids(waiting)) == ["a", "b", "c"]


@pytest.mark.parametrize("policy", ["lpm", "dfs-weight"])
def test_prefix_policies_fall_back_to_fcfs_and_say_so(policy) -> None:
    many = [req(f"r{i}", ([i] if i % 2 else P) + [1]) for i in range(LPM_MAX_QUEUE + 1)]
    before = rids(many)
    assert SchedulePolicy(policy, cache_with(P)).calc_priority(many) is False
    assert rids(many) == before
    chunk = [req("a", [1, 2]), req("b", P + [1])]
    assert SchedulePolicy(policy, ChunkCache(*pools())).calc_priority(chunk) is False  # nothing to share
    assert rids(chunk) == ["a", "b"]


# ------------------------------------------------------------------------------------------------ PrefillAdder
def test_adder_reserves_what_running_requests_will_still_decode() -> None:
    r2t, kv = pools(100)
    running = req("run", [1, 2, 3], 50)
    running.output_ids = [5] * 10  # 40 tokens still to come, reserved at ratio 0.5: 20
    adder = PrefillAdder(None, kv, [running], 0.5, max_prefill_tokens=1000, chunk_size=None)
    assert adder.rem_total == 80
    a = req("a", list(range(30)), 40)
    a.init_next_round_input(None)
    assert adder.add_one_req(a)  # 30 + 40 * 0.5
    assert adder.rem_total == 30 and adder.rem_input == 970
    b = req("b", list(range(20)), 40)
    b.init_next_round_input(None)
    assert not adder.add_one_req(b)  # 20 + 20 > 30
    assert adder.can_run == [a]


def test_adder_chunks_a_long_prompt_and_continues_it() -> None:
    r2t, kv = pools(256)
    adder = PrefillAdder(None, kv, [], 1.0, max_prefill_tokens=1000, chunk_size=16)
    a = req("a", list(range(3, 43)), 4)
    a.init_next_round_input(None)
    assert adder.add_one_req(a)
    assert adder.new_chunked_req is a and a.is_chunked == 1
    assert a.extend_input_len == 16 and a.fill_ids == list(range(3, 19))
    assert not adder.budget_left()  # the chunk budget is spent
    # next round: the first 16 tokens are its prefix now
    a.prefix_indices = torch.arange(16)
    a.fill_ids = a.origin_input_ids
    a.extend_input_len = 24
    nxt = PrefillAdder(None, kv, [], 1.0, max_prefill_tokens=1000, chunk_size=16)
    assert nxt.add_chunked_req(a) is a  # 16 of 24: more chunks to come
    last = PrefillAdder(None, kv, [], 1.0, max_prefill_tokens=1000, chunk_size=16)
    a.prefix_indices, a.fill_ids, a.extend_input_len = torch.arange(32), a.origin_input_ids, 8
    assert last.add_chunked_req(a) is None and a.fill_ids == a.origin_input_ids


def test_adder_counts_locking_the_matched_prefix() -> None:
    """The matched prefix was counted as evictable; locking it takes it out of the memory the batch may use."""
    cache = cache_with(P + Q, kv_size=50)  # 32 cached tokens, 18 free
    big = req("big", P + Q + list(range(300, 325)), 1, temperature=0)  # 25 new tokens on a 32-token prefix
    big.init_next_round_input(cache)
    assert len(big.prefix_indices) == 32 and big.extend_input_len == 25
    adder = PrefillAdder(cache, cache.token_to_kv_pool, [], 1.0, max_prefill_tokens=1000, chunk_size=None)
    assert adder.rem_total == 50
    # 25 + 1 would fit in 50, but with its 32-token prefix locked only 18 slots can be had
    assert not adder.add_one_req(big)
    assert cache.protected_size() == 0
    small = req("small", P + [1, 2, 3], 1)  # 20-token prefix; 3 new tokens
    small.init_next_round_input(cache)
    assert adder.add_one_req(small)
    assert cache.protected_size() == 20  # locked
    assert adder.rem_total == 50 - 20 - 3 - 1


def test_adder_refuses_an_unlocked_stale_node() -> None:
    """Locking a node that an eviction detached is an error, never a silent lock of freed KV."""
    cache = cache_with(P)
    r = req("r", P + [1])
    r.init_next_round_input(cache)
    assert cache.is_attached(r.last_node)
    cache.evict(100)
    assert not cache.is_attached(r.last_node)
    adder = PrefillAdder(cache, cache.token_to_kv_pool, [], 1.0, max_prefill_tokens=1000, chunk_size=None)
    with pytest.raises(ValueError, match="not in this radix cache"):
        adder.add_one_req(r)


# ----------------------------------------------------------------------------------------- DeferredSamplingInfo
def test_deferred_sampling_info_replays_build_filter_merge_in_order() -> None:
    a = [req("a0", [1], 4, temperature=0.5), req("a1", [1], 4, temperature=0.7), req("a2", [1], 4,
                                                                                         temperature=0.9)]
    b = [req("b0", [1], 4, temperature=0.2)]
    da, db = DeferredSamplingInfo(a, "cpu", 32), DeferredSamplingInfo(b, "cpu", 32)
    assert da.real is None  # nothing is built on the scheduler side
    da.filter_batch([0, 2])
    da.merge_batch(db)
    assert db.pending == []  # the merged batch's ops travel with the merge
    ops = da.take_ops()
    assert [op[0] for op in ops] == ["build", "filter", "merge"] and da.pending == []
    real = da.apply(ops)
    assert real.temperatures.flatten().tolist() == pytest.approx([0.5, 0.9, 0.2])
    da.filter_batch([2])
    assert da.apply(da.take_ops()).temperatures.flatten().tolist() == pytest.approx([0.2])
    with pytest.raises(RuntimeError, match="before it was built"):
        DeferredSamplingInfo([], "cpu", 32).apply([])
    with pytest.raises(ValueError, match="unknown sampling op"):
        da.apply([("bogus",)])
