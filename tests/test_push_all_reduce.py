"""The push one-shot all-reduce (radixserve/distributed/push_all_reduce.py) on the CPU: two processes map each
other's receive buffers (shared memory, as symmetric memory maps them between GPUs) and run the kernels under
TRITON_INTERPRET=1 (conftest). Sums equal the exact ones, back to back over more calls than there are slots, with
messages of varying sizes and rows of varying widths, negative zeros in the data, and the fused add + RMSNorm equal
to the unfused kernels. The GPU version: tests/gpu/test_custom_all_reduce_gpu.py."""

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


def _rank(rank: int, shared: list[dict[torch.dtype, torch.Tensor]], results: dict) -> None:
    os.environ["TRITON_INTERPRET"] = "1"
    from radixserve.distributed.push_all_reduce import PushAddRMSNorm, PushBuffers, PushOneShot
    from radixserve.layers.triton_ops.norm import fused_add_rmsnorm

    def buffers(which: int) -> PushBuffers:
        bufs = {}
        for dtype in shared[0][which]:
            ptrs = torch.tensor([shared[r][which][dtype].data_ptr() for r in range(WORLD)], dtype=torch.int64)
            bufs[dtype] = (shared[rank][which][dtype], ptrs, shared[rank][which][dtype].numel() // (3 * WORLD))
        return PushBuffers(rank, WORLD, bufs, "cpu")

    one_shot = PushOneShot(buffers(0), max_bytes=4096 * 4)
    fused = PushAddRMSNorm(buffers(1), max_rows=3)
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


def test_push_all_reduce_two_processes() -> None:
    from radixserve.distributed.push_all_reduce import PushBuffers

    dtypes = (torch.bfloat16, torch.float32)
    shared = []
    for _ in range(WORLD):
        per = []
        for numel in (4 * 1024, 3 * 8192):  # the one-shot's slots (16 KiB of float32), the fused one's (3 rows)
            bufs = {}
            for d in dtypes:
                t = torch.empty(3 * WORLD * numel, dtype=d).share_memory_()
                PushBuffers.fill(t)
                bufs[d] = t
            per.append(bufs)
        shared.append(per)
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(shared, results), nprocs=WORLD, join=True, start_method="spawn")
        got = dict(results)
    for rank in range(WORLD):
        bad = [k for k, v in got[rank].items() if not v]
        assert not bad, (rank, bad)
