"""The per-step token budget (--step-token-budget): while requests decode and no backlog waits, prompts are admitted
in chunks of at most the budget, and the running decodes step between two such chunks (with --enable-mixed-chunk
the decodes ride with the chunk instead, MIXED); the tokens are the same as without it. The pure policy
(`latency_step_budget`) is checked on its own first."""

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
    assert not any(mode == ForwardMode.MIXED for mode, _, _ in steps)
    # while requests decode (and no backlog waits), chunks hold at most 24 tokens and the decodes step between two
    paced = [i for i, (mode, _, budgeted) in enumerate(steps) if mode == ForwardMode.EXTEND and budgeted]
    assert len(paced) >= 3 and max(steps[i][1] for i in paced) <= 24
    assert all(steps[i + 1][0] == ForwardMode.DECODE for i in paced if i + 1 < len(steps))
    assert not any(budgeted for mode, _, budgeted in steps if mode != ForwardMode.EXTEND)
    # with --enable-mixed-chunk the decodes ride with the chunk (MIXED; the step's budget counts them)
    got_mixed, steps_mixed = _staggered(tiny_path, step_token_budget=24, enable_mixed_chunk=True,
                                        enable_overlap_schedule=overlap)
    assert got_mixed == want
    mixed = [n for mode, n, _ in steps_mixed if mode == ForwardMode.MIXED]
    assert mixed and any(n <= 24 for n in mixed)
    assert not any(budgeted for _, _, budgeted in steps_mixed)
    # without the budget the same arrivals run whole prompts as their own steps, longer than 24 tokens
    got_off, steps_off = _staggered(tiny_path, step_token_budget=0, enable_overlap_schedule=overlap)
    assert got_off == want
    assert not any(mode == ForwardMode.MIXED for mode, _, _ in steps_off)
    assert max(n for mode, n, _ in steps_off if mode == ForwardMode.EXTEND) > 24
    assert not any(budgeted for _, _, budgeted in steps_off)
