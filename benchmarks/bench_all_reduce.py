"""All-reduce latency between the GPUs of one machine: NCCL against the symmetric-memory one-shot / two-shot
all-reduce (radixserve.distributed.custom_all_reduce), eagerly and captured in a CUDA graph (the way a decode step
runs them: `--calls` back-to-back all-reduces in one graph, replayed).

    python benchmarks/bench_all_reduce.py --world-size 2 --sizes-kib 8 16 32 64 128 256 512 1024 4096

Every method's sum is first checked against NCCL's on random data (and against the exact sum on integers). Prints
a table (microseconds per all-reduce) and writes JSON (--result-file).
"""

from __future__ import annotations

import argparse
import json
import os
import socket
import sys
import time
import traceback
from typing import Any

import torch
import torch.distributed as dist
import torch.multiprocessing as mp

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _time_graph(fn: Any, x: torch.Tensor, calls: int, replays: int) -> float:
    """Microseconds per call of `fn(x)` when `calls` of them run back to back in one CUDA graph."""
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(3):
            fn(x)
    torch.cuda.current_stream().wait_stream(stream)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        for _ in range(calls):
            fn(x)
    for _ in range(3):
        graph.replay()
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(replays):
        graph.replay()
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / (replays * calls)


def _time_eager(fn: Any, x: torch.Tensor, iters: int) -> float:
    for _ in range(5):
        fn(x)
    if not x.is_cuda:  # the CPU dry run (gloo): wall time
        dist.barrier()
        t0 = time.perf_counter()
        for _ in range(iters):
            fn(x)
        return (time.perf_counter() - t0) * 1e6 / iters
    torch.cuda.synchronize()
    dist.barrier()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    for _ in range(iters):
        fn(x)
    end.record()
    torch.cuda.synchronize()
    return start.elapsed_time(end) * 1000.0 / iters


def _fused(ar: Any, hidden: int, device: str, dtype: torch.dtype, prefetch_mb: int = 0) -> Any:
    zeros: dict[int, torch.Tensor] = {}
    weight = torch.ones(hidden, device=device, dtype=dtype)
    kw = {}
    if prefetch_mb:  # the spare programs ask the L2 for the first prefetch_mb of a 256 MiB "next weight"
        ar.add_norm.prefetch_bytes = prefetch_mb << 20
        kw["prefetch"] = torch.zeros(256 << 20, dtype=torch.uint8, device=device)

    def fn(t: torch.Tensor) -> torch.Tensor:
        x = t.view(-1, hidden)
        if x.shape[0] not in zeros:
            zeros[x.shape[0]] = torch.zeros_like(x)
        if not ar.add_norm.can_fuse(x, zeros[x.shape[0]]):
            raise ValueError(f"{x.shape[0]} rows of {hidden} cannot take the fused kernel")
        return ar.add_norm(x, zeros[x.shape[0]], weight, 1e-6, **kw)[1].view(-1)

    return fn


def _worker(rank: int, world: int, port: int, args: argparse.Namespace) -> None:
    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
    cuda = args.device == "cuda"
    if cuda:
        torch.cuda.set_device(rank)
        dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world,
                                device_id=torch.device("cuda", rank))
    else:
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=world)
    device = f"cuda:{rank}" if cuda else "cpu"
    cpu_group = dist.new_group(backend="gloo")
    from radixserve.distributed.custom_all_reduce import CustomAllReduce

    dtype = getattr(torch, args.dtype)
    max_bytes = max(args.sizes_kib) * 1024
    os.environ["RADIXSERVE_ONE_SHOT"] = "torch"  # PyTorch's one- and two-shot kernels
    torch_ar = CustomAllReduce(dist.group.WORLD, cpu_group, device, dtypes=(dtype,), max_bytes=max_bytes)
    os.environ["RADIXSERVE_ONE_SHOT"] = "triton"  # the pull one-shot (flags), PyTorch's two-shot above
    ar = CustomAllReduce(dist.group.WORLD, cpu_group, device, dtypes=(dtype,), max_bytes=max_bytes)
    os.environ["RADIXSERVE_ONE_SHOT"] = "push"  # the default: the flag-free push one-shot, PyTorch's two-shot above
    push_ar = CustomAllReduce(dist.group.WORLD, cpu_group, device, dtypes=(dtype,), max_bytes=max_bytes)
    result: dict[str, Any] = {"custom_enabled": ar.enabled and torch_ar.enabled,
                              "disabled_reason": ar.disabled_reason or torch_ar.disabled_reason, "rows": [],
                              "auto_one_shot_max_kib": ar.one_shot_max_bytes // 1024}

    def nccl(t: torch.Tensor) -> torch.Tensor:
        dist.all_reduce(t)
        return t

    methods = {"nccl": nccl}
    if ar.enabled:
        methods.update({"one_shot": torch_ar.one_shot, "two_shot": torch_ar.two_shot, "triton": ar.one_shot,
                        "auto": push_ar.all_reduce if push_ar.enabled else ar.all_reduce})
        if push_ar.enabled:
            methods["push"] = push_ar.one_shot
        # the all-reduce fused with the residual add + RMSNorm (rows of --hidden); returns the new residual, which
        # with a zero residual is the sum
        for name, impl in (("triton_fused", ar), ("push_fused", push_ar)):
            if impl is not None and impl.enabled and impl.add_norm is not None:
                methods[name] = _fused(impl, args.hidden, device, dtype)
        if push_ar.enabled and "push_fused_pf" in args.methods:
            os.environ["RADIXSERVE_ONE_SHOT"] = "push"
            pf_ar = CustomAllReduce(dist.group.WORLD, cpu_group, device, dtypes=(dtype,), max_bytes=max_bytes)
            methods["push_fused_pf"] = _fused(pf_ar, args.hidden, device, dtype, args.prefetch_mb)
    methods = {k: v for k, v in methods.items() if k in args.methods}
    gen = torch.Generator(device=device).manual_seed(1234 + rank)
    for kib in args.sizes_kib:
        numel = kib * 1024 // torch.finfo(dtype).bits * 8
        x = torch.randn(numel, generator=gen, device=device, dtype=torch.float32).to(dtype)
        ints = torch.randint(-8, 8, (numel,), generator=gen, device=device).to(dtype)
        ref = nccl(x.clone())
        int_ref = nccl(ints.clone())
        row: dict[str, Any] = {"kib": kib}
        for name, fn in methods.items():
            # the direct kernel calls take only what the engine would give them (their buffers end there)
            limit = {"one_shot": torch_ar.one_shot_max_bytes, "triton": ar.one_shot_max_bytes,
                     "push": push_ar.one_shot_max_bytes}.get(name)
            if limit is not None and kib * 1024 > limit:
                continue
            if name == "two_shot" and kib * 1024 > torch_ar.max_bytes:
                continue
            try:
                got = fn(x.clone())
                got_int = fn(ints.clone())
                exact = torch.equal(got_int, int_ref)
                err = (got.float() - ref.float()).abs().max().item()
                zeros = torch.zeros_like(x)  # timed on zeros: NCCL sums in place, the values must not blow up
                row[name] = {"graph_us": _time_graph(fn, zeros, args.calls, args.replays) if cuda else None,
                             "eager_us": _time_eager(fn, zeros, args.eager_iters),
                             "exact_int_sum": exact, "max_abs_diff_vs_nccl": err}
            except Exception as e:  # noqa: BLE001 - report and go on with the next method
                row[name] = {"error": f"{type(e).__name__}: {e}"}
                if rank == 0:
                    traceback.print_exc()
        result["rows"].append(row)
    if rank == 0:
        result.update({"world_size": world, "dtype": args.dtype, "calls_per_graph": args.calls,
                       "device": torch.cuda.get_device_name(0) if cuda else "cpu", "torch": torch.__version__})
        report(result, args.result_file)
    dist.barrier()
    dist.destroy_process_group()


def report(result: dict[str, Any], result_file: str | None) -> None:
    print(f"custom all-reduce enabled: {result['custom_enabled']} {result['disabled_reason'] or ''}")
    if "triton_error" in result:
        print("triton one-shot not set up:", result["triton_error"])
    names = [n for n in ("nccl", "one_shot", "two_shot", "triton", "push", "triton_fused", "push_fused",
                         "push_fused_pf", "auto")
             if any(n in r for r in result["rows"])]
    print("microseconds per all-reduce; graph = inside a CUDA graph of back-to-back calls")
    print(f"{'KiB':>6} " + " ".join(f"{n + ' graph':>14} {n + ' eager':>14}" for n in names) + "  exact int sums")
    for row in result["rows"]:
        cells, exact = [], []
        for n in names:
            r = row.get(n)
            if r is None or "error" in r:
                cells.append(f"{'-':>14} {'-':>14}")
                continue
            g = f"{r['graph_us']:.2f}" if r["graph_us"] is not None else "-"
            cells.append(f"{g:>14} {r['eager_us']:>14.2f}")
            exact.append(f"{n}={'y' if r['exact_int_sum'] else 'N'}")
        print(f"{row['kib']:>6} " + " ".join(cells) + "  " + ",".join(exact))
    print(json.dumps(result))
    if result_file:
        with open(result_file, "w") as f:
            json.dump(result, f, indent=1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--world-size", type=int, default=2)
    parser.add_argument("--sizes-kib", type=int, nargs="+", default=[8, 16, 32, 64, 128, 256, 512, 1024, 4096])
    parser.add_argument("--dtype", default="bfloat16", choices=("bfloat16", "float16", "float32"))
    parser.add_argument("--calls", type=int, default=64, help="all-reduces per captured graph (a decode step: 64)")
    parser.add_argument("--replays", type=int, default=20)
    parser.add_argument("--eager-iters", type=int, default=50)
    parser.add_argument("--device", default="cuda", choices=("cuda", "cpu"), help="cpu: a gloo dry run (NCCL "
                        "only, no graphs)")
    parser.add_argument("--methods", nargs="+", default=["nccl", "one_shot", "two_shot", "triton", "auto"],
                        choices=("nccl", "one_shot", "two_shot", "auto", "triton", "push", "triton_fused",
                                 "push_fused", "push_fused_pf"),
                        help="one_shot / two_shot: PyTorch's symmetric-memory kernels; triton: the one-barrier "
                             "Triton one-shot (radixserve/distributed/triton_all_reduce.py); push: the flag-free "
                             "push one-shot (push_all_reduce.py); auto: what the engine does (push one-shot, then "
                             "PyTorch's two-shot, then NCCL)")
    parser.add_argument("--hidden", type=int, default=4096, help="row width of the *_fused methods (all-reduce + "
                        "residual add + RMSNorm in one kernel)")
    parser.add_argument("--prefetch-mb", type=int, default=16, help="push_fused_pf: MiB of the next weight the "
                        "fused kernel's spare programs ask into the L2")
    parser.add_argument("--result-file", default=None)
    args = parser.parse_args()
    if args.device == "cuda" and torch.cuda.device_count() < args.world_size:
        raise SystemExit(f"needs {args.world_size} GPUs, {torch.cuda.device_count()} visible")
    mp.start_processes(_worker, args=(args.world_size, _free_port(), args), nprocs=args.world_size, join=True,
                       start_method="spawn")


if __name__ == "__main__":
    main()
