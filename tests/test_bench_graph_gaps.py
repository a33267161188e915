"""benchmarks/graph_replay_gaps.py: the per-replay statistics (span, idle time between kernels, the largest gaps)
computed from kernel intervals, with kernels that overlap (programmatic dependent launch) counted as no gap."""

from __future__ import annotations

import pytest
from model_utils import load_benchmark


def test_gap_stats_of_replays() -> None:
    bench = load_benchmark("graph_replay_gaps")

    def replay(t0: float) -> list[tuple[float, float, str]]:
        # a: 0-10, b: 12-20 (2 idle), c: 18-30 (overlaps b's tail), d: 35-40 (5 idle)
        return [(t0, t0 + 10, "a"), (t0 + 12, t0 + 20, "b"), (t0 + 18, t0 + 30, "c"), (t0 + 35, t0 + 40, "d")]

    stats = bench.gap_stats([replay(0), replay(100), replay(200)], top=2)
    assert stats["kernels"] == 4 and stats["span_us"] == 40 and stats["idle_us"] == 7
    assert stats["first_kernel"] == "a" and stats["last_kernel"] == "d"
    assert [(g["index"], g["us"], g["after"], g["before"]) for g in stats["largest_gaps"]] == \
        [(3, 5, "c", "d"), (1, 2, "a", "b")]


def test_gap_stats_leaves_out_the_first_replay() -> None:
    bench = load_benchmark("graph_replay_gaps")
    slow = [(0.0, 50.0, "a"), (80.0, 90.0, "b")]  # the first replay of a series: warming, not counted
    fast = [(100.0, 110.0, "a"), (111.0, 120.0, "b")]
    stats = bench.gap_stats([slow, fast], top=1)
    assert stats["span_us"] == 20 and stats["idle_us"] == pytest.approx(1.0)
