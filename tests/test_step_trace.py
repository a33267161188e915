"""RADIXSERVE_STEP_TRACE: the per-step trace of the overlapped forward writes one line per batch with the device's
time (between its two events), the device's idle gap since the batch before and the host's launch time; and the
summary groups the lines by mode. CUDA events are stood in for on the CPU."""

from __future__ import annotations

import json
import math
from types import SimpleNamespace

import torch

from radixserve.managers import step_trace
from radixserve.model_executor.forward_batch_info import ForwardMode


class _Event:
    clock = [0.0]  # the device's time in ms, advanced by the test

    def __init__(self, enable_timing: bool = False) -> None:
        self.t = None

    def record(self) -> None:
        self.t = self.clock[0]

    def elapsed_time(self, later: _Event) -> float:
        return later.t - self.t


def _batch(mode: ForwardMode, reqs: int, tokens: int) -> SimpleNamespace:
    return SimpleNamespace(forward_mode=mode, seq_lens_cpu=[1] * reqs, input_ids=torch.zeros(tokens))


def test_trace_lines_and_summary(tmp_path, monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "Event", _Event)
    path = tmp_path / "steps.jsonl"
    monkeypatch.setenv("RADIXSERVE_STEP_TRACE", str(path))
    assert step_trace.StepTrace.from_env(is_cuda=False) is None  # CUDA only
    trace = step_trace.StepTrace.from_env(is_cuda=True)
    assert trace is not None
    for i, (mode, reqs, tokens, gap, busy) in enumerate([(ForwardMode.MIXED, 5, 256, 0.0, 9.0),
                                                          (ForwardMode.DECODE, 6, 6, 0.5, 6.0),
                                                          (ForwardMode.DECODE, 6, 6, 0.0, 6.5)]):
        _Event.clock[0] += gap
        rec = trace.begin(_batch(mode, reqs, tokens))
        trace.launched(rec)
        _Event.clock[0] += busy
        trace.end(rec)
        if i:  # the scheduler takes a result one batch behind (overlap), then the last one
            trace.taken()
    trace.taken()
    trace.taken()  # nothing left: no line
    trace.close()
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [(r["bid"], r["mode"], r["reqs"], r["tokens"], r["device_ms"], r["idle_ms"]) for r in lines] == [
        (1, "MIXED", 5, 256, 9.0, None), (2, "DECODE", 6, 6, 6.0, 0.5), (3, "DECODE", 6, 6, 6.5, 0.0)]
    assert all(r["host_ms"] >= 0 for r in lines)
    table = {r["mode"]: r for r in step_trace.summarize(str(path))}
    assert table["DECODE"]["steps"] == 2 and table["DECODE"]["device_ms_p50"] == 6.5
    assert table["MIXED"]["tokens_p50"] == 256 and math.isnan(table["MIXED"]["idle_ms_p50"])  # the first: no gap
