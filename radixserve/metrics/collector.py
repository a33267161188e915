"""Prometheus metrics of a server (`--enable-metrics`, served on GET /metrics).

The TokenizerManager calls the hooks as requests progress (`observe_ttft`, `observe_decode`, `observe_finished`);
the scheduler's gauges (running/queued requests, token usage, cache hit rate) are refreshed from its internal
state each time /metrics is scraped (`update_scheduler_state`). Each collector owns its registry, so several
servers (or tests) in one process do not clash."""

from __future__ import annotations

import time
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.exposition import CONTENT_TYPE_LATEST

PREFIX = "radixserve:"

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0, 15.0,
                20.0, 30.0, 60.0, 120.0)
ITL_BUCKETS = (0.001, 0.002, 0.005, 0.01, 0.015, 0.02, 0.025, 0.03, 0.04, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5,
               0.75, 1.0, 2.5, 5.0)
E2E_BUCKETS = (0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 15.0, 20.0, 30.0, 45.0, 60.0, 90.0, 120.0, 180.0, 300.0, 600.0)

# attribute set on a request's state to remember when its last token arrived
_LAST_TOKEN_ATTR = "_metrics_last_token_time"


class MetricsCollector:
    content_type = CONTENT_TYPE_LATEST

    def __init__(self, model_name: str, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry or CollectorRegistry()
        labels = ["model_name"]
        self.labels = {"model_name": model_name}
        r = self.registry

        def gauge(name: str, doc: str) -> Any:
            return Gauge(PREFIX + name, doc, labels, registry=r).labels(**self.labels)

        def counter(name: str, doc: str) -> Any:
            return Counter(PREFIX + name, doc, labels, registry=r).labels(**self.labels)

        def histogram(name: str, doc: str, buckets: tuple[float, ...]) -> Any:
            return Histogram(PREFIX + name, doc, labels, buckets=buckets, registry=r).labels(**self.labels)

        self.num_running_reqs = gauge("num_running_reqs", "Requests in the running (decode) batch")
        self.num_queue_reqs = gauge("num_queue_reqs", "Requests waiting in the scheduler's queue")
        self.num_inflight_reqs = gauge("num_inflight_reqs", "Requests the HTTP server is serving right now")
        self.token_usage = gauge("token_usage", "Fraction of the KV pool held by requests (not evictable cache)")
        self.cache_hit_rate = gauge("cache_hit_rate", "Prompt tokens served from the radix cache / prompt tokens")
        self.max_total_num_tokens = gauge("max_total_num_tokens", "KV pool size in tokens")
        self.spec_accept_length = gauge("spec_accept_length", "Speculative decoding: mean tokens committed per "
                                        "request per verify step (0 before the first; needs --speculative-algorithm)")
        self.engine_alive = gauge("engine_alive", "1 while the scheduler and detokenizer processes run, 0 once one "
                                  "died (the server then exits non-zero)")
        self.engine_alive.set(1)
        self.prompt_tokens = counter("prompt_tokens", "Prompt tokens of finished requests")
        self.generation_tokens = counter("generation_tokens", "Generated tokens of finished requests")
        self.cached_tokens = counter("cached_tokens", "Prompt tokens of finished requests that hit the cache")
        self._num_requests = Counter(PREFIX + "num_requests", "Finished requests by finish reason",
                                     labels + ["finish_reason"], registry=r)
        self.num_aborted_requests = counter("num_aborted_requests", "Requests aborted (client gone, abort, shutdown)")
        self.ttft = histogram("time_to_first_token_seconds", "Time to first token", TTFT_BUCKETS)
        self.ttft_stage = Histogram(PREFIX + "time_to_first_token_stage_seconds",
                                    "Time to first token by stage: dispatch (to the scheduler), queue (waiting for "
                                    "admission), prefill (admission to the first token), deliver (back to the HTTP "
                                    "server)", labels + ["stage"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = histogram("inter_token_latency_seconds", "Time between consecutive output tokens", ITL_BUCKETS)
        self.e2e = histogram("e2e_request_latency_seconds", "Request latency from arrival to last token",
                             E2E_BUCKETS)

    # ------------------------------------------------------------------ hooks called by the TokenizerManager
    def observe_ttft(self, seconds: float, num_tokens: int = 1) -> None:
        """A request's first output arrived, `num_tokens` tokens long (counted by `observe_finished`)."""
        self.ttft.observe(max(0.0, seconds))

    def observe_ttft_stages(self, created: float, timing: tuple[float, float | None, float], now: float) -> None:
        """Split a TTFT (created → now, wall clock) at the scheduler's stamps: received, admitted, first token."""
        recv, prefill, first = timing
        if prefill is None:  # produced without a prefill of its own (never expected; keep the sum whole)
            prefill = recv
        stages = (("dispatch", recv - created), ("queue", prefill - recv), ("prefill", first - prefill),
                  ("deliver", now - first))
        for stage, seconds in stages:
            self.ttft_stage.labels(stage=stage, **self.labels).observe(max(0.0, seconds))

    def observe_decode(self, state: Any, now: float, num_new_tokens: int) -> None:
        """New tokens after the first: one inter-token latency sample per token."""
        last = getattr(state, _LAST_TOKEN_ATTR, None) or getattr(state, "first_token_time", None)
        setattr(state, _LAST_TOKEN_ATTR, now)
        if last is None or num_new_tokens <= 0:
            return
        gap = max(0.0, now - last) / num_new_tokens
        for _ in range(num_new_tokens):
            self.itl.observe(gap)

    def observe_finished(self, state: Any, req: Any = None) -> None:
        meta = getattr(state, "meta", {}) or {}
        reason = meta.get("finish_reason") or {}
        kind = str(reason.get("type", "unknown")) if isinstance(reason, dict) else "unknown"
        self._num_requests.labels(finish_reason=kind, **self.labels).inc()
        if kind == "abort":
            self.num_aborted_requests.inc()
        prompt = meta.get("prompt_tokens")
        if prompt is None and req is not None:
            prompt = len(getattr(req, "input_ids", []) or [])
        self.prompt_tokens.inc(prompt or 0)
        completion = meta.get("completion_tokens")
        if completion is None:
            completion = len(getattr(state, "output_ids", []) or [])
        self.generation_tokens.inc(completion or 0)
        self.cached_tokens.inc(meta.get("cached_tokens", 0) or 0)
        created = getattr(state, "created", None)
        if created is not None:
            self.e2e.observe(max(0.0, time.time() - created))

    def observe_abort(self) -> None:
        self.num_aborted_requests.inc()

    # ------------------------------------------------------------------ scheduler gauges
    def update_scheduler_state(self, state: dict[str, Any], num_inflight: int | None = None) -> None:
        self.num_running_reqs.set(state.get("num_running_reqs", 0))
        self.num_queue_reqs.set(state.get("num_waiting_reqs", 0))
        total = state.get("max_total_num_tokens") or 0
        if total:
            self.max_total_num_tokens.set(total)
            used = total - state.get("free_tokens", total) - state.get("evictable_tokens", 0)
            self.token_usage.set(max(0.0, used / total))
        prompt_total = state.get("prompt_tokens_total") or 0
        if prompt_total:
            self.cache_hit_rate.set(state.get("cache_hit_tokens", 0) / prompt_total)
        accept = state.get("avg_spec_accept_length")
        if accept is not None:
            self.spec_accept_length.set(accept)
        if num_inflight is not None:
            self.num_inflight_reqs.set(num_inflight)

    def set_engine_alive(self, alive: bool) -> None:
        self.engine_alive.set(1 if alive else 0)

    def render(self) -> bytes:
        return generate_latest(self.registry)
