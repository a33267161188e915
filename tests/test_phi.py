"""Phi-1 / 1.5 / 2 (PhiForCausalLM) against transformers in float32 on tiny random models: the parallel attention
+ MLP on one biased LayerNorm, partial rotation laid out at load (0.5 and Phi-2's 0.4), biased q/k/v / dense /
fc1 / fc2 and LM head, the gelu_new MLP, the optional per-head q/k LayerNorm; through the scheduler with chunked
prefill and the prefix cache, dummy weights, and TP=2 over gloo (the parallel sums reduced once). The parallel
residual, the rotation's layout, the LM head's bias and the q/k LayerNorm are shown to change the tokens; tied
embeddings, unsupported activations and Phi-2 GGUF files are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def phi(path: str, seed: int = 0, initializer_range: float = 0.2, share: float = 0.5,
        **over: object) -> torch.nn.Module:
    """A tiny Phi saved at `path`, rotating `share` of each head: norms and biases away from 1 and 0, sharper
    attention."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **over}
    eps, theta = kw.pop("rms_norm_eps"), kw.pop("rope_theta")
    cfg = tf.PhiConfig(**{"layer_norm_eps": eps, "bos_token_id": 1, "eos_token_id": 2,
                          "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                              "partial_rotary_factor": share},
                          "initializer_range": initializer_range, **kw})
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(2.0)
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"), ({"share": 0.4}, "cpu"),
                                          ({"qk_layernorm": True}, "cpu")])
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = phi(str(tmp_path), **over)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    model = runner.model
    rotary = model.model.layers[0].self_attn.rotary_emb
    assert rotary.rotary_dim == int(16 * over.get("share", 0.5)) and model.lm_head.bias is not None
    layer = model.model.layers[0]
    assert layer.parallel and not hasattr(layer, "post_attention_layernorm")
    assert (layer.self_attn.q_norm is not None) == over.get("qk_layernorm", False)


def test_parallel_residual_layout_head_bias_and_qk_norm_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with the MLP fed the attention's output (sequential), with the q/k rows in
    the checkpoint's order, without the LM head's bias, or without the q/k LayerNorm."""
    from radixserve.models.phi import PhiForCausalLM

    path = str(tmp_path)
    hf = phi(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.parallel, layer.post_attention_layernorm = False, layer.input_layernorm
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    runner.model.lm_head.bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    layout = PhiForCausalLM._laid_out
    try:
        PhiForCausalLM._laid_out = lambda self, name, tensor: tensor
        assert ours(path) != want
    finally:
        PhiForCausalLM._laid_out = layout
    hf = phi(path, qk_layernorm=True)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.self_attn.q_norm = layer.self_attn.k_norm = None
    assert StaticBatch(runner).generate(PROMPTS, 12) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = phi(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    phi(str(tmp_path))
    runner = make_runner(str(tmp_path), load_format="dummy")
    assert runner.model.lm_head.bias.abs().max() > 0 and runner.model.model.norm.bias.abs().max() > 0
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / "m")
    phi(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "tie_word_embeddings": True}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="tied word embeddings are not supported for PhiForCausalLM"):
        make_runner(path)
    json.dump({**cfg, "hidden_act": "quick_gelu"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported"):
        make_runner(path)
    with pytest.raises(ValueError, match="GGUF files of Phi-1 / 1.5 / 2 are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "p.gguf"), "phi2"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads (laid out per head) and MLP columns split, the attention + MLP partial sums reduced once with the
    row-parallel biases added once, the biased LM head split over the vocabulary."""
    path = str(tmp_path)
    phi(path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
