"""On CUDA: single-request prefills replayed from CUDA graphs (model_executor/prefill_graph_runner.py) give the eager
prefill's logits within bf16 rounding, for lengths inside, at and past a bucket, on top of a cached prefix, and
with decode graphs replayed in between; longer prompts and batches of several requests stay eager. Skipped
without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402


def gpu_runner(path: str, **kw):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=1 << 14,
                      max_running_requests=8, cuda_graph_max_bs=8, **kw)
    return ModelRunner(ModelConfig(path), args)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    scale = want.abs().max().item()
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=0.02 * scale)


def prefill_then_extend(runner, head: list[int], full: list[int]) -> torch.Tensor:
    """Prefill `head`, then extend `full` on top of its KV (a cached prefix); the extend's logits."""
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.sampling.sampling_params import SamplingParams

    sb = StaticBatch(runner)
    batch, _ = sb.prefill([head])
    req = batch.reqs[0]
    prefix = runner.req_to_token_pool.read(req.req_pool_idx, 0, len(head))
    runner.req_to_token_pool.free(req.req_pool_idx)
    r2 = Req("x", full, SamplingParams.from_dict({"temperature": 0}))
    r2.prefix_indices = prefix
    r2.fill_ids = list(full)
    r2.extend_input_len = len(full) - len(head)
    b2 = ScheduleBatch([r2], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                       runner.model_config.vocab_size)
    b2.prepare_for_extend()
    sb._run(b2)
    out = sb.last_logits.next_token_logits[0].float().clone()
    sb.release(b2)  # the request's row holds the prefix slots too: all freed once
    return out


def test_prefill_graphs_equal_eager(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path), num_hidden_layers=3)
    eager = gpu_runner(str(tmp_path), prefill_cuda_graph_max_tokens=0)
    graphs = gpu_runner(str(tmp_path), prefill_cuda_graph_max_tokens=64)
    assert eager.prefill_graph_runner is None
    pg = graphs.prefill_graph_runner
    assert pg is not None and pg.buckets == [16, 32, 48, 64]
    replays = []
    replay = pg.replay
    pg.replay = lambda fb: (replays.append(fb.extend_seq_lens_cpu[0]), replay(fb))[1]
    g = torch.Generator().manual_seed(0)
    for n in (1, 5, 16, 17, 40, 64, 65):
        prompt = torch.randint(3, 250, (n,), generator=g).tolist()
        want = StaticBatch(eager).generate([prompt], 6)
        sb = StaticBatch(eager)
        b, _ = sb.prefill([prompt])
        ref = sb.last_logits.next_token_logits.clone()
        sb.release(b)
        got = StaticBatch(graphs).generate([prompt], 6)  # prefill from a graph, then decode graphs
        sb = StaticBatch(graphs)
        b, _ = sb.prefill([prompt])
        close(sb.last_logits.next_token_logits, ref)
        sb.release(b)
        top2 = ref[0].float().topk(2).values
        if top2[0] - top2[1] > 0.05 * ref.abs().max():
            assert got[0][0] == want[0][0]
    assert replays == [1, 1, 5, 5, 16, 16, 17, 17, 40, 40, 64, 64]  # 65 tokens: eager
    full = torch.randint(3, 250, (50,), generator=g).tolist()
    close(prefill_then_extend(graphs, full[:20], full), prefill_then_extend(eager, full[:20], full))
    assert replays[-2:] == [20, 30]
    # two requests in one prefill: eager
    n_before = len(replays)
    StaticBatch(graphs).generate([full[:10], full[:12]], 2)
    assert len(replays) == n_before
