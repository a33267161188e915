"""The numbers to hold against hostile clients, on the embedded model through a real server process (loopback only):
>= 150 malformed requests -> 0 5xx, 0 hangs, healthy after; 300 requests with random disconnects (and abandoned
uploads) -> every KV and request slot free when idle; 256 concurrent streams -> 0 errors; a maximal request does
not stall /health or a stream; SIGTERM with 16 in flight -> all complete; SIGKILL of the scheduler -> the server
exits non-zero within 10 s with one clear log line. Each scenario is bounded (tests/hostile_harness.py)."""

from __future__ import annotations

import json
import os
import re
import signal
import socket
import threading
import time
from collections.abc import Iterator

import httpx
import psutil
import pytest
import server_utils
from hostile_harness import (
    C,
    run_disconnects,
    run_malformed,
    run_streams,
    run_timing,
    slots_free,
    wait_idle,
)
from server_utils import Server

from radixserve.utils import kill_process_tree

pytestmark = pytest.mark.integration

API_KEY = "sk-hostile-test"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
READ_TIMEOUT_S = 2.0
MAX_REQUEST_BYTES = 8 << 20  # the default


def start_server(log_path: str, extra: list[str], env: dict[str, str] | None = None) -> Server:
    return server_utils.start_server(log_path, ["--max-total-tokens", "8192", "--enable-metrics",
                                                "--watchdog-timeout", "30", *extra], env)


@pytest.fixture(scope="module")
def server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    log_path = str(tmp_path_factory.mktemp("hostile") / "server.log")
    srv = start_server(log_path, ["--graceful-shutdown-timeout", "300", "--request-read-timeout",
                                  str(READ_TIMEOUT_S)], env={"RADIXSERVE_API_KEY": API_KEY})
    try:
        yield srv
    finally:
        if srv.proc.poll() is None:
            kill_process_tree(srv.proc.pid)


def _assert_healthy_and_free(base: str) -> None:
    assert httpx.get(base + "/health", timeout=30).status_code == 200
    r = httpx.post(base + C, json={"prompt": "1, 2, 3,", "max_tokens": 2, "temperature": 0}, headers=AUTH,
                   timeout=60)
    assert r.status_code == 200, r.text
    st = wait_idle(base, AUTH)
    assert slots_free(st), st


def test_api_key_from_the_environment(server: Server) -> None:
    assert API_KEY not in " ".join(psutil.Process(server.proc.pid).cmdline())  # not visible in `ps`
    assert httpx.get(server.base + "/get_model_info").status_code == 401
    assert httpx.get(server.base + "/get_model_info", headers=AUTH).status_code == 200


def test_malformed_requests(server: Server) -> None:
    res = run_malformed(server.base, AUTH)
    print(f"\nmalformed: {json.dumps(res.__dict__)}")
    assert res.rejected >= 150, res
    assert res.server_errors == 0 and res.hangs == 0 and res.not_openai_shaped == 0, res
    _assert_healthy_and_free(server.base)


def test_slow_upload_times_out(server: Server) -> None:
    """A client that declares a body and stops sending gets a 408 after --request-read-timeout."""
    host, port = "127.0.0.1", int(server.base.rsplit(":", 1)[1])
    t0 = time.monotonic()
    with socket.create_connection((host, port), timeout=30) as s:
        s.sendall(f"POST {C} HTTP/1.1\r\nHost: x\r\nContent-Length: 5000\r\nAuthorization: Bearer {API_KEY}\r\n"
                  "Content-Type: application/json\r\n\r\n{\"prompt\": \"a".encode())
        answer = b""
        while chunk := s.recv(65536):  # headers and body may come in separate reads; the server then closes
            answer += chunk
    assert answer.startswith(b"HTTP/1.1 408"), answer[:200]
    assert READ_TIMEOUT_S - 0.2 <= time.monotonic() - t0 < READ_TIMEOUT_S + 10
    assert b"request-read-timeout" in answer


def test_random_disconnects_leave_every_slot_free(server: Server) -> None:
    before = server.log()
    res = run_disconnects(server.base, AUTH, n=300, concurrency=32, uploads=20)
    print(f"\ndisconnects: {json.dumps(res.__dict__)}")
    assert res.errors == 0 and res.hung_up + res.completed == 300 and res.hung_up >= 50, res
    st = wait_idle(server.base, AUTH)
    assert slots_free(st), st
    new_log = server.log()[len(before):]
    assert "Traceback" not in new_log, new_log[-3000:]
    # a client that leaves mid-upload is at most one line (none when the body was never handed to a route)
    assert len(re.findall("went away while sending", new_log)) <= res.upload_abandoned + res.hung_up
    assert " ERROR " not in new_log, new_log[-3000:]
    _assert_healthy_and_free(server.base)


def test_256_concurrent_streams(server: Server) -> None:
    res = run_streams(server.base, AUTH, n=256, max_tokens=4)
    print(f"\nstreams: {json.dumps(res.__dict__)}")
    assert res.completed == 256 and res.errors == 0, res
    assert slots_free(wait_idle(server.base, AUTH))


def test_maximal_request_does_not_stall_the_server(server: Server) -> None:
    """While requests of --max-request-bytes are rejected, nothing waits on them: the event loop answers /version
    within 200 ms of its usual time, /health (a scheduler round trip, which a loaded CPU slows) within twice its
    usual time + 500 ms, and a concurrent stream keeps its cadence. The baselines are measured just before under the
    same load, so a busy CI machine moves both sides; a blocked loop (an 8 MB text tokenized on it took seconds)
    does not pass. (/health's single worst answer on a 2-core machine varies by ~0.5 s between two quiet spells,
    the baseline's included, so its margin is wider than the loop's.)"""
    res = run_timing(server.base, AUTH, MAX_REQUEST_BYTES, prompt_chars_rejected=600_000)
    s = res.summary()
    print(f"\ntiming: {json.dumps(s)} rejections: {res.rejections}")
    assert [status for _, status, _ in res.rejections] == [400, 400, 413], res.rejections
    assert len(res.loop_during_ms) >= 3 and len(res.health_during_ms) >= 2 and len(res.stream_gaps_during_s) >= 2, s
    assert s["loop_during_max_ms"] < 200 + s["loop_baseline_max_ms"], s
    assert s["health_during_max_ms"] < 500 + 2 * s["health_baseline_max_ms"], s
    assert s["stream_gap_during_max_s"] < 0.5 + 2 * s["stream_gap_baseline_max_s"], s
    wait_idle(server.base, AUTH)


def test_zz_sigterm_with_16_in_flight(server: Server) -> None:
    """SIGTERM with 16 streams in flight: all 16 complete normally, new requests get 503, exit 0."""
    n, tokens = 16, 16
    results: list[str | None] = [None] * n
    started = threading.Barrier(n + 1, timeout=120)

    def client(i: int) -> None:
        body = {"prompt": f"Story {i}:", "max_tokens": tokens, "stream": True, "ignore_eos": True}
        reason, first = None, True
        with httpx.Client(headers=AUTH, timeout=180) as c, c.stream("POST", server.base + C, json=body) as r:
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if first:
                    first = False
                    started.wait()
                if "error" in chunk:
                    reason = "error: " + chunk["error"]["message"]
                    break
                reason = chunk["choices"][0]["finish_reason"] or reason
        results[i] = reason

    threads = [threading.Thread(target=client, args=(i,)) for i in range(n)]
    for t in threads:
        t.start()
    started.wait()
    t0 = time.monotonic()
    os.kill(server.proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 10
    while httpx.get(server.base + "/health", timeout=10).status_code != 503:
        assert time.monotonic() < deadline
        time.sleep(0.05)
    assert httpx.post(server.base + C, json={"prompt": "x"}, headers=AUTH).status_code == 503
    for t in threads:
        t.join(timeout=120)
    assert results == ["length"] * n, results
    assert server.proc.wait(timeout=60) == 0, server.log_tail()
    print(f"\nsigterm: {n} in flight completed; exit 0 after {time.monotonic() - t0:.1f} s")


def test_scheduler_sigkill_is_loud(embedded_model_path: str, tmp_path: os.PathLike) -> None:
    """SIGKILL of the scheduler: in-flight requests fail with an error, /get_server_info and /metrics say so, one
    log line names the process and the signal, and the server exits non-zero within 10 s."""
    key_file = os.path.join(str(tmp_path), "key")
    with open(key_file, "w") as f:
        f.write(API_KEY + "\n")
    srv = start_server(os.path.join(str(tmp_path), "server.log"), ["--api-key-file", key_file])
    try:
        pid = httpx.get(srv.base + "/get_internal_state", headers=AUTH, timeout=30).json()["pid"]
        errors: list[str] = []

        def stream() -> None:
            body = {"prompt": "Tell me a story.", "max_tokens": 4000, "stream": True, "ignore_eos": True}
            try:
                with httpx.Client(headers=AUTH, timeout=60) as c, c.stream("POST", srv.base + C, json=body) as r:
                    if r.status_code != 200:  # it died before the first token: a plain error response
                        errors.append(f"{r.status_code}: {r.read()[:200]!r}")
                        return
                    for line in r.iter_lines():
                        if line.startswith("data: {") and "error" in json.loads(line[6:]):
                            errors.append(json.loads(line[6:])["error"]["message"])
            except httpx.HTTPError as e:
                errors.append(f"connection: {e}")

        t = threading.Thread(target=stream)
        t.start()
        time.sleep(1.0)
        t_kill = time.monotonic()
        os.kill(pid, signal.SIGKILL)
        time.sleep(0.5)  # the server looks at its children every 0.25 s
        info = None
        while time.monotonic() - t_kill < 2.8:  # within the grace before the exit (3 s)
            try:
                info = httpx.get(srv.base + "/get_server_info", headers=AUTH, timeout=2.5).json()
            except httpx.HTTPError:
                continue
            if not info["engine_alive"]:
                break
            time.sleep(0.05)
        assert info is not None and info["engine_alive"] is False and "SIGKILL" in info["engine_error"], info
        metrics = httpx.get(srv.base + "/metrics", headers=AUTH, timeout=5).text
        assert re.search(r"radixserve:engine_alive\{[^}]*\} 0\.0", metrics), metrics[-2000:]
        code = srv.proc.wait(timeout=10)
        elapsed = time.monotonic() - t_kill
        t.join(timeout=30)
        print(f"\nsigkill: exit code {code} after {elapsed:.1f} s; client saw {errors}")
        assert code != 0 and elapsed < 10
        assert errors, "the in-flight request did not get an error"
        lines = [ln for ln in srv.log().splitlines() if f"scheduler process (pid {pid}) was killed by SIGKILL" in ln]
        assert len(lines) == 1, srv.log_tail()
    finally:
        if srv.proc.poll() is None:
            kill_process_tree(srv.proc.pid)
