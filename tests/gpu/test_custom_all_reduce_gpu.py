"""On two GPUs: the symmetric-memory all-reduce (one-shot and two-shot) gives NCCL's sums, eagerly and replayed
from a CUDA graph, for decode-sized messages; TP=2 with it decodes the same greedy tokens as with NCCL only.
Skipped with fewer than two GPUs."""

from __future__ import annotations

import socket
import sys
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


def _rank(rank: int, port: int, results: dict) -> None:
    from radixserve.distributed.custom_all_reduce import CustomAllReduce

    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=2,
                            device_id=torch.device("cuda", rank))
    cpu_group = dist.new_group(backend="gloo")
    import os

    os.environ["RADIXSERVE_ONE_SHOT"] = "torch"  # PyTorch's one-shot kernel first, then the Triton one
    ar = CustomAllReduce(dist.group.WORLD, cpu_group, f"cuda:{rank}", max_bytes=1 << 20,
                         one_shot_max_bytes=64 << 10)
    out = {"enabled": ar.enabled, "reason": ar.disabled_reason}
    if ar.enabled:
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
                    new = torch.full_like(x, float(rank + rep))
                    static.copy_(new)
                    graph.replay()
                    torch.cuda.synchronize()
                    expect = torch.full_like(x.float(), 2.0 * rep + 1.0)  # sum of rank + rep over 2 ranks
                    out[f"{dtype}-{numel}-graph{rep}"] = torch.equal(y.float(), expect)
    # the Triton one-shot and its fusion with residual add + RMSNorm
    from radixserve.layers.triton_ops.norm import fused_add_rmsnorm

    os.environ["RADIXSERVE_ONE_SHOT"] = "triton"
    tr = CustomAllReduce(dist.group.WORLD, cpu_group, f"cuda:{rank}", max_bytes=1 << 20, one_shot_max_bytes=256 << 10)
    out["triton_enabled"] = tr.enabled and tr.add_norm is not None
    if out["triton_enabled"]:
        g = torch.Generator(device="cuda").manual_seed(10 + rank)
        for rows in (1, 3, 32):
            x = torch.randn(rows, 4096, device="cuda", generator=g).to(torch.bfloat16)
            res = torch.randn(rows, 4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7))
            res = res.to(torch.bfloat16)
            w = torch.rand(4096, device="cuda", generator=torch.Generator(device="cuda").manual_seed(8))
            w = w.to(torch.bfloat16)
            summed = x.clone()
            dist.all_reduce(summed)
            want_out, want_res = fused_add_rmsnorm(summed, res, w, 1e-5)
            for rep in range(3):  # back to back: the buffer halves alternate
                got_out, got_res = tr.fused_add_rmsnorm(x, res, w, 1e-5)
                out[f"fused-{rows}-{rep}-res"] = torch.equal(got_res, want_res)
                out[f"fused-{rows}-{rep}-out"] = torch.equal(got_out, want_out)
                out[f"oneshot-{rows}-{rep}"] = torch.equal(tr.one_shot(x), summed)
    results[rank] = out
    dist.barrier()
    dist.destroy_process_group()


def test_custom_all_reduce_equals_nccl_eager_and_in_graphs() -> None:
    with mp.Manager() as manager:
        results = manager.dict()
        mp.start_processes(_rank, args=(_free_port(), results), nprocs=2, join=True, start_method="spawn")
        got = dict(results)
    for rank in (0, 1):
        assert got[rank]["enabled"], got[rank]["reason"]
        assert got[rank]["triton_enabled"]
        bad = [k for k, v in got[rank].items() if v is False and k != "enabled"]
        assert not bad, bad


def test_tp2_greedy_with_and_without_custom_all_reduce(tmp_path, monkeypatch) -> None:
    """Float32 tiny llama: TP=2 through the custom all-reduce (CUDA graphs on; the Triton one-shot fused with add +
    RMSNorm, then PyTorch's one-shot) decodes what TP=2 with NCCL only does, and what TP=1 does."""
    from model_utils import make_tiny_model

    from radixserve import Engine

    path = make_tiny_model("llama", str(tmp_path), seed=3, initializer_range=0.3)
    prompts = [[1, 5, 9, 33, 2], list(range(40, 70)), [7] * 12]
    greedy = {"max_new_tokens": 24, "temperature": 0, "ignore_eos": True}
    outs = {}
    for name, kw in (("tp1", {"tp_size": 1}), ("tp2", {"tp_size": 2}),
                     ("tp2_nccl", {"tp_size": 2, "disable_custom_all_reduce": True}), ("tp2_torch", {"tp_size": 2})):
        if name == "tp2_torch":
            monkeypatch.setenv("RADIXSERVE_ONE_SHOT", "torch")  # the scheduler processes inherit it
        with Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", max_total_tokens=4096,
                    log_level="warning", **kw) as engine:
            outs[name] = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    assert outs["tp2"] == outs["tp2_nccl"] == outs["tp1"] == outs["tp2_torch"]
