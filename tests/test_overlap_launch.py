"""The overlap client hands a queued batch to the forward thread and returns once that thread has launched it (the
two threads share the GIL: the device should not wait for the scheduler's Python), never longer than
LAUNCH_WAIT_S, and whatever the forward does (fails, or waits for the scheduler after its launch). On the CPU, where
the forward computes as it is called, it does not wait."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from types import SimpleNamespace
from typing import Any

import pytest
import torch

from radixserve.managers import tp_worker_overlap_thread as overlap
from radixserve.managers.tp_worker_overlap_thread import TpModelWorkerClient


@pytest.fixture(autouse=True)
def _no_cuda_device(monkeypatch) -> None:
    monkeypatch.setattr(torch.cuda, "set_device", lambda *a: None)  # the fake "CUDA" workers run on the CPU


class FakeWorker:
    """Stands in for TpModelWorker: `plan(batch)` says what each batch's forward does."""

    def __init__(self, plan: Any, is_cuda: bool = True) -> None:
        self.device = "cpu"
        self.max_total_num_tokens = 64
        self.max_running_requests = 4
        self.model_runner = SimpleNamespace(is_cuda=is_cuda, device="cpu")  # as if launches were asynchronous
        self.future_token_ids_map = torch.zeros(64, dtype=torch.int64)
        self.plan = plan
        self.log: list[tuple[str, int, float]] = []

    def forward_batch_generation(self, batch: Any, future_slots: Any = None, on_launch: Any = None) -> Any:
        return self.plan(self, batch, on_launch)

    def copy_result_to_host(self, result: Any) -> None:
        return None


def batch(i: int) -> Any:
    return SimpleNamespace(seq_lens=[0], i=i)


@contextmanager
def running(worker: FakeWorker) -> Iterator[TpModelWorkerClient]:
    client = TpModelWorkerClient(worker)
    try:
        yield client
    finally:
        client.shutdown()


def submit(client: TpModelWorkerClient, i: int) -> float:
    """Queue batch i; the seconds forward_batch_generation took to return."""
    t0 = time.perf_counter()
    client.forward_batch_generation(batch(i))
    return time.perf_counter() - t0


def test_returns_once_the_forward_is_launched(monkeypatch) -> None:
    monkeypatch.setattr(overlap, "LAUNCH_WAIT_S", 5.0)  # returning early can only be the launch's doing
    after_launch = threading.Event()

    def plan(w: FakeWorker, b: Any, on_launch: Any) -> Any:
        time.sleep(0.01)  # building the batch's device tensors
        w.log.append(("launch", b.i, time.perf_counter()))
        on_launch()
        after_launch.wait(5)  # sampling etc.: the scheduler does not wait for this
        return ("result", b.i)

    w = FakeWorker(plan)
    with running(w) as client:
        took = submit(client, 1)
        back = time.perf_counter()
        assert w.log and w.log[0][:2] == ("launch", 1) and w.log[0][2] <= back
        assert took < 2.5
        after_launch.set()
        assert client.resolve_batch_result() == ("result", 1)


def test_a_failed_forward_or_a_slow_thread_never_blocks_the_scheduler(monkeypatch) -> None:
    monkeypatch.setattr(overlap, "LAUNCH_WAIT_S", 0.3)
    gate = threading.Event()

    def plan(w: FakeWorker, b: Any, on_launch: Any) -> Any:
        if b.i == 1:
            raise RuntimeError("boom")  # no launch: released anyway
        if b.i == 2:
            gate.wait(5)  # e.g. an adapter load before its launch: the scheduler goes on after LAUNCH_WAIT_S
        on_launch()
        return ("result", b.i)

    with running(FakeWorker(plan)) as client:
        assert submit(client, 1) < 0.25  # released by the failure, not by the timeout
        try:
            client.resolve_batch_result()
            raise AssertionError("the failure was not surfaced")
        except RuntimeError as e:
            assert "boom" in str(e)
        waited = submit(client, 2)
        assert 0.29 <= waited < 2.5  # the bound, then on
        gate.set()
        assert client.resolve_batch_result() == ("result", 2)
        submit(client, 3)
        assert client.resolve_batch_result() == ("result", 3)


def test_a_forward_waiting_for_the_scheduler_after_its_launch_does_not_deadlock(monkeypatch) -> None:
    """Overlap with grammars: a batch's mask is handed over after the scheduler processed the previous result,
    which it does only once forward_batch_generation returned."""
    mask_ready = threading.Event()

    def plan(w: FakeWorker, b: Any, on_launch: Any) -> Any:
        on_launch()
        assert mask_ready.wait(5), "the scheduler never handed the mask over"
        return ("result", b.i)

    monkeypatch.setattr(overlap, "LAUNCH_WAIT_S", 5.0)
    with running(FakeWorker(plan)) as client:
        assert submit(client, 1) < 2.5  # the launch released it; the mask is handed over only after
        mask_ready.set()
        assert client.resolve_batch_result() == ("result", 1)


def test_on_the_cpu_the_scheduler_does_not_wait_for_the_forward(monkeypatch) -> None:
    monkeypatch.setattr(overlap, "LAUNCH_WAIT_S", 5.0)
    done = threading.Event()

    def plan(w: FakeWorker, b: Any, on_launch: Any) -> Any:
        done.wait(5)  # the CPU forward: it is computing, not launching
        on_launch()
        return ("result", b.i)

    with running(FakeWorker(plan, is_cuda=False)) as client:
        assert submit(client, 1) < 1.0 and not done.is_set()  # back while the forward still runs
        done.set()
        assert client.resolve_batch_result() == ("result", 1)
        submit(client, 2)  # no release was left over
        assert client.resolve_batch_result() == ("result", 2)
