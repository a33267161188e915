"""Apertus (ApertusForCausalLM) against transformers in float32 on tiny random models: Llama's RMSNorm layer with
the ungated xIELU MLP (learned alpha_p / alpha_n a layer), per-head q/k RMSNorms, attention_bias on and off and
Llama 3 rope scaling; through the scheduler with chunked prefill and the prefix cache, dummy weights, and TP=2 over
gloo. The xIELU parameters, the q/k norms and the rope scaling are shown to change the tokens; a sliding window,
unsupported activations and Apertus GGUF files are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
# as the releases' (factor 8 over 8,192 positions), scaled down: the low frequencies interpolated
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "original_max_position_embeddings": 16, "low_freq_factor": 1.0,
          "high_freq_factor": 4.0}


def apertus(path: str, seed: int = 0, initializer_range: float = 0.2, **over: object) -> torch.nn.Module:
    """A tiny Apertus saved at `path` (attention biased unless over says otherwise): norms, biases and the xIELU
    parameters away from their initial values."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, "attention_bias": True, **over}
    theta = kw.pop("rope_theta")
    cfg = tf.ApertusConfig(**{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                              "rope_parameters": {**LLAMA3, "rope_theta": theta},
                              "initializer_range": initializer_range, **kw})
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if ".act_fn." in name:  # per layer: a_p and a_n each their own
                p.add_(torch.randn_like(p))
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"), ({"attention_bias": False}, "cpu")])
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = apertus(str(tmp_path), **over)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    layer = runner.model.model.layers[1]
    hf_act = hf.model.layers[1].mlp.act_fn
    torch.testing.assert_close(layer.mlp.act_fn.alpha_p, hf_act.alpha_p, atol=0, rtol=0)
    assert not hasattr(layer.mlp, "gate_up_proj") and layer.mlp.up_proj.bias is None
    assert (layer.self_attn.o_proj.bias is not None) == over.get("attention_bias", True)


def test_xielu_equals_transformers() -> None:
    """The activation alone, over both branches and the eps clamp, with learned parameters."""
    from transformers.activations import XIELUActivation

    from radixserve.layers.activation import XIELU

    ref = XIELUActivation(dtype=torch.float32)
    ours_ = XIELU()
    with torch.no_grad():
        ref.alpha_p.copy_(torch.tensor([0.7]))
        ref.alpha_n.copy_(torch.tensor([-0.4]))
        ours_.alpha_p.copy_(ref.alpha_p)
        ours_.alpha_n.copy_(ref.alpha_n)
    x = torch.cat([torch.randn(1000) * 3, torch.tensor([0.0, -1e-7, 1e-7, -1e-6])])
    torch.testing.assert_close(ours_(x), ref(x), atol=0, rtol=0)
    ours_.set_constant("beta", torch.tensor(0.25))
    assert ours_.beta == 0.25
    with pytest.raises(ValueError, match="xIELU has no constant 'gamma'"):
        ours_.set_constant("gamma", torch.tensor(1.0))


def test_xielu_params_qk_norm_and_rope_scaling_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with the xIELU parameters left at their initial values, with a GELU in its
    place, without the q/k norms or without the Llama 3 scaling."""
    path = str(tmp_path)
    hf = apertus(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.act_fn.alpha_p.fill_(-0.22)  # softplus = 0.8: the initial value
        layer.mlp.act_fn.alpha_n.fill_(-0.55)
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.act_fn = torch.nn.GELU()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.self_attn.q_norm.weight.fill_(1.0)
        layer.self_attn.k_norm.weight.fill_(1.0)
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "rope_parameters": {"rope_type": "default", "rope_theta": TINY["rope_theta"]}},
              open(cfg_path, "w"))
    assert ours(path) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = apertus(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    apertus(str(tmp_path))
    runner = make_runner(str(tmp_path), load_format="dummy")
    act = runner.model.model.layers[0].mlp.act_fn
    assert act.alpha_p.abs().max() > 0 and (act.beta, act.eps) == (0.5, -1e-6)
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / "m")
    apertus(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "sliding_window": 8}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="sliding_window is not supported for Apertus"):
        make_runner(path)
    json.dump({**cfg, "hidden_act": "quick_gelu"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported"):
        make_runner(path)
    with pytest.raises(ValueError, match="GGUF files of Apertus are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "a.gguf"), "apertus"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads and MLP columns split, the per-head q/k norms and the xIELU parameters whole on each rank."""
    path = str(tmp_path)
    apertus(path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
