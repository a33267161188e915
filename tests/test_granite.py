"""Granite 3.x against transformers in float32 on tiny random models: its four multipliers (embedding, attention,
residual, logits) through the cpu and torch_native backends, chunked prefill with prefix-cache hits, TP=2 (each
rank's partial output scaled before the all-reduce), and prompt logprobs from the divided logits."""

from __future__ import annotations

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def granite(path: str, **over: object) -> torch.nn.Module:
    return make_tiny_model("granite", path, initializer_range=INIT_RANGE, **over)  # varied, decided tokens


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = granite(str(tmp_path))
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("name", ["embedding_multiplier", "attention_multiplier", "residual_multiplier"])
def test_each_multiplier_changes_the_tokens(name: str, tmp_path) -> None:  # noqa: ANN001
    """The case above could not pass with any of them left out (logits_scaling keeps the argmax: see below)."""
    hf = granite(str(tmp_path))
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 6  # not one token repeated
    granite(str(tmp_path / "off"), **{name: 1.0 if name != "attention_multiplier" else 0.25})
    assert StaticBatch(make_runner(str(tmp_path / "off"))).generate(PROMPTS, 12) != want


def test_prompt_logprobs_come_from_the_divided_logits(tmp_path) -> None:  # noqa: ANN001
    hf = granite(str(tmp_path))
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = StaticBatch(make_runner(str(tmp_path))).prompt_logprobs(ids)
    torch.testing.assert_close(got, want, atol=1e-4, rtol=1e-4)
    undivided = torch.log_softmax(logits * 4.0, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert not torch.allclose(undivided, want, atol=1e-2)


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = granite(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    granite(path, seed=4)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
