"""On CUDA: constrained decoding under the overlap loop with CUDA graphs gives the same tokens as the normal loop,
with each constrained batch's mask handed to the forward thread after launch. A tiny random model with the vocabulary
of a real tokenizer: RADIXSERVE_TEST_TOKENIZER, else `.bench_tok` in the repo root (SmolLM2's tokenizer files,
carried to the GPU machine), else the embedded model's folder. Skipped without CUDA, a tokenizer or xgrammar."""

from __future__ import annotations

import os
import sys
from pathlib import Path

import pytest
import torch

ROOT = Path(__file__).resolve().parents[2]
sys.path.insert(0, str(ROOT / "tests"))


def tokenizer_dir() -> str | None:
    candidates = [os.environ.get("RADIXSERVE_TEST_TOKENIZER"), str(ROOT / ".bench_tok")]
    try:
        from radixserve.model_loader.embedded import ensure_embedded_model

        candidates.append(ensure_embedded_model())
    except Exception:  # not installed here (the GPU machine): the other candidates
        pass
    return next((c for c in candidates if c and os.path.exists(os.path.join(c, "tokenizer.json"))), None)


def run_mixed(model_path: str, tok_dir: str, device: str, overlap: bool) -> tuple[dict, int]:
    import grammar_utils

    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    s = Scheduler(ServerArgs(model_path=model_path, tokenizer_path=tok_dir, device=device, random_seed=0,
                             max_total_tokens=8192, max_running_requests=16, disable_overlap_schedule=not overlap,
                             enable_overlap_schedule=overlap), port_args={})
    deferred = 0
    inner = s.fulfill_grammar_masks

    def counting(bid: int) -> None:
        nonlocal deferred
        deferred += sum(1 for b, _, _ in s.pending_grammar_masks if b <= bid)
        inner(bid)

    s.fulfill_grammar_masks = counting
    res = grammar_utils.mixed_workload(s, "g")
    assert s.check_memory()
    if s.worker_client is not None:
        s.worker_client.shutdown()
    return res, deferred


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_constrained_overlap_equals_normal_with_cuda_graphs(tmp_path) -> None:
    pytest.importorskip("xgrammar")
    tok_dir = tokenizer_dir()
    if tok_dir is None:
        pytest.skip("no tokenizer folder (set RADIXSERVE_TEST_TOKENIZER or carry .bench_tok)")
    from model_utils import make_tiny_model
    from transformers import AutoTokenizer

    vocab = len(AutoTokenizer.from_pretrained(tok_dir))
    make_tiny_model("llama", str(tmp_path), vocab_size=vocab, max_position_embeddings=2048)
    normal, _ = run_mixed(str(tmp_path), tok_dir, "cuda", overlap=False)
    overlapped, deferred = run_mixed(str(tmp_path), tok_dir, "cuda", overlap=True)
    assert deferred > 10  # the masks really were handed over after launch
    assert set(normal) == set(overlapped)
    for rid in normal:
        assert overlapped[rid]["ids"] == normal[rid]["ids"], rid
        assert overlapped[rid]["finish"] == normal[rid]["finish"], rid
