"""On two GPUs: the symmetric-memory all-reduce (PyTorch's one-shot and two-shot, the Triton pull one-shot, the
push one-shot) gives NCCL's sums, eagerly and replayed
from a CUDA graph, for decode-sized messages; TP=2 with it decodes the same greedy tokens as with NCCL only and
as TP=1. Skipped with fewer than two GPUs.

The rank processes print how long each stage took (run pytest with -s to see it) and leave with `os._exit` once
their results are handed over: tearing down NCCL communicators whose kernels CUDA graphs captured can hang at
interpreter exit."""

from __future__ import annotations

import os
import socket
import sys
import time
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _check_torch_one_shot(ar, rank: int, out: dict) -> None:
    """PyTorch's one-shot / two-shot kernels and the size dispatch, eager and in a CUDA graph, against NCCL."""
    g = torch.Generator(device="cuda").manual_seed(rank)
    for dtype in (torch.bfloat16, torch.float32):
        for numel in (8, 4096, 8192 * 3, 200_000):
            x = torch.randn(numel, 3, device="cuda", generator=g).to(dtype)
            want = x.clone()
            dist.all_reduce(want)
            fns = (("auto", ar.all_reduce), ("one", ar.one_shot), ("two", ar.two_shot)) if ar.should_use(x) else ()
            for name, fn in fns:
                got = fn(x)
                out[f"{dtype}-{numel}-{name}"] = torch.allclose(got.float(), want.float(), rtol=1e-2, atol=1e-2)
            # in a graph: three chained all-reduces, replayed twice with new inputs
            static = x.clone()
            stream = torch.cuda.Stream()
            stream.wait_stream(torch.cuda.current_stream())
            reduce = ar.all_reduce if ar.should_use(x) else (lambda t: dist.all_reduce(t) or t)
            with torch.cuda.stream(stream):
                reduce(static.clone())
            torch.cuda.current_stream().wait_stream(stream)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                y = reduce(static.clone()) * 0.5
                y = reduce(y) * 0.5
                y = reduce(y)
            for rep in range(2):
                static.copy_(torch.full_like(x, float(rank + rep)))
                graph.replay()
                torch.cuda.synchronize()
                expect = torch.full_like(x.float(), 2.0 * rep + 1.0)  # sum of rank + rep over 2 ranks
                out[f"{dtype}-{numel}-graph{rep}"] = torch.equal(y.float(), expect)
            del graph


def _check_triton(tr, rank: int, out: dict) -> None:
    """The Triton one-shot and its fusion with the residual add + RMSNorm, back to back (the buffer halves
    alternate), eagerly and in a CUDA graph, against NCCL's sum and the unfused add + RMSNorm kernel."""
    from radixserve.layers.triton_ops.norm import fused_add_rmsnorm

    g = torch.Generator(device="cuda").manual_seed(10 + rank)
    for dtype in (torch.bfloat16, torch.float32):
        for rows in (1, 3, 16):  # up to 256 KiB in float32: the one-shot buffer set up below
            x = torch.randn(rows, 4096, device="cuda", generator=g).to(dtype)
            res = torch.randn(rows, 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
            res = res.to(dtype)
            w = torch.rand(4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(8)).to(dtype)
            summed = x.clone()
            dist.all_reduce(summed)
            want_out, want_res = fused_add_rmsnorm(summed, res, w, 1e-5)
            for rep in range(3):
                got_out, got_res = tr.fused_add_rmsnorm(x, res, w, 1e-5)
                out[f"fused-{dtype}-{rows}-{rep}-res"] = torch.equal(got_res, want_res)
                # the norm's float32 row sum may be reduced in another order than the unfused kernel's
                tol = 1e-2 if dtype == torch.bfloat16 else 1e-5
                out[f"fused-{dtype}-{rows}-{rep}-out"] = torch.allclose(got_out, want_out, rtol=tol, atol=tol)
                out[f"oneshot-{dtype}-{rows}-{rep}"] = torch.equal(tr.one_shot(x), summed)
    # in a graph, as a decode step runs them: plain one-shot, then fused, replayed with new inputs
    x = torch.zeros(2, 1024, device="cuda")
    res, w = torch.ones_like(x), torch.ones(1024, device="cuda")
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        tr.fused_add_rmsnorm(tr.one_shot(x), res, w, 1e-6)
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph, stream=stream):
        s = tr.one_shot(x)
        normed, new_res = tr.fused_add_rmsnorm(s, res, w, 1e-6)
    for rep in range(3):
        x.fill_(float(rank + rep))
        graph.replay()
        torch.cuda.synchronize()
        # s = sum over ranks of rank + rep = 1 + 2 rep on each rank; fused: all-reduce(s) + 1 = 2 (1 + 2 rep) + 1
        out[f"graph-{rep}-oneshot"] = torch.equal(s, torch.full_like(s, 1.0 + 2 * rep))
        out[f"graph-{rep}-res"] = torch.equal(new_res, torch.full_like(s, 3.0 + 4 * rep))
        out[f"graph-{rep}-norm"] = torch.allclose(normed, torch.ones_like(s))
    del graph


def _rank(rank: int, port: int, results: dict) -> None:
    from radixserve.distributed.custom_all_reduce import CustomAllReduce

    t0 = time.monotonic()

    def stage(what: str) -> None:
        print(f"[rank {rank} +{time.monotonic() - t0:.1f}s] {what}", file=sys.stderr, flush=True)

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    cpu_group = dist.new_group(backend="gloo")
    stage("process groups up")
    out: dict = {}
    os.environ["RADIXSERVE_ONE_SHOT"] = "torch"  # PyTorch's one-shot kernel first, then the Triton one
    ar = CustomAllReduce(dist.group.WORLD, cpu_group, f"cuda:{rank}", max_bytes=1 << 20,
                         one_shot_max_bytes=64 << 10)
    out["enabled"], out["reason"] = ar.enabled, ar.disabled_reason
    stage(f"PyTorch one-shot set up (enabled: {ar.enabled})")
    if ar.enabled:
        _check_torch_one_shot(ar, rank, out)
    stage("PyTorch one-shot / two-shot checked")
    os.environ["RADIXSERVE_ONE_SHOT"] = "triton"
    tr = CustomAllReduce(dist.group.WORLD, cpu_group, f"cuda:{rank}", max_bytes=1 << 20,
                         one_shot_max_bytes=256 << 10)
    out["triton_enabled"] = tr.enabled and tr.add_norm is not None
    out["triton_reason"] = tr.disabled_reason
    stage(f"Triton one-shot set up (enabled: {out['triton_enabled']})")
    if out["triton_enabled"]:
        _check_triton(tr, rank, out)
    stage("Triton one-shot and fused add + RMSNorm checked")
    os.environ["RADIXSERVE_ONE_SHOT"] = "push"
    pu = CustomAllReduce(dist.group.WORLD, cpu_group, f"cuda:{rank}", max_bytes=1 << 20, one_shot_max_bytes=256 << 10)
    out["push_enabled"] = pu.enabled and pu.add_norm is not None
    out["push_reason"] = pu.disabled_reason
    stage(f"push one-shot set up (enabled: {out['push_enabled']})")
    if out["push_enabled"]:
        sub: dict = {}
        _check_triton(pu, rank, sub)
        out.update({f"push-{k}": v for k, v in sub.items()})
        # with the next weight's start asked into the L2 by the spare programs: the same results
        pu.add_norm.prefetch_bytes = 8 << 20
        nxt = torch.zeros(32 << 20, dtype=torch.uint8, device="cuda")
        x = torch.full((2, 4096), float(rank + 1), device="cuda", dtype=torch.bfloat16)
        for rep in range(4):
            normed, new_res = pu.fused_add_rmsnorm(x, torch.ones_like(x), torch.ones_like(x[0]), 1e-6, nxt)
            out[f"push-prefetch-{rep}"] = torch.equal(new_res, torch.full_like(x, 4.0)) and \
                torch.equal(normed, torch.ones_like(x))
        # the all-gather through the one-shot (the logits): NCCL's concatenation, bit for bit, inf and -0.0 kept
        # as values; too large a result is left to NCCL (None)
        g = torch.Generator(device="cuda").manual_seed(20 + rank)
        for shape, dim, dtype in (((1, 1000), -1, torch.bfloat16), ((3, 512), 1, torch.float32),
                                  ((4, 8), 0, torch.bfloat16)):
            x = torch.randn(shape, device="cuda", generator=g).to(dtype)
            x.view(-1)[0] = float("inf") if rank else -0.0
            parts = [torch.empty_like(x) for _ in range(2)]
            dist.all_gather(parts, x)
            got = pu.all_gather(x, dim)
            out[f"push-gather-{shape}-{dim}"] = got is not None and torch.equal(got, torch.cat(parts, dim))
        out["push-gather-too-large"] = pu.all_gather(torch.zeros(1, 100_000, device="cuda"), -1) is None
    stage("push one-shot and its fused add + RMSNorm checked")
    results[rank] = out
    dist.barrier(group=cpu_group)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def test_custom_all_reduce_equals_nccl_eager_and_in_graphs() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(_free_port(), results), nprocs=2, join=True, start_method="spawn")
        got = dict(results)
    for rank in (0, 1):
        assert got[rank]["enabled"], got[rank]["reason"]
        assert got[rank]["triton_enabled"], got[rank]["triton_reason"]
        assert got[rank]["push_enabled"], got[rank]["push_reason"]
        bad = [k for k, v in got[rank].items() if v is False and not k.endswith("enabled")]
        assert not bad, bad


PROMPTS = [[1, 5, 9, 33, 2], list(range(40, 70)), [7] * 12]
GREEDY = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}


def _generate(path: str, **kw) -> list[list[int]]:
    from radixserve import Engine

    t0 = time.monotonic()
    with Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", max_total_tokens=4096,
                cuda_graph_max_bs=4, prefill_cuda_graph_max_tokens=0, log_level="warning", **kw) as engine:
        t1 = time.monotonic()
        outs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    print(f"engine {kw}: start {t1 - t0:.1f}s, generate + shutdown {time.monotonic() - t1:.1f}s", file=sys.stderr)
    return outs


@pytest.fixture(scope="module")
def tiny_llama(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A float32 tiny llama and TP=1's greedy tokens on it."""
    from model_utils import make_tiny_model

    path = str(tmp_path_factory.mktemp("tiny_llama_car"))
    make_tiny_model("llama", path, seed=3, initializer_range=0.3)
    return path, _generate(path, tp_size=1)


def test_tp2_pull_all_reduce_greedy_equals_tp1(tiny_llama, monkeypatch) -> None:
    """TP=2 through the pull one-shot (flags) fused with add + RMSNorm, CUDA graphs on."""
    path, want = tiny_llama
    monkeypatch.setenv("RADIXSERVE_ONE_SHOT", "triton")  # the scheduler processes inherit it
    assert _generate(path, tp_size=2) == want


def test_tp2_push_all_reduce_greedy_equals_tp1(tiny_llama, monkeypatch) -> None:
    """TP=2 through the flag-free push one-shot fused with add + RMSNorm (the default), CUDA graphs on, with the
    fused kernel's spare programs asking the L2 for the next weight."""
    path, want = tiny_llama
    monkeypatch.setenv("RADIXSERVE_AR_PREFETCH_MB", "16")  # the scheduler processes inherit it
    assert _generate(path, tp_size=2) == want


def test_tp2_nccl_only_greedy_equals_tp1(tiny_llama) -> None:
    path, want = tiny_llama
    assert _generate(path, tp_size=2, disable_custom_all_reduce=True) == want
