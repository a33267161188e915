"""The per-step token budget (--step-token-budget): while requests decode and no backlog waits, a step holds at most
the budget's tokens, a prompt's chunk with the running decodes riding along (MIXED), so no decode waits behind a
long prefill; the tokens are the same as without it. The pure policy (`latency_step_budget`) is checked on its own
first."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
from test_scheduler import drain, make_scheduler, run, submit, tiny_path, workload  # noqa: F401

from radixserve.managers.schedule_policy import latency_step_budget
from radixserve.model_executor.forward_batch_info import ForwardMode
from radixserve.server_args import ServerArgs


def _reqs(*lens: int) -> list[SimpleNamespace]:
    return [SimpleNamespace(origin_input_ids=[1] * n) for n in lens]


def test_latency_step_budget_policy() -> None:
    assert latency_step_budget(256, 10, _reqs(1024), 8192) == 256  # a few decodes, one prompt waiting
    assert latency_step_budget(256, 0, _reqs(1024), 8192) is None  # nothing decoding: full chunk
    assert latency_step_budget(0, 10, _reqs(1024), 8192) is None  # off
    assert latency_step_budget(256, 129, _reqs(16), 8192) is None  # decodes would take over half of the step
    assert latency_step_budget(256, 128, _reqs(16), 8192) == 256
    assert latency_step_budget(256, 10, _reqs(*[1024] * 9), 8192) is None  # a backlog: throughput first
    assert latency_step_budget(256, 10, _reqs(*[1024] * 8), 8192) == 256
    assert latency_step_budget(256, 10, _reqs(300), None) is None  # chunking off: a backlog is one budget


def test_default_budget_by_device() -> None:
    assert ServerArgs(device="cpu").resolved_step_token_budget == 0
    assert ServerArgs(device="cpu", step_token_budget=64).resolved_step_token_budget == 64
    assert ServerArgs(device="cuda").resolved_step_token_budget == 256
    assert ServerArgs(device="cuda", step_token_budget=0).resolved_step_token_budget == 0
    assert ServerArgs(device="cuda", step_token_budget=128).resolved_step_token_budget == 128
    # the steps of speculative decoding and DP attention are scheduled differently: no budget unless asked (which
    # is refused)
    assert ServerArgs(device="cuda", speculative_algorithm="ngram").resolved_step_token_budget == 0
    # its chunks would run eagerly: off unless asked
    assert ServerArgs(device="cuda", disable_cuda_graph=True).resolved_step_token_budget == 0
    assert ServerArgs(device="cuda", tp_size=2).resolved_step_token_budget == 0
    assert ServerArgs(device="cuda", tp_size=2, step_token_budget=256).resolved_step_token_budget == 256
    with pytest.raises(ValueError, match="step-token-budget"):
        ServerArgs(device="cpu", step_token_budget=-1)
    with pytest.raises(ValueError, match="step-token-budget"):
        ServerArgs(device="cpu", step_token_budget=64, speculative_algorithm="ngram")


def _staggered(path: str, **kw) -> tuple[dict[str, list[int]], list[tuple[ForwardMode, int, bool]]]:
    """The workload's requests arriving one every 3 steps; returns the tokens and each step's (mode, tokens,
    whether it is a budgeted chunk that the running decodes follow)."""
    s = make_scheduler(path, chunked_prefill_size=64, **kw)
    steps: list[tuple[ForwardMode, int, bool]] = []
    launch = s.run_batch

    def record(batch):  # noqa: ANN001, ANN202
        n = sum(batch.extend_lens) if batch.forward_mode.is_extend() else len(batch.reqs)
        steps.append((batch.forward_mode, n, s.decode_turn))
        return launch(batch)

    s.run_batch = record
    for rid, prompt, n in workload(n=8):
        submit(s, rid, prompt, n + 8)
        for _ in range(3):
            s.step()
    res = drain(s)
    assert s.invariant_violations == 0
    return {rid: r["ids"] for rid, r in res.items()}, steps


@pytest.mark.parametrize("overlap", [False, True])
def test_step_budget_paces_decodes(tiny_path, overlap: bool) -> None:  # noqa: F811
    want = run(tiny_path, [(rid, p, n + 8) for rid, p, n in workload(n=8)])
    got, steps = _staggered(tiny_path, step_token_budget=24, enable_overlap_schedule=overlap)
    assert got == want
    # while requests decode (and no backlog waits), the decodes ride with each chunk: MIXED steps of at most 24
    # tokens, the decodes counted
    mixed = [n for mode, n, _ in steps if mode == ForwardMode.MIXED]
    assert len(mixed) >= 3 and max(mixed) <= 24
    assert not any(budgeted for _, _, budgeted in steps)  # the decodes always joined: no separate decode turn
    # without the budget the same arrivals run whole prompts as their own steps, longer than 24 tokens
    got_off, steps_off = _staggered(tiny_path, step_token_budget=0, enable_overlap_schedule=overlap)
    assert got_off == want
    assert not any(mode == ForwardMode.MIXED for mode, _, _ in steps_off)
    assert max(n for mode, n, _ in steps_off if mode == ForwardMode.EXTEND) > 24
    assert not any(budgeted for _, _, budgeted in steps_off)
    # --enable-mixed-chunk without a budget: the decodes ride with whole prompts
    got_mix, steps_mix = _staggered(tiny_path, step_token_budget=0, enable_mixed_chunk=True,
                                    enable_overlap_schedule=overlap)
    assert got_mix == want
    assert max(n for mode, n, _ in steps_mix if mode == ForwardMode.MIXED) > 24


def test_budgeted_chunk_the_decodes_cannot_join_is_followed_by_their_step(tiny_path) -> None:  # noqa: F811
    """Should the running decodes not fit in memory next to a budgeted chunk, the chunk runs alone and the decodes
    step right after it, before any further prefill (`decode_turn`)."""
    s = make_scheduler(tiny_path, chunked_prefill_size=64, step_token_budget=24)
    steps: list[tuple[ForwardMode, bool]] = []
    launch = s.run_batch

    def record(batch):  # noqa: ANN001, ANN202
        steps.append((batch.forward_mode, s.decode_turn))
        return launch(batch)

    s.run_batch = record
    refuse = [0]

    def no_room() -> bool:  # the running decodes' memory check fails once: while a chunk is being admitted
        refuse[0] += 1
        return refuse[0] > 1

    prompts = workload(n=3)
    submit(s, *prompts[0][:2], 12)
    for _ in range(3):
        s.step()
    s.running_batch.check_decode_mem = no_room
    submit(s, *prompts[1][:2], 12)
    s.step()
    assert refuse[0] == 1 and steps[-1] == (ForwardMode.EXTEND, True)  # the chunk ran alone...
    s.step()
    assert steps[-1][0] == ForwardMode.DECODE  # ...and the decodes went next
    del s.running_batch.check_decode_mem
    drain(s)
    assert s.invariant_violations == 0
