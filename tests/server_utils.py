"""Real server processes for the tests: started on a free port with their log in a file, and waited on until
healthy."""

from __future__ import annotations

import os
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import httpx
import pytest

from radixserve.utils import free_port, kill_process_tree


@dataclass
class Server:
    proc: subprocess.Popen
    base: str
    log_path: str

    def log(self) -> str:
        with open(self.log_path, encoding="utf-8", errors="replace") as f:
            return f.read()

    def log_tail(self, n: int = 60) -> str:
        return "\n".join(ln for ln in self.log().splitlines()[-n:] if "Loading" not in ln)

    def stop(self) -> None:
        if self.proc.poll() is None:
            kill_process_tree(self.proc.pid)


def start_server(log_path: str, args: list[str], env: dict[str, str] | None = None) -> Server:
    """`python -m radixserve.launch_server` on 127.0.0.1 and a free port with `args`, its output in `log_path`;
    returns once GET /health answers (the test fails with the log if the process exits first)."""
    port = free_port()
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port), *args]
    with open(log_path, "w") as log:  # the child keeps its own descriptor
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True,
                                env={**os.environ, **(env or {})})
    srv = Server(proc, f"http://127.0.0.1:{port}", log_path)
    try:
        wait_healthy(srv.base, [proc], srv.log_tail)
    except BaseException:
        srv.stop()
        raise
    return srv


@contextmanager
def serving(log_path: str, args: list[str], env: dict[str, str] | None = None) -> Iterator[Server]:
    """`start_server`, stopped (with its children) on leaving."""
    srv = start_server(log_path, args, env)
    try:
        yield srv
    finally:
        srv.stop()


def wait_healthy(base: str, procs: list[subprocess.Popen], log_tail: Callable[[], str], timeout: float = 240.0,
                 headers: dict[str, str] | None = None) -> None:
    """Poll GET /health until it answers 200; fail the test with the logs if a process exits or time runs out."""
    deadline = time.monotonic() + timeout
    while True:
        for proc in procs:
            if proc.poll() is not None:
                pytest.fail(f"a server process exited with {proc.returncode} during start-up:\n{log_tail()}")
        try:
            if httpx.get(base + "/health", timeout=5, headers=headers).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        if time.monotonic() > deadline:
            pytest.fail(f"server not healthy after {timeout:.0f} s:\n{log_tail()}")
        time.sleep(0.5)
