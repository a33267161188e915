"""Recent serving figures for the dashboard (GET /stats), kept whether or not --enable-metrics is on: generated
tokens per second over a sliding window, the last TTFT and inter-token latencies, finished requests.

`LiveStats` receives the TokenizerManager's metrics hooks (`observe_ttft`, `observe_decode`, `observe_finished`,
`observe_abort`); `MetricsFanout` passes each hook to several receivers (the Prometheus collector and this)."""

from __future__ import annotations

import statistics
import time
from collections import deque
from typing import Any

WINDOW_S = 5.0  # throughput window
RECENT = 200  # latency samples kept
_LAST_ATTR = "_live_stats_last_token"


class LiveStats:
    def __init__(self) -> None:
        self.started = time.time()
        self.token_events: deque[tuple[float, int]] = deque()  # (monotonic time, tokens)
        self.ttft_s: deque[float] = deque(maxlen=RECENT)
        self.itl_s: deque[float] = deque(maxlen=RECENT)
        self.num_finished = 0
        self.num_aborted = 0
        self.generated_tokens = 0

    def _tokens(self, n: int) -> None:
        now = time.monotonic()
        self.token_events.append((now, n))
        self.generated_tokens += n
        while self.token_events and self.token_events[0][0] < now - 4 * WINDOW_S:
            self.token_events.popleft()

    # ------------------------------------------------------------------ hooks
    def observe_ttft(self, seconds: float, num_tokens: int = 1) -> None:
        """A request's first output arrived: `num_tokens` tokens (all of them when it was not streamed)."""
        self.ttft_s.append(max(0.0, seconds))
        self._tokens(num_tokens)

    def observe_decode(self, state: Any, now: float, num_new_tokens: int) -> None:
        last = getattr(state, _LAST_ATTR, None) or getattr(state, "first_token_time", None)
        setattr(state, _LAST_ATTR, now)
        if num_new_tokens <= 0:
            return
        self._tokens(num_new_tokens)
        if last is not None:
            self.itl_s.append(max(0.0, now - last) / num_new_tokens)

    def observe_finished(self, state: Any, req: Any = None) -> None:
        reason = (getattr(state, "meta", {}) or {}).get("finish_reason") or {}
        if isinstance(reason, dict) and reason.get("type") == "abort":
            self.num_aborted += 1
        else:
            self.num_finished += 1

    def observe_abort(self) -> None:
        self.num_aborted += 1

    # ------------------------------------------------------------------ reading
    def gen_throughput(self) -> float:
        now = time.monotonic()
        tokens = sum(n for t, n in self.token_events if t >= now - WINDOW_S)
        return tokens / WINDOW_S

    def snapshot(self) -> dict[str, Any]:
        def p50_ms(samples: deque[float]) -> float | None:
            return 1000 * statistics.median(samples) if samples else None

        return {"gen_throughput": self.gen_throughput(), "ttft_ms_p50": p50_ms(self.ttft_s),
                "itl_ms_p50": p50_ms(self.itl_s), "ttft_ms_recent": [1000 * s for s in list(self.ttft_s)[-20:]],
                "num_finished_reqs": self.num_finished, "num_aborted_reqs": self.num_aborted,
                "generated_tokens": self.generated_tokens, "uptime_s": time.time() - self.started}


class MetricsFanout:
    """Calls each hook on every receiver that has it (none may: the TTFT stages go to the Prometheus collector only)."""

    def __init__(self, *receivers: Any) -> None:
        self.receivers = [r for r in receivers if r is not None]

    def __getattr__(self, name: str) -> Any:
        if name.startswith("_"):
            raise AttributeError(name)
        targets = [getattr(r, name) for r in self.receivers if hasattr(r, name)]

        def call(*args: Any, **kwargs: Any) -> None:
            for fn in targets:
                fn(*args, **kwargs)

        setattr(self, name, call)  # the hooks run per token: look each up once
        return call


def scheduler_figures(info: dict[str, Any]) -> dict[str, Any]:
    """The scheduler's internal state (GET /get_internal_state) as the dashboard's figures."""
    total = info.get("max_total_num_tokens") or 0
    free = info.get("free_tokens", total)
    evictable = info.get("evictable_tokens", 0)
    used = max(0, total - free - evictable)
    prompt_total = info.get("prompt_tokens_total") or 0
    return {"num_running_reqs": info.get("num_running_reqs", 0),
            "num_queued_reqs": info.get("num_waiting_reqs", 0) + info.get("num_grammar_queue_reqs", 0),
            "kv_total_tokens": total, "kv_used_tokens": used, "kv_cached_tokens": evictable,
            "kv_usage": used / total if total else 0.0,
            "cache_hit_rate": info.get("cache_hit_tokens", 0) / prompt_total if prompt_total else None}
