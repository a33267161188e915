"""Speculative decoding on CUDA: the verify (and the draft model's catch-up) replay the decode CUDA graphs as one
row per token, and the greedy tokens are those of plain decoding (float32), through the graphs and past them.
Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402
from test_scheduler import drain, make_scheduler, submit, workload  # noqa: E402
from test_speculative import repeat_workload  # noqa: E402


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_spec_gpu"))
    make_tiny_model("llama", path, seed=1, vocab_size=512)
    return path


def run(path: str, reqs, count_replays: bool = False, **kw):
    kw.setdefault("cuda_graph_max_bs", 64)  # fewer graphs to capture; the larger verify steps run eagerly
    s = make_scheduler(path, device="cuda", **kw)
    replays = {"verify": 0}
    graphs = s.worker.model_runner.cuda_graph_runner
    if count_replays and graphs is not None:
        replay = graphs.replay

        def counted(fb):  # a verify's rows: more rows than requests in the running batch
            if s.running_batch is not None and fb.batch_size > len(s.running_batch.reqs):
                replays["verify"] += 1
            return replay(fb)
        graphs.replay = counted
    for rid, prompt, n, *sp in reqs:
        submit(s, rid, prompt, n, **(sp[0] if sp else {}))
    res = drain(s)
    assert s.invariant_violations == 0
    return {r: v["ids"] for r, v in res.items()}, s, replays["verify"]


def test_ngram_verify_replays_decode_graphs_and_matches_plain(tiny) -> None:
    reqs = repeat_workload(seed=21) + workload(n=4)
    plain, _, _ = run(tiny, reqs)
    spec, s, verify_replays = run(tiny, reqs, count_replays=True, speculative_algorithm="ngram")
    assert s.worker.model_runner.cuda_graph_runner is not None
    assert spec == plain
    assert s.spec_num_verify > 0 and verify_replays > 0
    assert s.check_memory()


def test_verify_past_the_captured_sizes_runs_eagerly_and_matches(tiny) -> None:
    # 6 requests x (1 + 4) rows = 30 rows > a largest graph of 8: the eager decode kernels, same tokens
    reqs = repeat_workload(seed=22, n=6)
    plain, _, _ = run(tiny, reqs, cuda_graph_max_bs=8)
    spec, s, _ = run(tiny, reqs, cuda_graph_max_bs=8, speculative_algorithm="ngram")
    assert spec == plain and s.spec_num_verify > 0


def test_draft_model_with_graphs_matches_plain(tiny, tmp_path) -> None:
    draft = str(tmp_path / "draft")
    make_tiny_model("llama", draft, seed=2, vocab_size=512, num_hidden_layers=1)
    reqs = repeat_workload(seed=23, n=3) + workload(seed=23, n=3)
    plain, _, _ = run(tiny, reqs)
    spec, s, _ = run(tiny, reqs, speculative_algorithm="draft_model", speculative_draft_model_path=draft,
                     speculative_num_draft_tokens=3)
    assert spec == plain and s.spec_num_verify > 0
    d = s.spec_drafter
    assert d.runner.cuda_graph_runner is not None  # the draft's own decode graphs (its catch-up replays them too)
    d.gc()
    assert d.token_to_kv_pool.available_size() == d.token_to_kv_pool.size
