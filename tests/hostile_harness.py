"""Hostile clients against a running server: malformed requests, random disconnects (mid-stream, mid-answer and
mid-upload), many concurrent streams, a maximal request while /health and a stream are timed. Every scenario is
bounded in time and returns its numbers; tests/test_hostile_clients.py asserts them, and

    python tests/hostile_harness.py --base-url http://127.0.0.1:30000 [--api-key KEY] [--output-file x.json]

prints them as a table for any server (loopback addresses only).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import socket
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import urlparse

import httpx

C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
MSGS = [{"role": "user", "content": "hi"}]
PROMPTS = ["1, 2, 3, 4, 5,", "The capital of France is", "Once upon a time", "def fibonacci(n):"]


# ====================================================================== raw HTTP (no client-side buffering)
def _addr(base: str) -> tuple[str, int]:
    u = urlparse(base)
    if u.hostname not in ("127.0.0.1", "localhost", "::1"):
        raise ValueError(f"only loopback servers: {base}")
    return u.hostname, u.port or 80


def raw_request(base: str, method: str, path: str, body: bytes = b"", headers: dict[str, str] | None = None,
                timeout: float = 30.0) -> tuple[int, bytes]:
    """One HTTP/1.1 request on its own connection; (status, body)."""
    host, port = _addr(base)
    head = [f"{method} {path} HTTP/1.1", f"Host: {host}:{port}", "Connection: close",
            f"Content-Length: {len(body)}", "Content-Type: application/json"]
    head += [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((host, port), timeout=timeout) as s:
        try:
            s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + body)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server answered (413) without reading the whole body: its answer is still there
        chunks = []
        while True:
            try:
                data = s.recv(65536)
            except ConnectionResetError:
                break
            if not data:
                break
            chunks.append(data)
    raw = b"".join(chunks)
    status = int(raw.split(b" ", 2)[1]) if raw.startswith(b"HTTP/") else 0
    return status, raw.partition(b"\r\n\r\n")[2]


def abandoned_upload(base: str, path: str, declared: int, sent: int, headers: dict[str, str] | None = None) -> None:
    """Declare a body of `declared` bytes, send `sent` of them, hang up."""
    host, port = _addr(base)
    head = [f"POST {path} HTTP/1.1", f"Host: {host}:{port}", f"Content-Length: {declared}",
            "Content-Type: application/json"] + [f"{k}: {v}" for k, v in (headers or {}).items()]
    with socket.create_connection((host, port), timeout=10) as s:
        s.sendall(("\r\n".join(head) + "\r\n\r\n").encode() + b'{"prompt": "' + b"x" * max(0, sent - 12))
        time.sleep(0.05)


# ====================================================================== malformed requests
def malformed_requests(seed: int = 0) -> list[tuple[str, str, Any]]:
    """(method, path, body) of requests that must each get a 4xx: bodies are dicts (sent as JSON) or raw bytes."""
    rng = random.Random(seed)
    out: list[tuple[str, str, Any]] = []
    bad_values: list[Any] = [None, -1, 0, 10**30, -(10**30), 1.5, "5", "", [], {}, [1, "a"], {"a": 1}, True,
                             "NaN", "x" * 5000]
    fields = {C: ["max_tokens", "temperature", "top_p", "n", "stop", "logprobs", "seed", "logit_bias", "prompt",
                  "presence_penalty", "top_k", "min_tokens", "stream", "echo", "best_of", "stop_token_ids"],
              CH: ["messages", "max_tokens", "logprobs", "top_logprobs", "response_format", "n", "temperature",
                   "tools", "tool_choice", "stream_options", "max_completion_tokens"],
              G: ["text", "input_ids", "sampling_params", "return_logprob", "top_logprobs_num", "rid", "stream"]}
    base = {C: {"prompt": "x", "max_tokens": 2}, CH: {"messages": MSGS, "max_tokens": 2},
            G: {"text": "x", "sampling_params": {"max_new_tokens": 2}}}
    for path, names in fields.items():
        for name in names:
            for value in rng.sample(bad_values, 6):
                body = dict(base[path])
                body[name] = value
                if value is None or (name == "sampling_params" and value == {}):
                    continue  # not malformed (and the second would run 128 tokens)
                out.append(("POST", path, body))
    raw_bodies = [b"", b"{", b"[]", b"null", b"1", b'"x"', b'{"prompt": "x",}', b"\xff\xfe\x00",
                  b'{"prompt": "\\ud800"}', b"[" * 5000 + b"]" * 5000,
                  b'{"prompt": ' + b"[" * 3000 + b"]" * 3000 + b"}",
                  b'{"prompt": "x", "prompt": 5}', b"{" + b'"a":1,' * 20000 + b'"b":2}']
    for path in (C, CH, G):
        for raw in raw_bodies:
            out.append(("POST", path, raw))
    out += [("GET", C, None), ("PUT", CH, {}), ("DELETE", G, None), ("POST", "/v1/nope", {}),
            ("GET", "/v1/models/gpt-9", None), ("POST", "/abort_request", {"rid": 5}), ("POST", "/abort_request", {}),
            ("POST", C, {"prompt": [[1, 2], []]}), ("POST", C, {"prompt": [-5]}), ("POST", G, {"input_ids": [[]]}),
            ("POST", G, {"text": ["a", 5]}), ("POST", CH, {"messages": [{"role": "user", "content": [{"type": "x"}]}]}),
            ("POST", CH, {"messages": [{"content": "no role"}]}), ("POST", G, {"text": "x", "rid": ["a", "b"]})]
    return out


@dataclass
class MalformedResult:
    sent: int = 0
    rejected: int = 0  # 4xx (a few mutations happen to be valid requests: those are served)
    statuses: dict[int, int] = field(default_factory=dict)
    server_errors: int = 0
    hangs: int = 0
    not_openai_shaped: int = 0  # 4xx without {"error": {"message", "type", "param", "code"}}
    seconds: float = 0.0
    first_problem: str = ""


def run_malformed(base: str, headers: dict[str, str], concurrency: int = 8, timeout: float = 120.0
                  ) -> MalformedResult:
    """Each request must be answered within `timeout` seconds (a few mutations are valid requests for 2 tokens, which
    a heavily loaded machine can take tens of seconds to serve; a hang is one that never returns)."""
    reqs = malformed_requests()
    res = MalformedResult(sent=len(reqs))
    lock = threading.Lock()
    t0 = time.monotonic()

    def one(req: tuple[str, str, Any]) -> None:
        method, path, body = req
        data = body if isinstance(body, bytes) else (b"" if body is None else json.dumps(body).encode())
        try:
            status, payload = raw_request(base, method, path, data, headers, timeout=timeout)
        except (TimeoutError, OSError) as e:
            with lock:
                res.hangs += 1
                res.first_problem = res.first_problem or f"{method} {path} {data[:100]!r}: {e!r}"
            return
        shaped = True
        try:
            err = json.loads(payload)["error"]
            shaped = set(err) == {"message", "type", "param", "code"} and bool(err["message"])
        except (ValueError, KeyError, TypeError):
            shaped = False
        with lock:
            res.statuses[status] = res.statuses.get(status, 0) + 1
            res.server_errors += status >= 500 or status == 0
            if status >= 500 or status == 0:
                res.first_problem = res.first_problem or f"{method} {path} {data[:100]!r}: {status} {payload[:200]!r}"
            if 400 <= status < 500:
                res.rejected += 1
                res.not_openai_shaped += not shaped

    from concurrent.futures import ThreadPoolExecutor

    with ThreadPoolExecutor(concurrency) as pool:
        list(pool.map(one, reqs))
    res.seconds = time.monotonic() - t0
    return res


# ====================================================================== random disconnects
@dataclass
class DisconnectResult:
    requests: int = 0
    completed: int = 0
    hung_up: int = 0
    errors: int = 0
    upload_abandoned: int = 0
    seconds: float = 0.0


async def _one_then_hang_up(ac: httpx.AsyncClient, i: int, rng: random.Random, res: DisconnectResult) -> None:
    kind = i % 4
    delay = rng.choice([0.005, 0.02, 0.05, 0.1, 0.2, 0.4, None])  # None: wait for the answer
    prompt = PROMPTS[i % len(PROMPTS)]
    if kind == 0:
        path, body = C, {"prompt": prompt, "max_tokens": 12, "stream": True, "ignore_eos": True}
    elif kind == 1:
        path, body = CH, {"messages": [{"role": "user", "content": prompt}], "max_tokens": 12, "ignore_eos": True}
    elif kind == 2:
        path, body = G, {"text": prompt, "stream": True, "sampling_params": {"max_new_tokens": 12, "ignore_eos": True}}
    else:
        path, body = C, {"prompt": [prompt, prompt], "n": 2, "max_tokens": 8, "ignore_eos": True}

    async def run() -> None:
        async with ac.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                await r.aread()
                raise RuntimeError(f"{path}: {r.status_code} {r.text[:200]}")
            async for _ in r.aiter_bytes():
                pass

    try:
        if delay is None:  # wait for the answer, up to a minute (then hang up too: the scenario stays bounded)
            await asyncio.wait_for(run(), 60)
            res.completed += 1
        else:
            await asyncio.wait_for(run(), delay)
            res.completed += 1
    except TimeoutError:
        res.hung_up += 1
    except Exception:  # noqa: BLE001 - counted
        res.errors += 1


async def _disconnects(base: str, headers: dict[str, str], n: int, concurrency: int, seed: int,
                       uploads: int) -> DisconnectResult:
    rng = random.Random(seed)
    res = DisconnectResult(requests=n)
    sem = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency * 2, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=120, limits=limits) as ac:
        async def guarded(i: int) -> None:
            async with sem:
                await _one_then_hang_up(ac, i, rng, res)

        async def upload(i: int) -> None:
            await asyncio.to_thread(abandoned_upload, base, C, 200_000, 1000 + 997 * i, headers)
            res.upload_abandoned += 1

        await asyncio.gather(*(guarded(i) for i in range(n)), *(upload(i) for i in range(uploads)))
    return res


def run_disconnects(base: str, headers: dict[str, str], n: int = 300, concurrency: int = 32, seed: int = 7,
                    uploads: int = 20) -> DisconnectResult:
    t0 = time.monotonic()
    res = asyncio.run(_disconnects(base, headers, n, concurrency, seed, uploads))
    res.seconds = time.monotonic() - t0
    return res


# ====================================================================== concurrent streams
@dataclass
class StreamsResult:
    clients: int = 0
    completed: int = 0
    errors: int = 0
    tokens: int = 0
    seconds: float = 0.0
    first_error: str = ""


async def _streams(base: str, headers: dict[str, str], n: int, max_tokens: int) -> StreamsResult:
    res = StreamsResult(clients=n)
    limits = httpx.Limits(max_connections=n + 8, max_keepalive_connections=0)
    async with httpx.AsyncClient(base_url=base, headers=headers, timeout=300, limits=limits) as ac:
        async def one(i: int) -> None:
            body = {"prompt": PROMPTS[i % len(PROMPTS)] + f" {i}", "max_tokens": max_tokens, "stream": True,
                    "ignore_eos": True, "temperature": 0}
            try:
                reason, got = None, 0
                async with ac.stream("POST", C, json=body) as r:
                    if r.status_code != 200:
                        raise RuntimeError(f"{r.status_code} {(await r.aread())[:200]!r}")
                    async for line in r.aiter_lines():
                        if not line.startswith("data: ") or line == "data: [DONE]":
                            continue
                        chunk = json.loads(line[6:])
                        if "error" in chunk:
                            raise RuntimeError(chunk["error"]["message"])
                        got += 1
                        reason = chunk["choices"][0]["finish_reason"] or reason
                if reason != "length":
                    raise RuntimeError(f"finish_reason {reason!r}")
                res.completed += 1
                res.tokens += got
            except Exception as e:  # noqa: BLE001 - counted
                res.errors += 1
                res.first_error = res.first_error or f"{type(e).__name__}: {e}"

        await asyncio.gather(*(one(i) for i in range(n)))
    return res


def run_streams(base: str, headers: dict[str, str], n: int = 256, max_tokens: int = 4,
                timeout: float = 300.0) -> StreamsResult:
    t0 = time.monotonic()
    res = asyncio.run(asyncio.wait_for(_streams(base, headers, n, max_tokens), timeout))
    res.seconds = time.monotonic() - t0
    return res


# ====================================================================== a maximal request vs. the event loop
@dataclass
class TimingResult:
    health_baseline_ms: list[float] = field(default_factory=list)
    health_during_ms: list[float] = field(default_factory=list)
    loop_baseline_ms: list[float] = field(default_factory=list)  # GET /version: the event loop alone
    loop_during_ms: list[float] = field(default_factory=list)
    stream_gaps_baseline_s: list[float] = field(default_factory=list)
    stream_gaps_during_s: list[float] = field(default_factory=list)
    rejections: list[tuple[str, int, float]] = field(default_factory=list)  # (what, status, seconds)

    def summary(self) -> dict[str, float]:
        def p(xs: list[float], q: float) -> float:
            return sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")

        return {"health_baseline_p50_ms": p(self.health_baseline_ms, 0.5),
                "health_baseline_max_ms": max(self.health_baseline_ms, default=float("nan")),
                "health_during_p50_ms": p(self.health_during_ms, 0.5),
                "health_during_max_ms": max(self.health_during_ms, default=float("nan")),
                "loop_baseline_max_ms": max(self.loop_baseline_ms, default=float("nan")),
                "loop_during_p50_ms": p(self.loop_during_ms, 0.5),
                "loop_during_max_ms": max(self.loop_during_ms, default=float("nan")),
                "stream_gap_baseline_max_s": max(self.stream_gaps_baseline_s, default=float("nan")),
                "stream_gap_during_max_s": max(self.stream_gaps_during_s, default=float("nan"))}


def run_timing(base: str, headers: dict[str, str], max_request_bytes: int, prompt_chars_rejected: int,
               baseline_s: float = 1.5) -> TimingResult:
    """/health latency (a round trip to the scheduler), /version latency (the event loop alone) and the gaps of a
    concurrent stream: first for `baseline_s` with the stream alone, then while three maximal requests are rejected
    one after the other (a body just under --max-request-bytes whose
    text is too long for the context, `prompt_chars_rejected` characters that must be tokenized to find out, and a
    body over the limit)."""
    res = TimingResult()
    phase = ["baseline"]
    stop = threading.Event()

    def poll(path: str, baseline: list[float], during: list[float]) -> None:
        while not stop.is_set():
            t = time.perf_counter()
            status, _ = raw_request(base, "GET", path, headers=headers, timeout=30)
            ms = 1000 * (time.perf_counter() - t)
            if status == 200:
                (baseline if phase[0] == "baseline" else during).append(ms)
            time.sleep(0.02)

    def stream() -> None:
        body = {"prompt": "Tell me a story.", "max_tokens": 4000, "stream": True, "ignore_eos": True}
        with httpx.Client(base_url=base, headers=headers, timeout=120) as c, \
                c.stream("POST", C, json=body) as r:
            last = None
            for line in r.iter_lines():
                if not line.startswith("data: "):
                    continue
                now = time.perf_counter()
                if last is not None:
                    (res.stream_gaps_baseline_s if phase[0] == "baseline" else res.stream_gaps_during_s).append(
                        now - last)
                last = now
                if stop.is_set():
                    return

    threads = [threading.Thread(target=poll, args=("/health", res.health_baseline_ms, res.health_during_ms),
                                daemon=True),
               threading.Thread(target=poll, args=("/version", res.loop_baseline_ms, res.loop_during_ms), daemon=True),
               threading.Thread(target=stream, daemon=True)]
    for t in threads:
        t.start()
    deadline = time.monotonic() + 60
    while len(res.stream_gaps_baseline_s) < 3 and time.monotonic() < deadline:
        time.sleep(0.05)
    overhead = len(b'{"prompt": "", "max_tokens": 1}')
    maximal = [("body just under the limit", json.dumps({"prompt": "a " * ((max_request_bytes - overhead) // 2 - 8),
                                                         "max_tokens": 1}).encode()),
               ("text that must be tokenized", json.dumps({"prompt": "hello " * (prompt_chars_rejected // 6),
                                                           "max_tokens": 1}).encode()),
               ("body over the limit", b'{"prompt": "' + b"a" * (max_request_bytes + 1024) + b'"}')]
    time.sleep(baseline_s)
    phase[0] = "during"
    try:
        for what, body in maximal:
            t = time.perf_counter()
            status, _ = raw_request(base, "POST", C, body, headers, timeout=120)
            res.rejections.append((what, status, time.perf_counter() - t))
        time.sleep(0.3)
    finally:
        stop.set()
        for t in threads:
            t.join(timeout=30)
    return res


# ====================================================================== server state
def internal_state(base: str, headers: dict[str, str]) -> dict[str, Any]:
    r = httpx.get(base + "/get_internal_state", headers=headers, timeout=30)
    r.raise_for_status()
    return r.json()


def wait_idle(base: str, headers: dict[str, str], timeout: float = 60.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = internal_state(base, headers)
        if st["idle"] and st["num_inflight_requests"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {st}")
        time.sleep(0.1)


def slots_free(st: dict[str, Any]) -> bool:
    return bool(st["memory_ok"]) and st["protected_tokens"] == 0 and st["invariant_violations"] == 0 and \
        st["free_tokens"] + st["evictable_tokens"] == st["max_total_num_tokens"]


# ====================================================================== CLI
def _table(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    return "\n".join(f"{k:<{width}}  {v}" for k, v in rows)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--base-url", default="http://127.0.0.1:30000")
    ap.add_argument("--api-key", default=None)
    ap.add_argument("--max-request-bytes", type=int, default=8 << 20)
    ap.add_argument("--output-file", default=None)
    args = ap.parse_args(argv)
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    base = args.base_url
    rows: list[tuple[str, str]] = []
    record: dict[str, Any] = {}
    steps: list[tuple[str, Callable[[], Any]]] = [
        ("malformed", lambda: run_malformed(base, headers)),
        ("disconnects", lambda: run_disconnects(base, headers)),
        ("streams", lambda: run_streams(base, headers)),
    ]
    for name, fn in steps:
        res = fn()
        record[name] = res.__dict__
        rows.append((name, json.dumps(res.__dict__)))
    st = wait_idle(base, headers)
    rows.append(("idle after", f"slots free: {slots_free(st)}"))
    print(_table(rows))
    if args.output_file:
        with open(args.output_file, "w") as f:
            json.dump(record, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
