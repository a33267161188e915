"""EXAONE 4.0 against transformers in float32 on tiny random models: post-attention / post-feedforward norms and no
input norms, per-head q/k RMSNorm, hybrid attention (sliding layers that rotate, full-attention layers without
position embedding), llama3 rope scaling as the released models, and a config without a window (every layer
rotates, EXAONE-4.0-1.2B); through the scheduler with chunked prefill and the prefix cache, dummy weights, and TP=2
over gloo."""

from __future__ import annotations

import json

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
CASES = {
    "hybrid": {},  # layer 0 slides over 5 tokens and rotates, layer 1 attends to everything without rotary
    "llama3": {"rope_parameters": {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0,
                                   "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                   "original_max_position_embeddings": 64}},
    "no_window": {"sliding_window": None, "layer_types": ["full_attention"] * 2},  # 1.2B: every layer rotates
}


def exaone(path: str, case: str = "hybrid", seed: int = 0, **over: object) -> torch.nn.Module:
    """A tiny EXAONE 4 whose tokens depend on each term: norms away from 1, q/k norms sharper."""
    hf = make_tiny_model("exaone4", path, seed=seed, initializer_range=INIT_RANGE, **{**CASES[case], **over})
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "q_norm" in name or "k_norm" in name:
                p.mul_(2.0)
    hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("case,backend", [("hybrid", "cpu"), ("hybrid", "torch_native"), ("llama3", "cpu"),
                                          ("no_window", "torch_native")])
def test_greedy_matches_transformers(case: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = exaone(str(tmp_path), case)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 6  # not one token repeated
    assert greedy(str(tmp_path), attention_backend=backend) == want


def test_model_structure(tmp_path) -> None:  # noqa: ANN001
    """The sliding layer rotates (the whole head) and slides; the full one neither; without a window every layer
    rotates; q/k norms are per head; no input norms."""
    path = str(tmp_path)
    exaone(path)
    layers = make_runner(path).model.model.layers
    attn0, attn1 = layers[0].self_attn, layers[1].self_attn
    assert attn0.rotary_emb.rotary_dim == 16 and attn1.rotary_emb.rotary_dim == 0
    assert attn0.attn.sliding_window_size == 5 and attn1.attn.sliding_window_size == -1
    assert attn0.q_norm.weight.shape == (16,) and attn0.k_norm.weight.shape == (16,)
    assert not hasattr(layers[0], "input_layernorm")
    exaone(path, "no_window")
    layers = make_runner(path).model.model.layers
    assert all(layer.self_attn.rotary_emb.rotary_dim == 16 for layer in layers)


def test_post_norms_qk_norm_nope_and_window_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with either post-norm left out, with the q/k norm left out, with the
    full-attention layer rotating, or with the sliding layer attending to the whole prompt."""
    path = str(tmp_path)
    hf = exaone(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]

    def changed(edit) -> bool:  # noqa: ANN001
        runner = make_runner(path)
        for layer in runner.model.model.layers:
            edit(layer)
        return StaticBatch(runner).generate(PROMPTS, 12) != want

    assert changed(lambda layer: setattr(layer, "post_attention_layernorm", torch.nn.Identity()))
    assert changed(lambda layer: setattr(layer, "post_feedforward_layernorm", torch.nn.Identity()))
    assert changed(lambda layer: setattr(layer.self_attn, "qk_norm", False))
    rotating = make_runner(path).model.model.layers[0].self_attn.rotary_emb
    assert changed(lambda layer: setattr(layer.self_attn, "rotary_emb", rotating))  # NoPE layer rotated
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["sliding_window"] = 10**6
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    assert greedy(path) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    """Chunks of 5 tokens and prompts sharing cached prefixes longer than the window."""
    hf = exaone(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_serve(tmp_path) -> None:  # noqa: ANN001
    """--load-format dummy: every parameter drawn (the q/k norms near 1, not left at ones), the same model on each
    build, tokens generated."""
    path = str(tmp_path)
    exaone(path)
    runner = make_runner(path, load_format="dummy")
    norm = runner.model.model.layers[0].self_attn.q_norm.weight
    assert not torch.equal(norm, torch.ones_like(norm)) and torch.allclose(norm, torch.ones_like(norm), atol=0.2)
    out = StaticBatch(runner).generate(PROMPTS, 4)
    assert out == StaticBatch(make_runner(path, load_format="dummy")).generate(PROMPTS, 4)
    assert all(len(o) == 4 for o in out)


def test_bad_configs_are_refused(tmp_path) -> None:  # noqa: ANN001
    """An unknown or miscounted layer type, a partial rotation (on any layer) and an unsupported activation."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.exaone4 import Exaone4ForCausalLM

    path = str(tmp_path)
    exaone(path)
    for key, value, match in (("layer_types", ["sliding_attention", "chunked_attention"], "chunked_attention"),
                              ("layer_types", ["sliding_attention"], "needs layer_types with 2 entries"),
                              ("partial_rotary_factor", 0.5, "does not support partial_rotary_factor"),
                              ("hidden_act", "gelu", "hidden_act 'gelu' is not supported")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own checks
        with pytest.raises(ValueError, match=match):
            Exaone4ForCausalLM(cfg)
    file = stub_gguf(str(tmp_path / "exaone4.gguf"), "exaone4")
    with pytest.raises(ValueError, match="GGUF files of EXAONE 4.0 are not supported"):
        ModelConfig(file)


@pytest.mark.integration
@pytest.mark.parametrize("over", [{}, {"num_key_value_heads": 1}])  # KV heads split, then replicated
def test_tp2_matches_tp1(over: dict, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    make_tiny_model("exaone4", path, seed=4, initializer_range=INIT_RANGE, **over)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
