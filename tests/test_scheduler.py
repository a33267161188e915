"""The scheduler in-process (no ZMQ): continuous batching, radix cache, chunked prefill, mixed chunks, policies,
retraction, aborts and bad requests — every configuration gives the same greedy tokens, and nothing leaks."""

from __future__ import annotations

import random
from types import SimpleNamespace

import pytest
from model_utils import make_tiny_model

from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model("llama", path, seed=1, vocab_size=512)
    return path


def workload(seed: int = 0, n: int = 12) -> list[tuple[str, list[int], int]]:
    """Requests with shared prefixes and mixed lengths: (rid, prompt, max_new_tokens)."""
    rng = random.Random(seed)
    system = [rng.randrange(3, 500) for _ in range(40)]
    out = []
    for i in range(n):
        tail = [rng.randrange(3, 500) for _ in range(rng.randrange(1, 60))]
        prompt = (system + tail) if i % 2 == 0 else tail + system[:rng.randrange(1, 20)]
        out.append((f"r{i}", prompt, rng.randrange(1, 24)))
    return out


def make_scheduler(path: str, **kw) -> Scheduler:
    args = dict(model_path=path, device="cpu", dtype="float32", max_total_tokens=4096, skip_tokenizer_init=True,
                random_seed=0)
    args.update(kw)
    return Scheduler(ServerArgs(**args), port_args={})


def submit(s: Scheduler, rid: str, prompt: list[int], max_new: int, **sp) -> None:
    params = SamplingParams.from_dict({"max_new_tokens": max_new, "temperature": 0, "ignore_eos": True, **sp})
    s.process_input_requests([io.TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=prompt,
                                                           sampling_params=params)])


def drain(s: Scheduler, max_steps: int = 5000) -> dict[str, dict]:
    results: dict[str, dict] = {}
    for _ in range(max_steps):
        if not s.step() and s.is_idle():
            break
    else:
        raise RuntimeError("scheduler did not go idle")
    for msg in s.outbox:
        if isinstance(msg, io.BatchTokenIDOut):
            for rid, ids, fin, meta in zip(msg.rids, msg.new_token_ids, msg.finished_reasons, msg.meta_infos,
                                           strict=True):
                r = results.setdefault(rid, {"ids": [], "finish": None, "meta": None})
                r["ids"] += ids
                r["finish"], r["meta"] = fin, meta
    s.outbox.clear()
    assert s.check_memory(), s.get_internal_state()
    return results


def run(path: str, reqs, **kw) -> dict[str, list[int]]:
    s = make_scheduler(path, **kw)
    for rid, prompt, n in reqs:
        submit(s, rid, prompt, n)
    res = drain(s)
    assert s.invariant_violations == 0
    return {rid: r["ids"] for rid, r in res.items()}


@pytest.fixture(scope="module")
def reference(tiny_path) -> dict[str, list[int]]:
    """Each request alone, radix cache off, no chunking."""
    out = {}
    s = make_scheduler(tiny_path, disable_radix_cache=True, chunked_prefill_size=-1)
    for rid, prompt, n in workload():
        submit(s, rid, prompt, n)
        out[rid] = drain(s)[rid]["ids"]
    return out


@pytest.mark.parametrize("kw", [
    {},
    {"disable_radix_cache": True},
    {"chunked_prefill_size": 16},
    {"chunked_prefill_size": 16, "disable_radix_cache": True},
    {"enable_mixed_chunk": True, "chunked_prefill_size": 16},
    {"max_prefill_tokens": 64, "max_running_requests": 3},
    {"schedule_policy": "lpm"},
    {"schedule_policy": "dfs-weight"},
    {"schedule_policy": "lof"},
    {"schedule_policy": "random"},
    {"enable_overlap_schedule": True},
    {"enable_overlap_schedule": True, "chunked_prefill_size": 16},
    {"enable_overlap_schedule": True, "enable_mixed_chunk": True, "chunked_prefill_size": 16},
    {"enable_overlap_schedule": True, "disable_radix_cache": True, "chunked_prefill_size": 16},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
@pytest.mark.parametrize("page_size", [1, 16])
def test_configs_give_identical_tokens(tiny_path, reference, kw, page_size) -> None:
    assert run(tiny_path, workload(), page_size=page_size, **kw) == reference


def test_cached_tokens_reported_for_repeated_prefix(tiny_path) -> None:
    s = make_scheduler(tiny_path)
    prompt = list(range(10, 60))
    submit(s, "a", prompt, 4)
    first = drain(s)["a"]
    submit(s, "b", prompt + [7, 8], 4)
    second = drain(s)["b"]
    assert first["meta"]["cached_tokens"] == 0
    assert second["meta"]["cached_tokens"] >= len(prompt)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
def test_tiny_pool_forces_retraction_and_every_request_finishes(tiny_path, reference, overlap, page_size) -> None:
    # a low reservation ratio admits more than fits, so decoding must retract
    s = make_scheduler(tiny_path, max_total_tokens=200 if page_size == 1 else 128, chunked_prefill_size=-1,
                       schedule_conservativeness=0.05, enable_overlap_schedule=overlap, page_size=page_size)
    for rid, prompt, n in workload():
        submit(s, rid, prompt, n)
    res = drain(s)
    assert {rid: r["ids"] for rid, r in res.items()} == reference
    assert s.num_retractions > 0
    assert s.invariant_violations == 0


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
def test_abort_queued_and_running_frees_everything(tiny_path, overlap, page_size) -> None:
    s = make_scheduler(tiny_path, max_running_requests=2, enable_overlap_schedule=overlap, page_size=page_size)
    for i in range(5):
        submit(s, f"x{i}", list(range(5, 30 + i)), 50)
    s.step()  # x0, x1 prefilled; the rest wait
    s.step()
    s.process_input_requests([io.AbortReq("x0"), io.AbortReq("x3")])
    res = drain(s)
    assert res["x0"]["finish"]["type"] == "abort"
    assert res["x3"]["finish"]["type"] == "abort" and res["x3"]["ids"] == []
    for rid in ("x1", "x2", "x4"):
        assert res[rid]["finish"]["type"] == "length" and len(res[rid]["ids"]) == 50


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("overlap", [False, True])
def test_abort_while_chunked_prefill(tiny_path, overlap, page_size) -> None:
    s = make_scheduler(tiny_path, chunked_prefill_size=8, enable_overlap_schedule=overlap, page_size=page_size)
    submit(s, "long", list(range(3, 100)), 5)
    s.step()
    assert s.chunked_req is not None
    s.process_input_requests([io.AbortReq("long")])
    res = drain(s)
    assert res["long"]["finish"]["type"] == "abort"


@pytest.mark.parametrize("prompt,msg", [([], "empty"), ([1] * 600, "context length"), ([5, 100000], "range")])
def test_bad_requests_fail_alone(tiny_path, prompt, msg) -> None:
    s = make_scheduler(tiny_path)
    submit(s, "good", [5, 6, 7], 6)
    s.process_input_requests([io.TokenizedGenerateReqInput(
        rid="bad", input_text=None, input_ids=prompt,
        sampling_params=SamplingParams.from_dict({"max_new_tokens": 4}))])
    res = drain(s)
    assert res["bad"]["finish"]["type"] == "abort" and msg in res["bad"]["finish"]["message"]
    assert len(res["good"]["ids"]) == 6


@pytest.mark.parametrize("page_size", [1, 16])
def test_a_prompt_too_long_for_the_pool_is_told_the_longest_it_takes(tiny_path, page_size) -> None:
    """With pages admission keeps a page of slack beside a prompt: a 114-token prompt does not fit a 128-token pool
    of 16-token pages, and the error says how long a prompt may be (it said 114 tokens did not fit 128); one of
    that length runs."""
    s = make_scheduler(tiny_path, max_total_tokens=128, page_size=page_size)
    longest = 128 - page_size
    submit(s, "long", list(range(10, 10 + longest + 1)), 4)
    submit(s, "fits", list(range(10, 10 + longest)), 4)
    res = drain(s)
    assert res["long"]["finish"]["type"] == "abort"
    assert f"at most {longest} prompt tokens" in res["long"]["finish"]["message"]
    assert res["fits"]["finish"]["type"] == "length" and len(res["fits"]["ids"]) == min(4, 128 - longest)


def sampled_workload() -> list[tuple[str, list[int], dict]]:
    """Requests mixing greedy, seeded sampling, every penalty, logit bias, stop ids and logprobs."""
    rng = random.Random(5)
    kinds = [
        {"temperature": 0},
        {"temperature": 0.9, "seed": 11, "top_p": 0.9},
        {"temperature": 0.7, "seed": 3, "top_k": 20, "min_p": 0.05},
        {"temperature": 0, "frequency_penalty": 1.5, "presence_penalty": 0.5},
        {"temperature": 0, "repetition_penalty": 1.8},
        {"temperature": 0, "min_new_tokens": 6, "stop_token_ids": [2, 3, 4, 5, 6, 7]},
        {"temperature": 0, "logit_bias": {"17": 5.0, "33": -100}},
        {"temperature": 1.2, "seed": 99, "frequency_penalty": 0.8},
        {"temperature": 0, "stop_token_ids": [100, 101, 102, 103, 104, 105, 106, 107]},
    ]
    out = []
    for i in range(18):
        prompt = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 50))]
        out.append((f"s{i}", prompt, {**kinds[i % len(kinds)], "max_new_tokens": rng.randrange(8, 30)}))
    return out


def run_sampled(path: str, **kw) -> dict[str, dict]:
    s = make_scheduler(path, **kw)
    for rid, prompt, sp in sampled_workload():
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=prompt, sampling_params=SamplingParams.from_dict(sp),
            return_logprob=True, top_logprobs_num=2, logprob_start_len=0 if rid == "s0" else -1)])
    return drain(s)


@pytest.mark.parametrize("kw", [{}, {"chunked_prefill_size": 16, "enable_mixed_chunk": True},
                                {"max_total_tokens": 400, "schedule_conservativeness": 0.05}],
                         ids=["plain", "chunked-mixed", "retracting"])
@pytest.mark.parametrize("page_size", [1, 16])
def test_overlap_gives_identical_outputs_with_sampling_features(tiny_path, kw, page_size) -> None:
    off = run_sampled(tiny_path, page_size=page_size, **kw)
    on = run_sampled(tiny_path, enable_overlap_schedule=True, page_size=page_size, **kw)
    assert off.keys() == on.keys()
    for rid in off:
        assert on[rid]["ids"] == off[rid]["ids"], rid
        assert on[rid]["finish"] == off[rid]["finish"], rid
    # stops, min_new_tokens and logprobs really were exercised
    assert any(r["finish"]["type"] == "stop" for r in off.values())
    min_new = [r for rid, r in off.items() if int(rid[1:]) % 9 == 5]
    assert all(len(r["ids"]) >= 6 for r in min_new)


@pytest.mark.parametrize("page_size", [1, 16])
def test_logprobs_identical_under_overlap(tiny_path, page_size) -> None:
    def collect(overlap: bool) -> dict[str, list]:
        s = make_scheduler(tiny_path, enable_overlap_schedule=overlap, page_size=page_size)
        for rid, prompt, sp in sampled_workload()[:9]:
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=rid, input_text=None, input_ids=prompt, sampling_params=SamplingParams.from_dict(sp),
                return_logprob=True, top_logprobs_num=2)])
        lps: dict[str, list] = {}
        for _ in range(2000):
            if not s.step() and s.is_idle():
                break
        for msg in s.outbox:
            for rid, meta in zip(msg.rids, msg.meta_infos, strict=True):
                lps.setdefault(rid, []).extend(meta.get("output_token_logprobs", []))
        return lps

    off, on = collect(False), collect(True)
    for rid in off:
        assert len(off[rid]) == len(on[rid]) > 0
        for (a, ta), (b, tb) in zip(off[rid], on[rid], strict=True):
            assert ta == tb and a == pytest.approx(b, abs=1e-5)


@pytest.mark.parametrize("page_size", [1, 16])
def test_requests_sharing_a_new_prefix_in_one_round_share_it(tiny_path, page_size) -> None:
    """Two requests arriving together with the same uncached 40-token head: the second waits one round and then
    reuses the first one's KV instead of computing the head twice (and disable-radix-cache does not wait). With
    pages the whole pages of the head are shared."""
    head = list(range(100, 140))
    s = make_scheduler(tiny_path, page_size=page_size)
    submit(s, "first", head + [1, 2], 3)
    submit(s, "second", head + [3, 4], 3)
    res = drain(s)
    assert res["first"]["meta"]["cached_tokens"] == 0
    assert res["second"]["meta"]["cached_tokens"] >= len(head) - len(head) % page_size
    plain = make_scheduler(tiny_path, disable_radix_cache=True)
    submit(plain, "first", head + [1, 2], 3)
    submit(plain, "second", head + [3, 4], 3)
    plain.step()
    assert plain.running_batch is None and len(plain.last_batch.reqs) == 2
    drain(plain)


@pytest.mark.parametrize("page_size", [1, 16])
@pytest.mark.parametrize("mixed", [False, True])
def test_a_head_in_flight_is_computed_once_under_overlap(tiny_path, page_size, mixed) -> None:
    """Overlap: the next batch is scheduled while the last prefill is still in flight, before its prompts reach
    the tree. A request arriving then with the same uncached head waits a round (as it would behind a request of
    its own batch) and takes the head from the cache; without overlap it finds the head cached at once."""
    head = list(range(100, 140))
    kw = {"enable_mixed_chunk": True, "chunked_prefill_size": 64} if mixed else {}
    for overlap in (False, True):
        s = make_scheduler(tiny_path, page_size=page_size, enable_overlap_schedule=overlap, **kw)
        submit(s, "first", head + [1, 2], 6)
        s.step()
        submit(s, "second", head + [3, 4], 3)
        submit(s, "other", [7, 8, 9], 3)  # shares nothing: admitted at once
        s.step()
        names = [r.rid for r in s.last_batch.reqs]
        assert "other" in names and ("second" in names) == (not overlap)
        res = drain(s)
        assert res["first"]["meta"]["cached_tokens"] == 0
        assert res["second"]["meta"]["cached_tokens"] >= len(head) - len(head) % page_size, overlap
        assert s.cache_hit_tokens == res["second"]["meta"]["cached_tokens"]


def test_prompt_logprobs_with_chunked_prefill(tiny_path) -> None:
    """A request asking for prompt logprobs is prefilled whole even when chunking is on, so none are missing."""
    prompt = list(range(50, 90))

    def run_one(**kw) -> dict:
        s = make_scheduler(tiny_path, **kw)
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid="p", input_text=None, input_ids=prompt,
            sampling_params=SamplingParams.from_dict({"max_new_tokens": 3, "temperature": 0}),
            return_logprob=True, logprob_start_len=0, top_logprobs_num=1)])
        return drain(s)["p"]["meta"]

    whole, chunked = run_one(), run_one(chunked_prefill_size=8)
    assert len(chunked["input_token_logprobs"]) == len(prompt)
    for (a, ta), (b, tb) in zip(whole["input_token_logprobs"], chunked["input_token_logprobs"], strict=True):
        assert ta == tb and (a is None) == (b is None) and (a is None or abs(a - b) < 1e-5)


@pytest.mark.parametrize("overlap", [False, True])
def test_prompt_logprobs_of_a_request_decoding_in_mixed_steps(tiny_path, overlap: bool) -> None:
    """A request with prompt logprobs decodes riding along another prompt's chunks (MIXED): its prompt logprobs are
    those of its own prefill (under overlap its first MIXED step was launched before that prefill's result was
    processed, so its decode row was given a logprob start and its one entry replaced the prompt's)."""
    prompt = list(range(10, 30))

    def run_one(other: bool) -> dict:
        s = make_scheduler(tiny_path, enable_mixed_chunk=True, chunked_prefill_size=8,
                           enable_overlap_schedule=overlap)
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid="p", input_text=None, input_ids=prompt,
            sampling_params=SamplingParams.from_dict({"max_new_tokens": 6, "temperature": 0}),
            return_logprob=True, logprob_start_len=0, top_logprobs_num=1)])
        s.step()
        if other:
            submit(s, "other", list(range(40, 80)), 2)
        return drain(s)["p"]["meta"]

    alone, riding = run_one(False), run_one(True)
    assert len(riding["input_token_logprobs"]) == len(alone["input_token_logprobs"]) == len(prompt)
    for (a, ta), (b, tb) in zip(alone["input_token_logprobs"], riding["input_token_logprobs"], strict=True):
        assert ta == tb and (a is None) == (b is None) and (a is None or abs(a - b) < 1e-5)
    assert len(riding["input_top_logprobs"]) == len(prompt)


def test_scheduler_uses_the_tokenizer_path_flag(tiny_path, embedded_model_path) -> None:
    """--tokenizer-path names where the scheduler's tokenizer (stop strings, grammars) comes from, not the model
    folder (which here has no tokenizer at all)."""
    s = Scheduler(ServerArgs(model_path=tiny_path, tokenizer_path=embedded_model_path, device="cpu",
                             max_total_tokens=512, max_running_requests=4), port_args={})
    assert s.tokenizer is not None
    assert s.tokenizer.encode("The capital of France", add_special_tokens=False)  # a real vocabulary
    assert s.tokenizer.name_or_path == embedded_model_path


def test_batch_stats_are_logged(tiny_path, caplog) -> None:
    """A prefill line per prefill batch and a decode line every --decode-log-interval decode steps."""
    import logging

    s = make_scheduler(tiny_path, decode_log_interval=5)
    for i in range(3):
        submit(s, f"r{i}", [5 + i, 6, 7, 8], 12)
    with caplog.at_level(logging.INFO, logger="radixserve.managers.scheduler"):
        drain(s)
    prefill = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch")]
    decode = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Decode batch")]
    assert prefill and "#new-seq 3, #new-token 12" in prefill[0]
    assert len(decode) == 2  # 11 decode steps at an interval of 5
    assert "#running-req 3" in decode[0] and "gen throughput (token/s)" in decode[0]
    with pytest.raises(ValueError, match="decode-log-interval"):
        ServerArgs(model_path=tiny_path, decode_log_interval=0)


def test_mixed_batch_stats_count_only_the_prefill(tiny_path, caplog) -> None:
    """A MIXED step's line counts its prefill requests' new and cached tokens; the decodes riding along are their
    own count, not new sequences with their whole context as cached tokens."""
    import logging

    s = make_scheduler(tiny_path, enable_mixed_chunk=True)
    for i in range(2):
        submit(s, f"d{i}", [5 + i, 6, 7, 8, 9, 10], 20)
    s.step()
    s.step()  # both decode now
    submit(s, "late", [11, 12, 13], 4)
    with caplog.at_level(logging.INFO, logger="radixserve.managers.scheduler"):
        s.step()
    lines = [r.getMessage() for r in caplog.records if r.getMessage().startswith("Prefill batch")]
    assert len(lines) == 1, lines
    assert "#new-seq 1, #new-token 3, #cached-token 0," in lines[0] and lines[0].endswith("#mixed-decode 2")
    drain(s)


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("page_size", [1, 16])
def test_warmup_leaves_no_trace(tiny_path, reference, overlap, page_size) -> None:
    """The start-up warm-up (run on CUDA before the scheduler reports ready) sends nothing, frees every slot, resets
    the counters and the cache, and later requests give the same tokens as without it."""
    s = make_scheduler(tiny_path, enable_overlap_schedule=overlap, page_size=page_size)
    sent: list = []
    s.send_to_detokenizer = SimpleNamespace(send_pyobj=sent.append)  # a socket: the warm-up must not use it
    s.warmup()
    assert sent == [] and s.outbox == []
    state = s.get_internal_state()
    assert state["idle"] and state["memory_ok"] and state["invariant_violations"] == 0
    assert state["forward_ct"] == 0 and state["prompt_tokens_total"] == 0 and state["cache_hit_tokens"] == 0
    assert state["evictable_tokens"] == 0 and state["free_tokens"] == s.token_to_kv_pool.size
    s.send_to_detokenizer = None
    for rid, prompt, n in workload():
        submit(s, rid, prompt, n)
    assert {rid: r["ids"] for rid, r in drain(s).items()} == reference
    s.warmup()  # again, after serving: still clean
    assert s.is_idle() and s.check_memory()
    if s.worker_client is not None:
        s.worker_client.shutdown()


@pytest.mark.parametrize("overlap", [False, True])
@pytest.mark.parametrize("budget", [0, 256])
def test_warmup_runs_the_step_kinds_serving_meets(tiny_path, overlap, budget) -> None:
    """The warm-up compiles kernels by running them: a fresh prefill, decode steps, a prefill on a radix hit and,
    with a step token budget (the default on one GPU), a prefill with a decode riding along (MIXED)."""
    from radixserve.model_executor.forward_batch_info import ForwardMode

    s = make_scheduler(tiny_path, enable_overlap_schedule=overlap, step_token_budget=budget)
    seen: list[tuple[ForwardMode, int, int]] = []
    run = s.run_batch

    def recording(batch):
        seen.append((batch.forward_mode, len(batch.reqs), sum(batch.prefix_lens or [0])))
        return run(batch)

    s.run_batch = recording
    s.warmup()
    modes = {m for m, _, _ in seen}
    assert ForwardMode.EXTEND in modes and ForwardMode.DECODE in modes
    assert any(m == ForwardMode.EXTEND and pre > 0 for m, _, pre in seen)  # the radix hit
    mixed = [n for m, n, _ in seen if m == ForwardMode.MIXED]
    assert (mixed != []) == bool(budget) and all(n == 2 for n in mixed)  # the longer prompt and the first's decode
    assert s.is_idle() and s.check_memory()
    if s.worker_client is not None:
        s.worker_client.shutdown()


def test_warmup_refuses_a_busy_scheduler(tiny_path) -> None:
    s = make_scheduler(tiny_path)
    submit(s, "busy", [5, 6, 7], 3)
    with pytest.raises(RuntimeError, match="idle"):
        s.warmup()
    drain(s)


def test_stale_prefix_match_is_rematched_not_locked(tiny_path) -> None:
    """lpm matches the waiting requests each round, but above LPM_MAX_QUEUE it orders fcfs without matching. A
    match left from an earlier round whose node was evicted since must be matched again (it used to be locked:
    the scheduler raised and the process exited), and the request must not read the freed KV."""
    from radixserve.managers.schedule_policy import LPM_MAX_QUEUE

    prompt = list(range(10, 50))
    alone = make_scheduler(tiny_path)
    submit(alone, "b", prompt + [7, 8], 4)
    expected = drain(alone)["b"]["ids"]

    s = make_scheduler(tiny_path, schedule_policy="lpm")
    submit(s, "a", prompt, 2)
    drain(s)
    submit(s, "b", prompt + [7, 8], 4)
    assert s.policy.calc_priority(s.waiting_queue) is True  # an earlier round's match: b on a's cached prompt
    stale = s.waiting_queue[0].last_node
    s.tree_cache.evict(10**6)
    assert not s.tree_cache.is_attached(stale)
    for i in range(LPM_MAX_QUEUE):  # a long queue: this round orders without matching
        submit(s, f"f{i}", [3 + i % 400, 4, 5], 1)
    res = drain(s)
    assert res["b"]["ids"] == expected and res["b"]["meta"]["cached_tokens"] == 0
    assert all(res[f"f{i}"]["finish"]["type"] == "length" for i in range(LPM_MAX_QUEUE))


@pytest.mark.parametrize("policy,page_size", [("fcfs", 1), ("lpm", 1), ("dfs-weight", 1), ("lof", 1), ("random", 1),
                                              ("fcfs", 16), ("lpm", 16)])
def test_memory_pressure_every_policy_finishes_everything(tiny_path, policy, page_size) -> None:
    """A tiny pool, long decodes and a queue of requests sharing prefixes (more prefixes than fit at once): every
    request finishes with the tokens it gets alone, retraction happens, and the pools balance when idle."""
    rng = random.Random(7)
    heads = [[rng.randrange(3, 500) for _ in range(30)] for _ in range(4)]
    reqs = [(f"m{i}", heads[i % 4] + [rng.randrange(3, 500) for _ in range(rng.randrange(2, 8))], 40)
            for i in range(12)]
    ref = {}
    for rid, prompt, n in reqs[:3]:
        alone = make_scheduler(tiny_path, disable_radix_cache=True)
        submit(alone, rid, prompt, n)
        ref[rid] = drain(alone)[rid]["ids"]
    s = make_scheduler(tiny_path, max_total_tokens=260, schedule_policy=policy, schedule_conservativeness=0.1,
                       page_size=page_size)
    for rid, prompt, n in reqs:
        submit(s, rid, prompt, n)
    res = drain(s)  # checks free + evictable + protected == pool size
    assert s.invariant_violations == 0
    assert all(res[rid]["finish"]["type"] == "length" and len(res[rid]["ids"]) == n for rid, _, n in reqs)
    assert {rid: res[rid]["ids"] for rid in ref} == ref
    assert s.num_retractions > 0


def test_trust_remote_code_reaches_the_tokenizer(tiny_path, embedded_model_path, tmp_path) -> None:
    """A tokenizer with its own code in the folder loads with --trust-remote-code, and is refused without it."""
    import json
    import shutil

    tok = tmp_path / "tok"
    tok.mkdir()
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(f"{embedded_model_path}/{name}", tok / name)
    (tok / "tokenization_marked.py").write_text(
        "from transformers import PreTrainedTokenizerFast\n\n\nclass MarkedTokenizer(PreTrainedTokenizerFast):\n"
        "    marked = True\n")
    cfg = json.loads((tok / "tokenizer_config.json").read_text())
    cfg.update(auto_map={"AutoTokenizer": [None, "tokenization_marked.MarkedTokenizer"]},
               tokenizer_class="MarkedTokenizer")
    (tok / "tokenizer_config.json").write_text(json.dumps(cfg))
    kw = dict(model_path=tiny_path, tokenizer_path=str(tok), device="cpu", max_total_tokens=512, max_running_requests=4)
    s = Scheduler(ServerArgs(**kw, trust_remote_code=True), port_args={})
    assert type(s.tokenizer).__name__ == "MarkedTokenizer" and s.tokenizer.marked
    with pytest.raises(ValueError, match="custom code"):
        Scheduler(ServerArgs(**kw), port_args={})


def test_max_queued_requests_counts_waiting_requests_only(tiny_path) -> None:
    """Two requests running and three waiting fill --max-queued-requests 3: the next one is a 503 for itself
    alone; running requests do not count, so once the queue drains new requests are taken again."""
    s = make_scheduler(tiny_path, max_running_requests=2, max_queued_requests=3)
    for i in range(2):
        submit(s, f"run{i}", [5, 6, 7 + i], 30)
    s.step()
    assert len(s.last_batch.reqs) == 2 and not s.waiting_queue
    for i in range(4):
        submit(s, f"q{i}", [8, 9, 10 + i], 3)
    assert [r.rid for r in s.waiting_queue] == ["q0", "q1", "q2"]
    res = drain(s)
    assert res["q3"]["finish"]["type"] == "abort" and res["q3"]["finish"]["status_code"] == 503
    assert "--max-queued-requests 3" in res["q3"]["finish"]["message"]
    assert all(len(res[r]["ids"]) == 3 for r in ("q0", "q1", "q2"))
    assert all(len(res[f"run{i}"]["ids"]) == 30 for i in range(2))


@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_backend_gives_identical_tokens(tiny_path, reference, page_size) -> None:
    # a small pool: on the CPU flex_attention scores every slot of the pool
    kw = {"attention_backend": "flex", "page_size": page_size, "chunked_prefill_size": 16, "max_total_tokens": 1024}
    reqs = workload()[:6]
    assert run(tiny_path, reqs, **kw) == {rid: reference[rid] for rid, _, _ in reqs}


def test_a_chat_templates_short_shared_head_is_computed_once_on_the_cpu(tiny_path) -> None:
    """On the CPU a shared uncached head of 16-31 tokens (a chat template's system prompt) is enough: the requests
    arriving with it wait one round behind the first and take the head from the cache."""
    from radixserve.managers.scheduler import IN_BATCH_PREFIX_LEN, IN_BATCH_PREFIX_LEN_CPU

    head = list(range(100, 100 + IN_BATCH_PREFIX_LEN_CPU + 4))
    assert len(head) < IN_BATCH_PREFIX_LEN  # shorter than what the GPU rule compares
    s = make_scheduler(tiny_path)
    for i in range(4):
        submit(s, f"r{i}", head + [1 + i, 2 + i], 3)
    s.step()
    assert [r.rid for r in s.last_batch.reqs] == ["r0"]  # the others wait one round
    res = drain(s)
    assert res["r0"]["meta"]["cached_tokens"] == 0
    for i in range(1, 4):
        assert res[f"r{i}"]["meta"]["cached_tokens"] == len(head)


def test_a_stop_on_the_last_allowed_token_is_a_stop() -> None:
    """An end-of-sequence token, a stop token or a stop string that lands on the max_new_tokens-th token finishes
    the request as a stop (the stop string then trimmed from the text), not as a length finish."""
    from radixserve.managers.finish_reason import FinishLength, FinishMatchedStr, FinishMatchedToken
    from radixserve.managers.schedule_batch import Req
    from radixserve.sampling.sampling_params import SamplingParams

    class Chars:  # token id i decodes to chr(i)
        def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
            return "".join(chr(i) for i in ids)

    def run(outputs: list[int], **sp: object) -> object:
        req = Req("r", [1, 2], SamplingParams.from_dict({"max_new_tokens": len(outputs), **sp}), eos_token_ids={2})
        for t in outputs:
            assert req.finished_reason is None
            req.output_ids.append(t)
            req.check_finished(Chars())
        return req.finished_reason

    assert isinstance(run([65, 2]), FinishMatchedToken)
    assert isinstance(run([65, 66], stop_token_ids=[66]), FinishMatchedToken)
    stop = run([52, 44, 32, 54], stop=[", 6"])
    assert isinstance(stop, FinishMatchedStr) and stop.matched == ", 6"
    assert isinstance(run([65, 66]), FinishLength) and isinstance(run([65, 2], ignore_eos=True), FinishLength)


# --------------------------------------------------------------------- chunks, pages and memory at their edges
def _alone(path: str, prompt: list[int], n: int) -> list[int]:
    return run(path, [("x", prompt, n)], disable_radix_cache=True, chunked_prefill_size=-1)["x"]


@pytest.mark.parametrize("extra", [{}, {"enable_overlap_schedule": True}, {"disable_radix_cache": True}])
def test_one_chunked_prompt_at_a_time_with_pages(tiny_path, extra: dict) -> None:
    """Page 16 and a 24-token chunk: a chunk cut to a page boundary leaves budget, yet a second long prompt arriving
    meanwhile waits for the first to finish its chunks (it replaced it as the chunked request, and the first then
    sampled from a half-read prompt); a prompt whose page-aligned chunk is all of it runs as one extend (a second,
    empty one crashed); every output equals the request run alone."""
    a = [(7 * i) % 400 + 20 for i in range(100)]
    b = [(11 * i) % 400 + 30 for i in range(60)]
    s = make_scheduler(tiny_path, page_size=16, chunked_prefill_size=24, **extra)
    submit(s, "a", a, 8)
    s.step()
    submit(s, "b", b, 8)
    res = drain(s)
    assert res["a"]["ids"] == _alone(tiny_path, a, 8) and res["b"]["ids"] == _alone(tiny_path, b, 8)
    c, d = [(5 * i) % 400 + 9 for i in range(43)], [(3 * i) % 400 + 7 for i in range(16)]
    for chunk, reqs in ((8, [("d", d, 4)]), (16, [("c", c, 4), ("d", d, 4)])):
        got = run(tiny_path, reqs, page_size=16, chunked_prefill_size=chunk, **extra)
        assert got == {rid: _alone(tiny_path, p, n) for rid, p, n in reqs}, chunk


@pytest.mark.parametrize("extra", [{}, {"page_size": 4}, {"disable_radix_cache": True}])
def test_prefill_only_requests_under_overlap(tiny_path, extra: dict) -> None:
    """max_new_tokens 0 (n > 1's shared prompt, embeddings) under overlap scheduling: the request ends with its
    prefill, with no token, and never joins the decode batch (it was given a decode slot, and the scheduler then
    failed on a KV row longer than its tokens)."""
    s = make_scheduler(tiny_path, enable_overlap_schedule=True, **extra)
    submit(s, "z", list(range(10, 60)), 0)
    submit(s, "y", list(range(10, 40)), 3)
    res = drain(s)
    assert res["z"]["ids"] == [] and res["z"]["finish"] == {"type": "length", "length": 0}
    assert res["y"]["ids"] == _alone(tiny_path, list(range(10, 40)), 3)


def test_prefill_only_requests_keep_their_slots_until_processed_under_overlap(tiny_path) -> None:
    """Under overlap two prefill-only requests leave the batch before their result is processed and hold their
    request slots until then; the next prefill admits no more requests than there are free slots (it counted only
    the running batch against --max-running-requests, and failed with "out of request slots")."""
    s = make_scheduler(tiny_path, enable_overlap_schedule=True, max_running_requests=2)
    submit(s, "a-prefill", [5, 6, 7, 8], 0)
    submit(s, "b-prefill", [9, 10, 11, 12], 0)
    s.step()
    submit(s, "c", [13, 14, 15], 4)
    submit(s, "d", [16, 17, 18], 4)
    res = drain(s)
    assert res["a-prefill"]["finish"] == res["b-prefill"]["finish"] == {"type": "length", "length": 0}
    assert res["c"]["ids"] == _alone(tiny_path, [13, 14, 15], 4)
    assert res["d"]["ids"] == _alone(tiny_path, [16, 17, 18], 4)
    # embeddings are all prefill-only: a burst of them under overlap (CUDA's default) took the scheduler down
    e = make_scheduler(tiny_path, is_embedding=True, enable_overlap_schedule=True, max_running_requests=4)
    for i in range(12):
        e.process_input_requests([io.TokenizedGenerateReqInput(
            rid=f"e{i}", input_text=None, input_ids=list(range(5 + i, 15 + i)),
            sampling_params=SamplingParams.from_dict({"max_new_tokens": 0}), pooling="last")])
    assert len(drain(e)) == 12


@pytest.mark.parametrize("extra", [{}, {"enable_overlap_schedule": True}, {"page_size": 4}])
def test_decodes_riding_with_chunks_do_not_run_the_pool_dry(tiny_path, extra: dict) -> None:
    """A small pool, mixed chunks and a low reservation ratio: the decodes riding along use what admission left
    the chunked prompt, so its next chunk takes only the memory left, and when the decode itself is short the
    chunked prompt waits (its chunks cached) instead of the pool running dry; outputs equal the requests alone."""
    a, b = list(range(10, 20)), [(7 * i) % 400 + 20 for i in range(120)]
    s = make_scheduler(tiny_path, max_total_tokens=140, chunked_prefill_size=16, schedule_conservativeness=0.05,
                       enable_mixed_chunk=True, **extra)
    submit(s, "a", a, 100)
    for _ in range(5):
        s.step()
    submit(s, "b", b, 10)
    res = drain(s)
    assert res["a"]["ids"] == _alone(tiny_path, a, 100) and res["b"]["ids"] == _alone(tiny_path, b, 10)
    assert s.num_retractions >= 1 or "page_size" in extra  # (with pages the reservation differs: no wait needed)
    assert s.get_internal_state()["prompt_tokens_total"] == len(a) + len(b)  # counted once, retractions or not


def test_max_new_tokens_capped_by_the_pool(tiny_path) -> None:
    """A prompt that fits the pool with a max_new_tokens that does not: capped to the pool's room, a length finish
    (retraction keeps the last request, so nothing else could make room); the last token fits, overlap's step in
    flight included."""
    for page, overlap in ((1, False), (16, False), (1, True), (16, True)):
        s = make_scheduler(tiny_path, max_total_tokens=128, page_size=page, enable_overlap_schedule=overlap)
        submit(s, "p", list(range(10, 90)), 100)
        res = drain(s)
        assert res["p"]["finish"]["type"] == "length" and len(res["p"]["ids"]) == 128 - 80
