"""SmolLM3 against transformers in float32 on tiny random models: layers without rotary (`no_rope_layers`), with
and without its sliding window on those layers; and the rotary layers really turn."""

from __future__ import annotations

import pytest
import torch
from model_utils import hf_greedy, make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
NOPE = dict(num_hidden_layers=4, no_rope_layer_interval=2)  # layers 1 and 3 without rotary


def smollm3(path: str, **over: object) -> torch.nn.Module:
    hf = make_tiny_model("smollm3", path, **{**NOPE, **over})
    with torch.no_grad():  # sharper attention, so that positions show in the tokens
        for name, p in hf.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"),
                                          ({"use_sliding_window": True, "sliding_window": 5}, "cpu"),
                                          ({"no_rope_layers": [0, 1, 1, 0]}, "cpu")])  # the first layer too
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = smollm3(str(tmp_path), **over)
    assert hf.config.no_rope_layers == over.get("no_rope_layers", [1, 0, 1, 0])
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    if "sliding_window" in over:
        assert runner.model_config.sliding_windows == [-1, 5, -1, 5]


def test_nope_layers_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """Served as plain Llama (every layer turning), the same weights give other tokens."""
    import json

    hf = smollm3(str(tmp_path))
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    cfg_path = tmp_path / "config.json"
    cfg = json.loads(cfg_path.read_text())
    cfg["no_rope_layers"] = [1, 1, 1, 1]
    cfg_path.write_text(json.dumps(cfg))
    assert StaticBatch(make_runner(str(tmp_path))).generate(PROMPTS, 12) != want
