"""Prefix caching for hybrid models (HybridRadixCache): a cached prefix is used only where the tree holds the
linear-attention layers' state at its end. Through a float32 CPU scheduler on tiny Qwen3-Next / Qwen3.5 models,
request by request: greedy tokens equal transformers' while the hits are exactly the ones the snapshots allow (a
next turn, a shared head after the request that left its state there, a repeated prompt, n > 1's shared prefill),
with the snapshot rows accounted for after every request, also when they and the KV pool run short; the same
through the Engine's processes. Unit tests of the tree's rules and of the forward's checkpoint copy."""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, scheduler_waves
from test_qwen3_next import hybrid, random_delta_net

from radixserve.mem_cache.hybrid_radix_cache import HybridRadixCache
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.state_pool import StatePool, apply_state_copies

HEAD = list(range(60, 72))  # a shared 12-token head (a system prompt)


def _scheduler(path: str, **kw: Any) -> Any:
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    args = dict(device="cpu", dtype="float32", max_total_tokens=2048, skip_tokenizer_init=True)
    return Scheduler(ServerArgs(model_path=path, **{**args, **kw}), port_args={})


def _serve(s: Any, rid: str, prompt: list[int], max_new_tokens: int = 6) -> tuple[list[int], int]:
    """One request run to its end: (its tokens, the prompt tokens it found cached); the pools check out after."""
    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    before = s.cache_hit_tokens
    s.process_input_requests([io.TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=prompt, sampling_params=SamplingParams.from_dict(
            {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}))])
    while s.step() or not s.is_idle():
        pass
    out = [t for msg in s.outbox for r, ids in zip(msg.rids, msg.new_token_ids, strict=True) if r == rid for t in ids]
    s.outbox.clear()
    assert s.check_memory() and s.tree_cache.check_states()
    return out, s.cache_hit_tokens - before


@pytest.mark.parametrize("kind,overlap", [("qwen3_next", False), ("qwen3_5", False), ("qwen3_5", True)])
def test_hits_where_states_are_kept(kind: str, overlap: bool, tmp_path) -> None:  # noqa: ANN001
    check_hits(str(tmp_path), kind, enable_overlap_schedule=overlap)


def check_hits(path: str, kind: str, build: Callable[[str], Any] | None = None, **server_kw: Any) -> None:
    """Requests one at a time: each greedy output equals transformers' and each hit is the one expected (the model
    saved at `path` by `build`, default the tiny hybrid Qwen of `kind`)."""
    hf = build(path) if build is not None else hybrid(path, kind)
    s = _scheduler(path, **server_kw)
    overlap = s.enable_overlap  # (on by default on CUDA)
    assert type(s.tree_cache).__name__ == "HybridRadixCache"
    assert overlap == server_kw.get("enable_overlap_schedule", overlap) != server_kw.get("disable_overlap_schedule")
    r1 = HEAD + [5, 6]
    out1, hit = _serve(s, "1", r1)
    assert out1 == hf_greedy(hf, r1, 6) and hit == 0
    # the head is cached KV without a state at its end: no hit, but the forward leaves the state there
    out2, hit = _serve(s, "2", HEAD + [7])
    assert out2 == hf_greedy(hf, HEAD + [7], 6) and hit == 0
    r3 = HEAD + [8, 9, 10]
    out3, hit = _serve(s, "3", r3)
    assert out3 == hf_greedy(hf, r3, 6) and hit == len(HEAD)
    # the next turn of the first conversation: its prompt, its answer but the last token (whose KV never ran;
    # with overlap the request decoded once more before its end was seen, so its KV and state cover that one too)
    r4 = r1 + out1 + [11, 12]
    out4, hit = _serve(s, "4", r4)
    assert out4 == hf_greedy(hf, r4, 6) and hit == len(r1) + len(out1) - (0 if overlap else 1)
    # a repeated prompt matches all but its last token: the first repeat leaves the state there, the second hits it
    out5, hit = _serve(s, "5", r3)
    assert out5 == out3 and hit == len(HEAD)
    out6, hit = _serve(s, "6", r3)
    assert out6 == out3 and hit == len(r3) - 1
    # n > 1's shared prefill (max_new_tokens 0) leaves its state one token before the end for the samples
    p7 = list(range(120, 131))
    assert _serve(s, "7", p7, max_new_tokens=0) == ([], 0)
    out8, hit = _serve(s, "8", p7)
    assert out8 == hf_greedy(hf, p7, 6) and hit == len(p7) - 1


def test_waves_with_overlap(tmp_path) -> None:  # noqa: ANN001
    """The overlap scheduler with the cache: 5-token chunks and mixed steps, a second wave on the first's
    snapshots; every snapshot copy runs between the right forwards (the tokens say so), the pools check out."""
    path = str(tmp_path)
    hf = hybrid(path, "qwen3_5")
    assert scheduler_waves(path, enable_overlap_schedule=True) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def _depth(node: Any) -> int:
    n = 0
    while node.parent is not None:
        n, node = n + len(node.key), node.parent
    return n


def test_chunked_prompt_keeps_its_last_snapshot(tmp_path) -> None:  # noqa: ANN001
    """5-token chunks: each chunk's snapshot is given back when the next one is taken, so a finished request leaves
    two, at its prompt's end and at its own end; a longer prompt resumes from the first."""
    path = str(tmp_path)
    hf = hybrid(path, "qwen3_5")
    s = _scheduler(path, chunked_prefill_size=5)
    p = list(range(30, 53))  # chunks end at 5, 10, 15, 20 and 23
    out, hit = _serve(s, "1", p)
    assert out == hf_greedy(hf, p, 6) and hit == 0
    assert sorted(_depth(n) for n in s.tree_cache.state_nodes) == [23, 28]
    longer = p + [7, 8, 9]
    out, hit = _serve(s, "2", longer)
    assert out == hf_greedy(hf, longer, 6) and hit == 23


@pytest.mark.parametrize("page_size,overlap", [(1, False), (4, False), (1, True)])
def test_requests_arriving_together_compute_a_new_head_once(page_size: int, overlap: bool, tmp_path) -> None:  # noqa: ANN001
    """Three requests arriving together with a new 20-token head: the in-batch check admits the first, which leaves a
    state where its prompt and every waiting one part (the head: one of them shares a token more; a page boundary
    with pages); the others then start there instead of computing the head again (before, the second found KV
    without a state and computed it)."""
    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    path = str(tmp_path)
    hf = hybrid(path, "qwen3_5")
    s = _scheduler(path, page_size=page_size, enable_overlap_schedule=overlap)
    head = list(range(40, 60))
    prompts = {"a": head + [5, 6, 7], "b": head + [5, 8], "c": head + [9, 10]}  # b shares one more token with a
    for rid, p in prompts.items():
        s.process_input_requests([io.TokenizedGenerateReqInput(
            rid=rid, input_text=None, input_ids=p, sampling_params=SamplingParams.from_dict(
                {"max_new_tokens": 5, "temperature": 0, "ignore_eos": True}))])
    while s.step() or not s.is_idle():
        pass
    got: dict[str, list[int]] = {}
    for msg in s.outbox:
        for rid, ids in zip(msg.rids, msg.new_token_ids, strict=True):
            got.setdefault(rid, []).extend(ids)
    assert got == {rid: hf_greedy(hf, p, 5) for rid, p in prompts.items()}
    shared = len(head) - len(head) % page_size
    assert s.cache_hit_tokens == 2 * shared
    assert s.check_memory() and s.tree_cache.check_states()


@pytest.mark.parametrize("page_size", [1, 4])
def test_short_of_snapshots_and_kv(page_size: int, tmp_path) -> None:  # noqa: ANN001
    """Two snapshot rows and a small KV pool: snapshots are given up (least recently used first) and nodes evicted
    with theirs, the tokens stay right and every row and slot is accounted for after each request (with pages:
    matches, snapshots and checkpoints only on page boundaries)."""
    path = str(tmp_path)
    hf = hybrid(path, "qwen3_5")
    s = _scheduler(path, state_snapshots=2, max_total_tokens=96, max_running_requests=2, page_size=page_size)
    assert s.tree_cache.states.size == 2
    prompts = [HEAD + [i, i + 1] for i in range(2, 6)] + [list(range(10 * i, 10 * i + 20)) for i in range(1, 4)]
    prompts.append(HEAD)  # (tokens 0 and 1 stay out: the reference's generate takes 0 for padding)
    hits = 0
    for i, p in enumerate(prompts + prompts[:3]):
        out, hit = _serve(s, str(i), p)
        assert out == hf_greedy(hf, p, 6), i
        assert len(s.tree_cache.state_nodes) <= 2
        hits += hit
    assert hits > 0


def _pools(snapshots: int) -> tuple[HybridRadixCache, TokenToKVPool]:
    kv = TokenToKVPool(64, torch.float32, 1, 4, 1, "cpu")
    buffers = SimpleNamespace(conv=torch.zeros(3 + snapshots, 2, 3), ssm=torch.zeros(3 + snapshots, 1, 2, 2))
    cache = HybridRadixCache(ReqToTokenPool(2, 64, "cpu"), kv, StatePool([buffers], 2, snapshots))
    return cache, kv


def test_matches_end_at_snapshots() -> None:
    cache, kv = _pools(2)
    cache.insert(list(range(10)), kv.alloc(10))
    six = cache._node_at(list(range(6)), None)
    cache._hold(six, cache.states.alloc())
    indices, node = cache.match_prefix(list(range(9)))
    assert len(indices) == 6 and node is six  # KV for 9 tokens, a state after 6
    assert cache.cached_len(list(range(9))) == 9
    indices, node = cache.match_prefix([0, 1, 2, 3])  # a split above the snapshot: nothing usable
    assert len(indices) == 0 and node is cache.root and six.state is not None and len(six.key) == 2
    assert cache.is_attached(six) and not cache.is_attached(six.children[6])
    assert cache.check_states()
    # the least recently used unlocked snapshot is given up when none is free; a locked one never
    cache.insert(list(range(20, 30)), kv.alloc(10))
    other = cache._node_at(list(range(20, 30)), None)
    cache._hold(other, cache.states.alloc())
    cache.inc_lock_ref(other)
    row = cache._alloc_state()
    assert row is not None and six.state is None and not cache.is_attached(six) and cache._alloc_state() is None
    cache.states.free(row)
    cache.dec_lock_ref(other)
    assert cache.check_states()
    assert cache.evict(100) == 20 and cache.states.available_size() == 2 and cache.check_states()
    assert kv.available_size() == kv.size


def test_forward_copies_the_state_at_a_checkpoint() -> None:
    """A checkpoint splits a request's extend: the snapshot row holds the state after exactly those tokens, and
    the outputs and the final state are those of the whole extend (padded with another request or alone)."""
    net = random_delta_net(6)
    lens = [40, 30]
    mixed = torch.randn(sum(lens), net.channels)
    g, beta = -torch.rand(sum(lens), net.hv), torch.rand(sum(lens), net.hv)

    def extend(ls: list[int], rows: list[int], cuts: Any = None, part: slice = slice(None)) -> torch.Tensor:
        batch = SimpleNamespace(forward_mode=SimpleNamespace(is_decode=lambda: False), extend_seq_lens_cpu=ls,
                                extend_prefix_lens_cpu=[0] * len(ls), state_checkpoints=cuts,
                                req_pool_indices=torch.tensor(rows))
        return net._extend(mixed[part], g[part], beta[part], batch)

    whole = extend(lens, [0, 1])
    final = net.states.ssm[:2].clone()
    extend([25], [2], part=slice(0, 25))  # request 0's first 25 tokens alone, into row 2
    want = net.states.ssm[2].clone(), net.states.conv[2].clone()
    net.states.ssm.zero_()
    net.states.conv.zero_()
    # two checkpoints in request 0 (inside and at its end), one at request 1's end
    torch.testing.assert_close(extend(lens, [0, 1], [(0, 25, 3), (1, 30, 5), (0, 40, 4)]), whole, atol=1e-5,
                               rtol=1e-5)
    torch.testing.assert_close(net.states.ssm[:2], final, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(net.states.ssm[3], want[0], atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(net.states.conv[3], want[1])
    for row, snap in ((0, 4), (1, 5)):
        torch.testing.assert_close(net.states.ssm[snap], net.states.ssm[row])
        torch.testing.assert_close(net.states.conv[snap], net.states.conv[row])


def test_state_copies_wait_for_a_batch_and_keep_their_order() -> None:
    """`StatePool.copy` only queues; `apply_state_copies` (the worker, before a forward) gives what copying one by one
    in order gives, also where a copy reads a row an earlier one wrote (a snapshot taken, then loaded at once)."""
    buffers = SimpleNamespace(conv=torch.randn(8, 2, 3), ssm=torch.randn(8, 1, 2, 2))
    pool = StatePool([buffers], 4, 4)
    start = buffers.ssm.clone(), buffers.conv.clone()
    copies = [(0, 4), (1, 5), (4, 2), (5, 6), (3, 7), (7, 0)]
    for src, dst in copies:
        pool.copy(src, dst)
    assert torch.equal(buffers.ssm, start[0]) and torch.equal(buffers.conv, start[1])
    taken = pool.take_pending()
    assert taken == copies and pool.take_pending() == []
    want = [t.clone() for t in start]
    for src, dst in copies:
        for t in want:
            t[dst] = t[src]
    apply_state_copies([buffers], taken)
    assert torch.equal(buffers.ssm, want[0]) and torch.equal(buffers.conv, want[1])


@pytest.mark.integration
def test_engine_n_samples_and_next_turn(tmp_path) -> None:  # noqa: ANN001
    """Through the Engine's processes: n = 3 samples find all but the prompt's last token cached (the shared
    prefill's checkpoint), a next turn finds the first turn cached, and the pools check out at the end."""
    from parallel_utils import wait_idle

    from radixserve import Engine

    path = str(tmp_path)
    hf = hybrid(path, "qwen3_5")
    prompt = list(range(80, 97))
    greedy = {"temperature": 0, "max_new_tokens": 6, "ignore_eos": True}
    with Engine(model_path=path, skip_tokenizer_init=True, device="cpu", dtype="float32", max_total_tokens=2048,
                log_level="warning") as engine:
        outs = engine.generate(input_ids=prompt, sampling_params={**greedy, "n": 3})
        want = hf_greedy(hf, prompt, 6)
        assert [o["output_ids"] for o in outs] == [want] * 3
        assert [o["meta_info"]["cached_tokens"] for o in outs] == [len(prompt) - 1] * 3
        turn = prompt + want + [5, 6]
        out = engine.generate(input_ids=turn, sampling_params=greedy)
        assert out["output_ids"] == hf_greedy(hf, turn, 6)
        assert out["meta_info"]["cached_tokens"] == len(prompt) + len(want) - 1
        state = wait_idle(engine)
        assert state["idle"] and state["memory_ok"]
