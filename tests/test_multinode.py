"""Two "nodes" on loopback: `launch_server --nnodes 2 --tp-size 2`, node 0 serving HTTP with TP rank 0 and node 1
running only TP rank 1, as two separate process trees that meet at --dist-init-addr. The pair answers with the
TP=1 tokens; when node 1's rank is killed, node 1 exits, node 0's rank logs why and exits, /health says 503 and the
server exits 1."""

from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from collections.abc import Iterator
from dataclasses import dataclass

import httpx
import psutil
import pytest
from parallel_utils import make_model, reference_outputs
from server_utils import wait_healthy

from radixserve.utils import free_port, kill_process_tree

pytestmark = pytest.mark.integration  # every test here starts processes

PROMPTS = [[1, 5, 9, 33, 2], list(range(40, 90)), [7, 7, 7]]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


@dataclass
class Node:
    proc: subprocess.Popen
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return "\n".join(ln for ln in f.read().splitlines() if "Loading" not in ln)


def _start_node(rank: int, model: str, dist_port: int, http_port: int, log_dir: str) -> Node:
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--model-path", model, "--skip-tokenizer-init",
           "--device", "cpu", "--dtype", "float32", "--max-total-tokens", "2048", "--tp-size", "2", "--nnodes", "2",
           "--node-rank", str(rank), "--dist-init-addr", f"127.0.0.1:{dist_port}", "--host", "127.0.0.1",
           "--port", str(http_port), "--log-level", "info", "--watchdog-timeout", "5"]
    log_path = os.path.join(log_dir, f"node{rank}.log")
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    return Node(proc, log_path)


def _workers(node: Node) -> list[psutil.Process]:
    """The node's multiprocessing children (not its resource tracker)."""
    return [p for p in psutil.Process(node.proc.pid).children(recursive=True)
            if any("spawn_main" in part for part in p.cmdline())]


@pytest.fixture(scope="module")
def cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[str, Node, Node, str]]:
    model = make_model("llama", str(tmp_path_factory.mktemp("mn_model")), seed=7)
    log_dir = str(tmp_path_factory.mktemp("mn_logs"))
    dist_port, http_port = free_port(), free_port()
    node1 = _start_node(1, model, dist_port, http_port, log_dir)  # a worker may come up before the head
    node0 = _start_node(0, model, dist_port, http_port, log_dir)
    base = f"http://127.0.0.1:{http_port}"
    try:
        wait_healthy(base, [node0.proc, node1.proc], lambda: f"{node0.log()[-3000:]}\n{node1.log()[-3000:]}",
                     timeout=180)
        yield model, node0, node1, base
    finally:
        for n in (node0, node1):
            if n.proc.poll() is None:
                kill_process_tree(n.proc.pid)


def test_two_nodes_answer_like_tp1(cluster) -> None:
    model, node0, node1, base = cluster
    want = reference_outputs(model, PROMPTS, GREEDY)
    r = httpx.post(base + "/generate", json={"input_ids": PROMPTS, "sampling_params": GREEDY}, timeout=60)
    assert r.status_code == 200, r.text
    assert [o["output_ids"] for o in r.json()] == want
    one = httpx.post(base + "/generate", json={"input_ids": PROMPTS[1], "sampling_params": GREEDY}, timeout=60)
    assert one.json()["output_ids"] == want[1] and one.json()["meta_info"]["cached_tokens"] > 0
    # node 1 runs a scheduler rank and nothing else: no HTTP port, no detokenizer
    assert len(_workers(node1)) == 1 and "1 rank(s) running" in node1.log()


def test_killed_remote_rank_turns_health_503(cluster) -> None:
    _, node0, node1, base = cluster
    (rank1,) = _workers(node1)
    os.kill(rank1.pid, signal.SIGKILL)
    assert node1.proc.wait(timeout=30) == 1  # the worker node notices its dead rank and stops
    # a /health that reaches rank 0 just before it exits waits out its state query (--watchdog-timeout 5 s), then
    # says 503 too; once rank 0 is gone it says 503 at once, and the server exits 1 three seconds later
    deadline = time.monotonic() + 30
    status = 200
    while time.monotonic() < deadline:
        try:
            status = httpx.get(base + "/health", timeout=20).status_code
        except httpx.HTTPError:
            status = 0  # already gone
        if status in (503, 0):
            break
        time.sleep(0.3)
    assert status in (503, 0)
    assert node0.proc.wait(timeout=60) == 1  # loud: a supervisor restarts it
    log = node0.log()
    assert "TP rank 0 of 2 is exiting" in log and "another TP rank died" in log
    assert re.search(r"the scheduler-tp0 process \(pid \d+\) exited with code \d+: failing in-flight", log), log[-3000:]
    assert "exited (code -9)" in node1.log()
