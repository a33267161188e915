"""On two GPUs, float32: --enable-dp-attention (CUDA graphs on: the ranks replay the graph of the largest batch,
a rank without requests on padding rows) and --ep-size 2 on a tiny DeepSeek-V2 give TP=1's greedy tokens.
Skipped with fewer than two GPUs. Each engine prints how long it took to start (pytest -s)."""

from __future__ import annotations

import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs 2 GPUs")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from parallel_utils import make_model  # noqa: E402

from radixserve import Engine  # noqa: E402

PROMPTS = [[1, 5, 9, 33, 2], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(40, 70)), list(range(3, 20)),
           [2] * 9]
LENS = (12, 2, 20, 5, 9)  # uneven: ranks run out of requests at different steps and idle


def _run(path: str, **kw) -> list[list[int]]:
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in LENS]
    t0 = time.monotonic()
    with Engine(model_path=path, skip_tokenizer_init=True, dtype="float32", max_total_tokens=4096,
                log_level="warning", cuda_graph_max_bs=8, **kw) as engine:
        t1 = time.monotonic()
        outs = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=params)]
    print(f"engine {kw}: start {t1 - t0:.1f}s, generate + shutdown {time.monotonic() - t1:.1f}s", file=sys.stderr)
    return outs


@pytest.fixture(scope="module")
def tiny_deepseek(tmp_path_factory) -> tuple[str, list[list[int]]]:
    """A float32 tiny DeepSeek-V2 (MLA with a q LoRA, 8 routed experts, a shared one) and TP=1's greedy tokens."""
    path = make_model("deepseek_v2_lora", str(tmp_path_factory.mktemp("tiny_ds_dpattn")), seed=5)
    return path, _run(path)


def test_dp_attention_matches_tp1(tiny_deepseek) -> None:
    path, want = tiny_deepseek
    assert _run(path, tp_size=2, dp_size=2, enable_dp_attention=True) == want


def test_dp_attention_with_expert_parallelism_matches_tp1(tiny_deepseek) -> None:
    path, want = tiny_deepseek
    assert _run(path, tp_size=2, dp_size=2, enable_dp_attention=True, ep_size=2) == want


def test_expert_parallelism_matches_tp1(tiny_deepseek) -> None:
    path, want = tiny_deepseek
    assert _run(path, tp_size=2, ep_size=2) == want
