"""Arcee (ArceeForCausalLM, AFM-4.5B) against transformers in float32 on tiny random models: Llama's RMSNorm layer
with the ungated relu2 MLP (mlp_bias on and off) and YaRN rope scaling; through the scheduler with chunked prefill
and the prefix cache, dummy weights, and TP=2 over gloo. The activation and the MLP biases are shown to change the
tokens; a sliding window, unsupported activations and Arcee GGUF files are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
# as the release (YaRN, factor 20 over 4,096 positions), scaled down: positions past 32 interpolated
YARN = {"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32}


def arcee(path: str, seed: int = 0, initializer_range: float = 0.2, **over: object) -> torch.nn.Module:
    """A tiny Arcee saved at `path`, MLP biased unless over says otherwise; norms and biases away from 1 and 0."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, "mlp_bias": True, **over}
    theta = kw.pop("rope_theta")
    cfg = tf.ArceeConfig(**{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                            "rope_parameters": {**YARN, "rope_theta": theta},
                            "initializer_range": initializer_range, **kw})
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"), ({"mlp_bias": False}, "cpu")])
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = arcee(str(tmp_path), **over)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    mlp = runner.model.model.layers[0].mlp
    assert not hasattr(mlp, "gate_up_proj") and (mlp.up_proj.bias is not None) == over.get("mlp_bias", True)


def test_activation_mlp_bias_and_yarn_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with SiLU in place of relu2, with the MLP's biases dropped or without the
    YaRN scaling."""
    import torch.nn.functional as F

    path = str(tmp_path)
    hf = arcee(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.act_fn = F.silu
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.up_proj.bias.zero_()
        layer.mlp.down_proj.bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": TINY["rope_theta"]}},
              open(cfg_path, "w"))
    assert ours(path) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = arcee(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    arcee(str(tmp_path))
    runner = make_runner(str(tmp_path), load_format="dummy")
    assert runner.model.model.layers[0].mlp.up_proj.bias.abs().max() > 0
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / "m")
    arcee(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "sliding_window": 8}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="sliding_window is not supported for Arcee"):
        make_runner(path)
    json.dump({**cfg, "hidden_act": "quick_gelu"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported"):
        make_runner(path)
    with pytest.raises(ValueError, match="GGUF files of Arcee \\(AFM\\) are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "a.gguf"), "arcee"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    arcee(path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
