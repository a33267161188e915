"""A per-step trace of the overlapped forward (CUDA), for finding where a step's time goes in a live server.

    RADIXSERVE_STEP_TRACE=/tmp/steps.jsonl python -m radixserve.launch_server ...

One JSON line per batch, written when the scheduler takes the batch's result: `bid`, `mode` (DECODE / EXTEND /
MIXED), `reqs`, `tokens`, `host_ms` (from the forward thread taking the batch to its forward being queued on the
device: the sampling-op replay, the ForwardBatch, the launches), `device_ms` (CUDA events around the forward and
the sampling: the device's time for the step, plus any wait inside it for the host's launches) and `idle_ms` (the
device's gap between the previous batch's end and this batch's start: > 0 when the host was late). Off unless the
variable is set; the events cost a few microseconds a step."""

from __future__ import annotations

import json
import os
import time
from collections import deque
from typing import Any, TextIO

import torch


class StepTrace:
    def __init__(self, path: str) -> None:
        self.file: TextIO = open(path, "a", buffering=1)  # line-buffered: a killed server keeps its lines
        self.open: deque[dict[str, Any]] = deque()  # batches launched, result not taken yet (in order)
        self.last_end: torch.cuda.Event | None = None
        self.count = 0

    @classmethod
    def from_env(cls, is_cuda: bool) -> StepTrace | None:
        path = os.environ.get("RADIXSERVE_STEP_TRACE")
        return cls(path) if path and is_cuda else None

    def begin(self, batch: Any) -> dict[str, Any]:
        start = torch.cuda.Event(enable_timing=True)
        start.record()
        self.count += 1
        return {"bid": self.count, "mode": batch.forward_mode.name, "reqs": len(batch.seq_lens_cpu),
                "tokens": int(batch.input_ids.numel()), "t0": time.perf_counter(), "start": start}

    def launched(self, rec: dict[str, Any]) -> None:
        rec["t_launch"] = time.perf_counter()

    def end(self, rec: dict[str, Any]) -> None:
        """After the step's last launch (the forward thread)."""
        rec["end"] = torch.cuda.Event(enable_timing=True)
        rec["end"].record()
        self.open.append(rec)

    def taken(self) -> None:
        """The scheduler took the oldest batch's result (its copy to the host is done, so are its events)."""
        if not self.open:
            return
        rec = self.open.popleft()
        start, end = rec.pop("start"), rec.pop("end")
        prev, self.last_end = self.last_end, end
        rec["device_ms"] = round(start.elapsed_time(end), 3)
        rec["idle_ms"] = None if prev is None else round(max(0.0, prev.elapsed_time(start)), 3)
        rec["host_ms"] = round((rec.pop("t_launch", rec["t0"]) - rec["t0"]) * 1e3, 3)
        rec["t"] = round(rec.pop("t0"), 6)
        self.file.write(json.dumps(rec) + "\n")

    def close(self) -> None:
        self.file.close()


def summarize(path: str) -> list[dict[str, Any]]:
    """Per mode: steps, median tokens, and the median / P99 of device_ms, host_ms and idle_ms."""
    by_mode: dict[str, list[dict]] = {}
    with open(path) as f:
        for line in f:
            rec = json.loads(line)
            by_mode.setdefault(rec["mode"], []).append(rec)

    def pct(vals: list[float], q: float) -> float:
        vals = sorted(vals)
        return vals[min(len(vals) - 1, int(q * len(vals)))] if vals else float("nan")

    rows = []
    for mode, recs in sorted(by_mode.items()):
        row: dict[str, Any] = {"mode": mode, "steps": len(recs), "tokens_p50": pct([r["tokens"] for r in recs], 0.5)}
        for key in ("device_ms", "host_ms", "idle_ms"):
            vals = [r[key] for r in recs if r[key] is not None]
            row[f"{key}_p50"], row[f"{key}_p99"] = pct(vals, 0.5), pct(vals, 0.99)
        rows.append(row)
    return rows


if __name__ == "__main__":
    import sys

    if len(sys.argv) != 2:
        raise SystemExit("usage: python -m radixserve.managers.step_trace TRACE.jsonl")
    table = summarize(sys.argv[1])
    cols = list(table[0]) if table else []
    print(" ".join(f"{c:>12}" for c in cols))
    for r in table:
        print(" ".join(f"{r[c]:>12.3f}" if isinstance(r[c], float) else f"{r[c]:>12}" for c in cols))
