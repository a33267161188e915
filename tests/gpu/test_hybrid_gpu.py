"""The hybrid Qwen models on CUDA through the scheduler: overlap scheduling, decode CUDA graphs (the DeltaNet states
gathered and written back inside them, padding rows to their own row), 5-token chunks whose state carries over and
mixed steps, float32 greedy tokens equal transformers'; a second wave reuses the request slots. Skipped without a
GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import WAVE_PROMPTS, hf_greedy, scheduler_waves  # noqa: E402
from test_qwen3_next import hybrid  # noqa: E402


@pytest.mark.parametrize("kind", ["qwen3_next", "qwen3_5"])
def test_scheduler_on_cuda_equals_transformers(kind: str, tmp_path) -> None:
    hf = hybrid(str(tmp_path), kind)
    want = [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]
    got = scheduler_waves(str(tmp_path), expect_hits=False, device="cuda", cuda_graph_max_bs=8,
                          disable_overlap_schedule=False)
    assert got == want
