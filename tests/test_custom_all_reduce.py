"""The custom all-reduce's dispatch and its all-or-nothing setup (the CUDA kernels themselves are tested on two GPUs
in tests/gpu/test_custom_all_reduce_gpu.py)."""

from __future__ import annotations

import os
import socket

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from radixserve.distributed.custom_all_reduce import CustomAllReduce
from radixserve.server_args import ServerArgs


def _bare(one_shot_max: int = 1024, max_bytes: int = 4096) -> CustomAllReduce:
    """An instance with CPU 'buffers', no group: for the size rules only."""
    ar = object.__new__(CustomAllReduce)
    ar.max_bytes, ar.one_shot_max_bytes, ar.disabled_reason = max_bytes, one_shot_max, None
    ar.buffers = {torch.bfloat16: torch.empty(max_bytes // 2, dtype=torch.bfloat16)}
    return ar


def test_should_use_only_aligned_contiguous_cuda_messages_up_to_the_limit(monkeypatch) -> None:
    ar = _bare()
    monkeypatch.setattr(torch.Tensor, "is_cuda", property(lambda self: True))  # the rule, not the device
    assert ar.should_use(torch.zeros(8, dtype=torch.bfloat16))  # 16 bytes
    assert ar.should_use(torch.zeros(2048, dtype=torch.bfloat16))  # exactly max_bytes
    assert not ar.should_use(torch.zeros(2056, dtype=torch.bfloat16))  # over the limit: NCCL
    assert not ar.should_use(torch.zeros(7, dtype=torch.bfloat16))  # 14 bytes: not a multiple of 16
    assert not ar.should_use(torch.zeros(8, dtype=torch.float32))  # no buffer of that dtype
    assert not ar.should_use(torch.zeros(16, 8, dtype=torch.bfloat16).t())  # not contiguous
    assert not ar.should_use(torch.zeros(0, dtype=torch.bfloat16))
    ar.disabled_reason = "off"
    assert not ar.should_use(torch.zeros(8, dtype=torch.bfloat16))


def test_all_reduce_picks_one_shot_for_small_and_two_shot_for_larger(monkeypatch) -> None:
    ar = _bare(one_shot_max=1024)
    calls = []
    monkeypatch.setattr(ar, "one_shot", lambda x: calls.append(("one", x.numel())) or x, raising=False)
    monkeypatch.setattr(ar, "two_shot", lambda x: calls.append(("two", x.numel())) or x, raising=False)
    ar.all_reduce(torch.zeros(512, dtype=torch.bfloat16))  # 1024 bytes
    ar.all_reduce(torch.zeros(520, dtype=torch.bfloat16))
    assert calls == [("one", 512), ("two", 520)]


def test_server_args_flag() -> None:
    assert ServerArgs().disable_custom_all_reduce is False
    import argparse

    parser = argparse.ArgumentParser()
    ServerArgs.add_cli_args(parser)
    args = ServerArgs.from_cli_args(parser.parse_args(["--disable-custom-all-reduce"]))
    assert args.disable_custom_all_reduce is True


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank(rank: int, port: int, failing_rank: int, results: dict) -> None:
    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2)
    cpu_group = dist.new_group(backend="gloo")

    def setup(self, dtypes):  # rank `failing_rank` cannot map the peer's memory; the other one can
        if rank == failing_rank:
            raise RuntimeError("no peer access")

    CustomAllReduce._setup = setup
    CustomAllReduce._self_test = lambda self: None
    ar = CustomAllReduce(dist.group.WORLD, cpu_group, "cpu")
    results[rank] = (ar.enabled, ar.disabled_reason)
    dist.destroy_process_group()


@pytest.mark.integration
@pytest.mark.parametrize("failing_rank", [0, 1])
def test_a_rank_that_cannot_set_up_turns_it_off_on_every_rank(failing_rank: int) -> None:
    """Were one rank to use the custom path and the other NCCL, their collectives would never match: the ranks
    agree, and a failure on any rank means NCCL on all."""
    os.environ.setdefault("GLOO_SOCKET_IFNAME", "lo")
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(_free_port(), failing_rank, results), nprocs=2, join=True,
                           start_method="spawn")
        got = dict(results)
    assert got[failing_rank] == (False, "RuntimeError: no peer access")
    assert got[1 - failing_rank] == (False, "another rank could not set it up")
