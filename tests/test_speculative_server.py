"""Speculative decoding behind a real server process: `--speculative-algorithm ngram` from the command line, the
acceptance length in meta_info, /get_internal_state and /metrics, streamed output equal to the non-streamed one, and
no KV slot left behind."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from collections.abc import Iterator

import httpx
import pytest
from server_utils import wait_healthy

from radixserve.utils import free_port, kill_process_tree

pytestmark = pytest.mark.integration

PROMPT = ("<|im_start|>user\nRepeat this text exactly: The quick brown fox jumps over the lazy dog. A journey of a "
          "thousand miles begins with a single step.<|im_end|>\n<|im_start|>assistant\n")


@pytest.fixture(scope="module")
def http(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("spec_server") / "server.log")
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", "4096", "--enable-metrics", "--speculative-algorithm", "ngram",
           "--speculative-num-draft-tokens", "4", "--decode-log-interval", "4"]
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def tail() -> str:
        with open(log_path, encoding="utf-8", errors="replace") as f:
            return "\n".join(ln for ln in f.read().splitlines()[-40:] if "Loading" not in ln)

    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc], tail)
        with httpx.Client(base_url=base, timeout=300) as c:
            c.log_tail = tail  # type: ignore[attr-defined]
            yield c
    finally:
        if proc.poll() is None:
            kill_process_tree(proc.pid)
        log.close()


def test_generate_reports_acceptance_and_streams_the_same_tokens(http: httpx.Client) -> None:
    params = {"max_new_tokens": 24, "temperature": 0}
    r = http.post("/generate", json={"text": PROMPT, "sampling_params": params})
    assert r.status_code == 200, r.text
    out = r.json()
    meta = out["meta_info"]
    assert meta["completion_tokens"] > 0 and meta["spec_verify_ct"] > 0
    assert meta["spec_accept_length"] > 1.0, meta
    text = ""
    with http.stream("POST", "/generate", json={"text": PROMPT, "sampling_params": params, "stream": True}) as s:
        for line in s.iter_lines():
            if line.startswith("data:") and line != "data: [DONE]":
                text = json.loads(line[5:])["text"]
    assert text == out["text"]
    state = None
    for _ in range(100):
        state = http.get("/get_internal_state").json()
        if state["idle"]:
            break
        time.sleep(0.1)
    assert state["memory_ok"] is True and state["invariant_violations"] == 0, state
    assert state["internal_states"][0]["avg_spec_accept_length"] > 1.0 if "internal_states" in state \
        else state["avg_spec_accept_length"] > 1.0
    metrics = http.get("/metrics").text
    line = next(ln for ln in metrics.splitlines() if ln.startswith("radixserve:spec_accept_length{"))
    assert float(line.rsplit(" ", 1)[1]) > 1.0
    assert "accept len" in http.log_tail()  # type: ignore[attr-defined]
