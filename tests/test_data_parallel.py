"""Data parallelism: the controller's prefix tree, load balancer and reply merging in-process, then DP=2 engines
(round_robin and cache_aware) on a shared-prefix workload: every request served with the TP=1 tokens, control
messages answered once for the whole engine, and cache_aware routing turning repeated prefixes into more cache
hits than round_robin."""

from __future__ import annotations

import random

import pytest
from parallel_utils import SERVER_KW, make_model, reference_outputs, wait_idle

from radixserve import Engine
from radixserve.managers import io_struct as io
from radixserve.managers.data_parallel_controller import merge_internal_states
from radixserve.managers.dp_routing import ApproxPrefixTree, LoadBalancer
from radixserve.server_args import ServerArgs

GREEDY = {"max_new_tokens": 4, "temperature": 0, "ignore_eos": True}


# ----------------------------------------------------------------------------------------- in-process pieces
def test_prefix_tree_match_insert_split_and_evict() -> None:
    t = ApproxPrefixTree(capacity=20)
    assert t.match([1, 2, 3]) == 0
    assert t.insert([1, 2, 3, 4, 5]) == 0
    assert t.match([1, 2, 3, 9]) == 3 and t.match([1, 2, 3, 4, 5, 6]) == 5 and t.match([2]) == 0
    assert t.insert([1, 2, 7]) == 2  # splits the edge after [1, 2]
    assert t.size == 6 and t.match([1, 2, 7, 7]) == 3 and t.match([1, 2, 3, 4]) == 4
    assert t.insert([1, 2, 3, 4, 5]) == 5 and t.size == 6
    t.insert([9] * 10)  # 16 tokens
    t.insert([1, 2, 7, 8])  # [1, 2, 3, 4, 5] is now the least recently used branch
    t.insert([5] * 8)  # 25 > 20: evict down to 18, oldest leaves first
    assert t.size <= 18
    assert t.match([1, 2, 3, 4, 5]) == 2  # the old branch went, its shared head stayed
    assert t.match([5] * 8) == 8 and t.match([1, 2, 7, 8]) == 4


def _report(lb: LoadBalancer, replica: int, num_reqs: int) -> None:
    lb.on_report(replica, io.SchedulerLoadReport(num_reqs=num_reqs, num_received=lb.routed[replica]))


def test_round_robin_and_shortest_queue() -> None:
    rr = LoadBalancer("round_robin", 3)
    assert [rr.select([1]) for _ in range(7)] == [0, 1, 2, 0, 1, 2, 0]
    sq = LoadBalancer("shortest_queue", 2)
    assert [sq.select([1]) for _ in range(4)] == [0, 1, 0, 1]  # in-flight requests count before any report
    _report(sq, 0, 0)  # replica 0 finished its two, replica 1 still holds two
    _report(sq, 1, 2)
    assert [sq.select([1]) for _ in range(3)] == [0, 0, 1]  # a tie goes round robin
    assert sq.loads() == [2, 3]
    # a report that predates requests routed since is topped up with them
    sq.on_report(1, io.SchedulerLoadReport(num_reqs=0, num_received=1))
    assert sq.loads()[1] == 2


def test_cache_aware_follows_prefix_until_overloaded() -> None:
    lb = LoadBalancer("cache_aware", 2, capacities=[1000, 1000], abs_threshold=2, rel_threshold=1.5)
    a, b = [1] * 30, [2] * 30
    first_a = lb.select(a + [7])
    first_b = lb.select(b + [7])
    assert first_a != first_b  # no match anywhere: shortest queue, which spreads them
    assert [lb.select(a + [k]) for k in range(2)] == [first_a] * 2
    assert lb.cache_routed == 2
    # replica first_a now has 3 in flight and the other 1: 3 - 1 <= 2, still sticky; one more makes it 4 - 1 > 2
    assert lb.select(a + [9]) == first_a
    assert lb.select(a + [10]) == first_b  # overloaded: the prefix goes to the shortest queue instead
    _report(lb, first_a, 0)
    assert lb.select(a + [11]) == first_a  # drained: the least loaded of the replicas holding the prefix
    with pytest.raises(ValueError, match="load balance"):
        LoadBalancer("random", 2)


def test_merge_internal_states() -> None:
    a = {"idle": True, "memory_ok": True, "free_tokens": 10, "cache_hit_tokens": 4, "last_step_time": 5.0,
         "new_token_ratio": 0.3, "pid": 1, "extra": "x"}
    b = {"idle": False, "memory_ok": None, "free_tokens": 7, "cache_hit_tokens": 1, "last_step_time": 3.0,
         "new_token_ratio": 0.5, "pid": 2}
    m = merge_internal_states([a, b])
    assert m["free_tokens"] == 17 and m["cache_hit_tokens"] == 5 and not m["idle"] and m["memory_ok"] is None
    assert m["last_step_time"] == 3.0 and m["new_token_ratio"] == 0.5 and m["pids"] == [1, 2]
    assert m["extra"] == "x" and m["dp_states"] == [a, b]
    both_idle = merge_internal_states([a, {**a, "last_step_time": 9.0}])
    assert both_idle["idle"] and both_idle["memory_ok"] and both_idle["last_step_time"] == 9.0


def test_merge_internal_states_sums_grammar_queues_and_counters() -> None:
    """Requests waiting for their grammar count on every replica (the dashboard's queued requests add them to the
    waiting ones), and so do the grammar backends' counters: they were replica 0's alone."""
    grammar = {"num_grammar_queue_reqs": 2, "grammar_compiles": 3, "grammar_cache_hits": 1, "grammar_errors": 0,
               "grammar_cache_entries": 3, "grammar_compile_time_s": 0.5}
    other = {"num_grammar_queue_reqs": 1, "grammar_compiles": 2, "grammar_cache_hits": 4, "grammar_errors": 1,
             "grammar_cache_entries": 2, "grammar_compile_time_s": 0.25}
    m = merge_internal_states([grammar, other])
    assert {k: m[k] for k in grammar} == {"num_grammar_queue_reqs": 3, "grammar_compiles": 5, "grammar_cache_hits": 5,
                                          "grammar_errors": 1, "grammar_cache_entries": 5,
                                          "grammar_compile_time_s": 0.75}


def test_balance_threshold_flags_validated() -> None:
    with pytest.raises(ValueError, match="balance"):
        ServerArgs(balance_rel_threshold=0.5)
    with pytest.raises(ValueError, match="dist-init-addr"):
        ServerArgs(dist_init_addr="nohost")


# ----------------------------------------------------------------------------------------- DP=2 engines
def _workload() -> list[list[int]]:
    """12 prompts: 3 distinct 64-token prefixes, 4 prompts each with a different tail, in shuffled order."""
    rng = random.Random(0)
    prefixes = [[rng.randrange(3, 250) for _ in range(64)] for _ in range(3)]
    order = [k for k in range(3) for _ in range(4)]
    rng.shuffle(order)
    return [prefixes[k] + [rng.randrange(3, 250) for _ in range(6)] for k in order]


@pytest.fixture(scope="module")
def model_path(tmp_path_factory: pytest.TempPathFactory) -> str:
    return make_model("llama", str(tmp_path_factory.mktemp("dp_llama")), seed=5)


@pytest.fixture(scope="module")
def reference(model_path: str) -> list[list[int]]:
    return reference_outputs(model_path, _workload(), GREEDY)


def _serve_workload(model_path: str, method: str, reference: list[list[int]]) -> dict:
    prompts = _workload()
    with Engine(model_path=model_path, dp_size=2, load_balance_method=method, **SERVER_KW) as engine:
        # one at a time, so each request can find the prefixes of the ones before it
        got = [engine.generate(input_ids=p, sampling_params=GREEDY)["output_ids"] for p in prompts]
        assert got == reference
        state = wait_idle(engine)
        assert state["dp_size"] == 2 and len(state["dp_states"]) == 2
        assert state["memory_ok"] and state["invariant_violations"] == 0
        assert sum(state["dp_routed"]) == len(prompts) and state["load_balance_method"] == method
        assert state["prompt_tokens_total"] == sum(len(p) for p in prompts)
        # a concurrent batch is served too, and the control messages still get one merged answer each
        batch = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in batch] == reference
        stream = engine.generate(input_ids=prompts[0], sampling_params={**GREEDY, "max_new_tokens": 400},
                                 stream=True)
        first = next(stream)
        engine.abort_request(first["meta_info"]["id"])  # sent to both replicas; one holds it
        assert list(stream)[-1]["meta_info"]["finish_reason"]["type"] == "abort"
        _abort_n2_by_its_rid(engine, prompts[1])
        after = wait_idle(engine)
        assert after["idle"] and after["memory_ok"]
        assert engine.flush_cache()
        flushed = wait_idle(engine)
        assert flushed["evictable_tokens"] == 0 and flushed["free_tokens"] == flushed["max_total_num_tokens"]
    return state


def _abort_n2_by_its_rid(engine: Engine, prompt: list[int]) -> None:
    """Engine.abort_request(rid) of an n = 2 request aborts both samples (`rid-0`, `rid-1`: on both replicas under
    round_robin), as POST /abort_request does (it sent `rid` alone, which names no running request)."""
    stream = engine.generate(input_ids=prompt, sampling_params={**GREEDY, "max_new_tokens": 400, "n": 2},
                             stream=True, rid="dp-n2")
    started: set[int] = set()
    while started != {0, 1}:
        started.add(next(stream)["index"])
    engine.abort_request("dp-n2")
    last = {c["index"]: c for c in stream}
    assert [last[i]["meta_info"]["finish_reason"]["type"] for i in (0, 1)] == ["abort", "abort"]


@pytest.mark.integration
def test_dp2_round_robin_vs_cache_aware(model_path: str, reference: list[list[int]]) -> None:
    rr = _serve_workload(model_path, "round_robin", reference)
    assert rr["dp_routed"] == [6, 6]
    ca = _serve_workload(model_path, "cache_aware", reference)
    assert ca["dp_cache_routed"] == 9  # all but the first request of each prefix
    # every prompt after the first of its prefix finds the prefix cached: 9 x 64 tokens at least
    assert ca["cache_hit_tokens"] >= 9 * 64
    assert ca["cache_hit_tokens"] > rr["cache_hit_tokens"]
    assert ca["cache_hit_tokens"] / ca["prompt_tokens_total"] > rr["cache_hit_tokens"] / rr["prompt_tokens_total"]
