"""On CUDA: extend batches replayed from piecewise CUDA graphs (model_executor/piecewise_graph_runner.py) give the
eager forward's logits: prompts of several requests, a MIXED batch (a new prompt with running decodes riding
along), prompts on a cached prefix, and a scheduler serving a workload with mixed chunks gives the same tokens with
and without them. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model, peaky_tiny_model  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402


def gpu_runner(path: str, **kw):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="float32", max_total_tokens=1 << 14,
                      max_running_requests=16, cuda_graph_max_bs=8, prefill_cuda_graph_max_tokens=0, **kw)
    return ModelRunner(ModelConfig(path), args)


def close(got: torch.Tensor, want: torch.Tensor) -> None:
    torch.testing.assert_close(got.float(), want.float(), rtol=0, atol=1e-3 * want.abs().max().item())


def counted_replays(pw) -> list[int]:
    """The token counts of the batches `pw` replays from now on, in order."""
    replays: list[int] = []
    replay = pw.replay
    pw.replay = lambda fb: (replays.append(fb.input_ids.shape[0]), replay(fb))[1]
    return replays


def workload(g: torch.Generator) -> tuple[list[list[int]], list[int]]:
    """Three prompts of 5, 17 and 9 tokens, and a late one of 20 (`steps`)."""
    prompts = [torch.randint(3, 250, (n,), generator=g).tolist() for n in (5, 17, 9)]
    return prompts, torch.randint(3, 250, (20,), generator=g).tolist()


def steps(runner, prompts: list[list[int]], late: list[int]) -> list[torch.Tensor]:
    """Prefill `prompts` together, decode twice, then run `late` as a prompt with those requests riding along as
    decodes (MIXED), then decode once more; the logits of every step."""
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.sampling.sampling_params import SamplingParams

    sb = StaticBatch(runner)
    logits = []
    running, _ = sb.prefill(prompts)
    logits.append(sb.last_logits.next_token_logits.float().clone())
    for _ in range(2):
        sb.decode(running)
        logits.append(sb.last_logits.next_token_logits.float().clone())
    req = Req("late", late, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1 << 30}))
    req.init_next_round_input(None)
    mixed = ScheduleBatch([req], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                          runner.model_config.vocab_size)
    mixed.prepare_for_extend()
    mixed.mix_with_running(running)
    sb._run(mixed)
    logits.append(sb.last_logits.next_token_logits.float().clone())
    sb.decode(mixed)
    logits.append(sb.last_logits.next_token_logits.float().clone())
    sb.release(mixed)
    return logits


def test_piecewise_graphs_equal_eager(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path), num_hidden_layers=3)
    eager = gpu_runner(str(tmp_path), piecewise_cuda_graph_max_tokens=0)
    graphs = gpu_runner(str(tmp_path), piecewise_cuda_graph_max_tokens=64)
    assert eager.piecewise_graph_runner is None
    pw = graphs.piecewise_graph_runner
    assert pw is not None and pw.buckets == [16, 32, 48, 64]
    assert len(pw.pieces[16]) == 3 + 1  # one piece ending at each attention layer, one ending at the logits
    replays = counted_replays(pw)
    g = torch.Generator().manual_seed(0)
    prompts, late = workload(g)
    want, got = steps(eager, prompts, late), steps(graphs, prompts, late)
    for w, o in zip(want, got, strict=True):
        close(o, w)
    assert replays == [31, 23]  # the 3-prompt prefill and the MIXED step (20 + 3 decodes); the decodes: their graphs
    # past the largest bucket: eager
    n = len(replays)
    long = [torch.randint(3, 250, (40,), generator=g).tolist() for _ in range(2)]
    StaticBatch(graphs).generate(long, 2)
    assert len(replays) == n


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_mla_piecewise_graphs_equal_eager(kind: str, tmp_path, monkeypatch) -> None:
    """DeepSeek's attention is one cut (its form, expanded or latent, is chosen from each batch's lengths): the
    replays give the eager logits, prompts of several requests taking the expanded form among them."""
    from radixserve.models.deepseek_v2 import DeepseekMLAAttention

    make_tiny_model(kind, str(tmp_path), num_hidden_layers=3)
    eager = gpu_runner(str(tmp_path), piecewise_cuda_graph_max_tokens=0)
    graphs = gpu_runner(str(tmp_path), piecewise_cuda_graph_max_tokens=64)
    pw = graphs.piecewise_graph_runner
    assert eager.piecewise_graph_runner is None and pw is not None
    assert len(pw.pieces[16]) == 3 + 1
    expanded: list[int] = []
    attend = DeepseekMLAAttention._attend_expanded
    monkeypatch.setattr(DeepseekMLAAttention, "_attend_expanded",
                        lambda self, pos, q, kv_a, fb: (expanded.append(q.shape[0]), attend(self, pos, q, kv_a, fb))[1])
    replays = counted_replays(pw)
    g = torch.Generator().manual_seed(1)
    prompts, late = workload(g)
    want = steps(eager, prompts, late)
    eager_expanded, expanded[:] = list(expanded), []
    got = steps(graphs, prompts, late)
    for w, o in zip(want, got, strict=True):
        close(o, w)
    assert replays == [31, 23]
    assert expanded == eager_expanded and 31 in expanded  # the prefill took the expanded form, in both


def test_scheduler_with_piecewise_graphs_gives_the_same_tokens(tmp_path) -> None:
    """A scheduler with mixed chunks of 16 tokens (several prompts, a chunked prompt with decodes riding along, prefix
    hits) serves the same greedy tokens with the piecewise graphs as without."""
    from test_scheduler import drain

    from radixserve.managers import io_struct as io
    from radixserve.managers.scheduler import Scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    peaky_tiny_model("llama", str(tmp_path))
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(3, 2000, (12,), generator=g).tolist()
    work = []
    for i in range(10):
        tail = torch.randint(3, 2000, (int(torch.randint(1, 30, (1,), generator=g)),), generator=g).tolist()
        work.append((f"r{i}", shared + tail if i % 3 == 0 else tail, 4 + i % 5))

    def run(max_tokens: int) -> tuple[dict, int]:
        s = Scheduler(ServerArgs(model_path=str(tmp_path), device="cuda", dtype="float32", max_total_tokens=4096,
                                 skip_tokenizer_init=True, chunked_prefill_size=16, enable_mixed_chunk=True,
                                 cuda_graph_max_bs=8, piecewise_cuda_graph_max_tokens=max_tokens,
                                 disable_overlap_schedule=True), port_args={})
        pw = s.worker.model_runner.piecewise_graph_runner
        count = [0]
        if pw is not None:
            replay = pw.replay
            pw.replay = lambda fb: (count.__setitem__(0, count[0] + 1), replay(fb))[1]
        for rid, prompt, n in work:
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=rid, input_text=None, input_ids=prompt, sampling_params=SamplingParams.from_dict(
                    {"max_new_tokens": n, "temperature": 0, "ignore_eos": True}))])
            s.step()
        return drain(s), count[0]

    (off, none), (on, replays) = run(0), run(32)
    assert none == 0 and replays > 3
    for rid, _, n in work:
        assert len(off[rid]["ids"]) == n
        assert on[rid]["ids"] == off[rid]["ids"], rid
