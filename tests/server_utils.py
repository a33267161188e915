"""Waiting for a real server process (started by a test) to report healthy."""

from __future__ import annotations

import subprocess
import time
from collections.abc import Callable

import httpx
import pytest


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
