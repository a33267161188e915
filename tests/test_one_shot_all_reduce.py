"""The Triton one-shot all-reduces on the CPU: the push kernels (radixserve/distributed/push_all_reduce.py) and the
pull kernels (triton_all_reduce.py, flags and remote reads). Two processes map each other's buffers (shared memory,
as symmetric memory maps them between GPUs) and run the kernels under TRITON_INTERPRET=1 (conftest). Sums equal the
exact ones, back to back over more calls than there are slots, with messages of varying sizes and rows of varying
widths, negative zeros in the data, and the fused add + RMSNorm equal to the unfused kernels; the pull kernels also
across the wrap of their int32 call counters. The GPU version: tests/gpu/test_custom_all_reduce_gpu.py."""

from __future__ import annotations

import os
import time

import pytest
import torch
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="CPU shared-memory version; tests/gpu on CUDA")

WORLD = 2


def _skew(rank: int, call: int) -> None:
    """The ranks take turns to arrive late: the early one polls its slots before the data is there (a stale or
    uncleared slot would be read as arrived)."""
    if call % 2 == rank:
        time.sleep(0.3)


def _kernels(kind: str, rank: int, shared: list[list[dict[torch.dtype, torch.Tensor]]]):  # noqa: ANN202
    """(plain one-shot, fused one-shot) of `kind` over the shared tensors: shared[rank] = [one-shot buffers, fused
    buffers] (push), + [one-shot flags, fused flags] (pull)."""
    from radixserve.distributed.one_shot_common import SymmBuffers

    def buffers(which: int, regions: int, cls: type = SymmBuffers) -> SymmBuffers:
        bufs = {}
        for dtype in shared[0][which]:
            ptrs = torch.tensor([shared[r][which][dtype].data_ptr() for r in range(WORLD)], dtype=torch.int64)
            bufs[dtype] = (shared[rank][which][dtype], ptrs, shared[rank][which][dtype].numel() // regions)
        return cls(rank, WORLD, bufs, "cpu")

    if kind == "push":
        from radixserve.distributed.push_all_reduce import PushAddRMSNorm, PushBuffers, PushOneShot

        return (PushOneShot(buffers(0, 3 * WORLD, PushBuffers), max_bytes=4096 * 4),
                PushAddRMSNorm(buffers(1, 3 * WORLD, PushBuffers), max_rows=3))
    from radixserve.distributed.triton_all_reduce import PullBuffers, TritonAllReduceAddNorm, TritonOneShot

    one_shot = TritonOneShot(PullBuffers(buffers(0, 2), buffers(2, WORLD)), max_bytes=4096 * 4)
    fused = TritonAllReduceAddNorm(PullBuffers(buffers(1, 2), buffers(3, WORLD)), max_bytes=3 * 8192 * 4)
    for b in (one_shot.b, fused.b):  # the int32 call counters wrap after the first calls
        for c in b.data.counters.values():
            c.fill_(2**31 - 3)
    return one_shot, fused


def _rank(rank: int, kind: str, shared: list[list[dict[torch.dtype, torch.Tensor]]], results: dict) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from radixserve.layers.triton_ops.norm import fused_add_rmsnorm

    one_shot, fused = _kernels(kind, rank, shared)
    out = {}
    g = torch.Generator().manual_seed(0)  # the same stream on both ranks: rank r's data is (r + 1) * base
    for call, (numel, dtype) in enumerate([(2048, torch.bfloat16), (8, torch.float32), (1500, torch.bfloat16),
                                           (3000, torch.float32), (16, torch.bfloat16), (2048, torch.bfloat16),
                                           (7, torch.float32)]):
        base = torch.randint(-64, 64, (numel,), generator=g).to(dtype)
        x = base * (rank + 1)
        x[::5] = -0.0  # negative zeros: the sentinel's bits, they must travel as zeros
        _skew(rank, call)
        got = one_shot(x)
        want = base * 3
        want[::5] = 0.0
        out[f"oneshot-{call}"] = torch.equal(got, want) and not torch.signbit(got[::5]).any().item()
    f32, bf16 = torch.float32, torch.bfloat16
    for call, (rows, cols, dtype) in enumerate([(1, 64, f32), (3, 100, bf16), (2, 64, f32), (1, 130, f32),
                                                (3, 64, bf16), (3, 64, f32), (2, 100, bf16), (1, 64, f32),
                                                (1, 64, bf16), (2, 130, f32)]):
        # small integers: the sum over ranks is exact (the interpreter may round float32 to bfloat16 otherwise
        # than torch does), the add + norm after it is compared with the unfused kernel
        base = torch.randint(-8, 8, (rows, cols), generator=g).to(dtype)
        res = torch.randn(rows, cols, generator=g).to(dtype)
        w = torch.rand(cols, generator=g).to(dtype)
        x = base * (rank + 1)
        want_out, want_res = fused_add_rmsnorm((base * (rank + 1)) + (base * (2 - rank)), res, w, 1e-6)
        _skew(rank, call)
        got_out, got_res = fused(x if rank == 0 else base * 2, res, w, 1e-6)
        out[f"fused-{call}-res"] = torch.equal(got_res, want_res)
        tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
        out[f"fused-{call}-out"] = torch.allclose(got_out, want_out, rtol=tol, atol=tol)
    results[rank] = out


@pytest.mark.parametrize("kind", ["push", "pull"])
def test_one_shot_all_reduce_two_processes(kind: str) -> None:
    from radixserve.distributed.one_shot_common import MAX_PROGRAMS
    from radixserve.distributed.push_all_reduce import PushBuffers

    dtypes = (torch.bfloat16, torch.float32)
    shared = []
    for _ in range(WORLD):
        per = []
        # the one-shot's slots (16 KiB of float32), the fused one's (3 rows of up to 8192)
        for numel in (4 * 1024, 3 * 8192):
            bufs = {}
            for d in dtypes:
                if kind == "push":
                    t = torch.empty(3 * WORLD * numel, dtype=d).share_memory_()
                    PushBuffers.fill(t)
                else:  # two halves of this rank's message
                    t = torch.zeros(2 * numel, dtype=d).share_memory_()
                bufs[d] = t
            per.append(bufs)
        if kind == "pull":  # flags: one per program and source rank, per message dtype
            per += [{d: torch.zeros(WORLD * MAX_PROGRAMS, dtype=torch.int32).share_memory_() for d in dtypes}
                    for _ in range(2)]
        shared.append(per)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(kind, shared, results), nprocs=WORLD, join=True, start_method="spawn")
        got = dict(results)
    for rank in range(WORLD):
        bad = [k for k, v in got[rank].items() if not v]
        assert not bad, (rank, bad)
