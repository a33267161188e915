"""StarCoder2 (Starcoder2ForCausalLM) against transformers in float32 on tiny random models: LayerNorms with biases,
use_bias on q/k/v, o_proj and the ungated MLP (c_fc -> gelu_pytorch_tanh -> c_proj), the sliding window on every
layer, tied embeddings; through the scheduler with chunked prefill and the prefix cache, dummy weights, and TP=2
over gloo. The norm biases, the activation and the window are each shown to change the tokens; unsupported
activations, partial rotation and StarCoder2 GGUF files are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
WINDOW = 8  # shorter than two of the prompts


def starcoder2(path: str, seed: int = 0, initializer_range: float = 0.2, **over: object) -> torch.nn.Module:
    """A tiny StarCoder2 saved at `path` whose tokens depend on each term: norms and biases away from 1 and 0,
    sharper attention."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **over}
    eps, theta = kw.pop("rms_norm_eps"), kw.pop("rope_theta")
    cfg = tf.Starcoder2Config(**{"sliding_window": WINDOW, "norm_epsilon": eps, "bos_token_id": 1, "eos_token_id": 2,
                                 "rope_parameters": {"rope_type": "default", "rope_theta": theta},
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


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"), ({"use_bias": False}, "cpu")])
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = starcoder2(str(tmp_path), **over)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    model = runner.model
    assert model.lm_head is model.model.embed_tokens  # tied, as transformers' default
    assert runner.model_config.sliding_windows == [WINDOW] * TINY["num_hidden_layers"]
    layer, bias = model.model.layers[0], over.get("use_bias", True)
    for linear in (layer.self_attn.qkv_proj, layer.self_attn.o_proj, layer.mlp.up_proj, layer.mlp.down_proj):
        assert (linear.bias is not None) == bias
    assert layer.input_layernorm.bias is not None and model.model.norm.bias is not None  # always biased


def test_norm_bias_activation_and_window_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with the LayerNorms' biases dropped, with relu2 in place of the tanh GELU, or
    with the layers attending to the whole prompt."""
    from radixserve.layers.activation import ACTIVATIONS

    path = str(tmp_path)
    hf = starcoder2(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.input_layernorm.bias.zero_()
        layer.post_attention_layernorm.bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.act_fn = ACTIVATIONS["relu2"]
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "sliding_window": 10**6}, open(cfg_path, "w"))
    assert ours(path) != want


def test_prompt_logprobs_use_the_tanh_gelu(tmp_path) -> None:  # noqa: ANN001
    """Prompt logprobs equal transformers' to float32 rounding; the exact (erf) GELU, too close to the tanh one to
    move these tokens, moves the logprobs well past that."""
    import torch.nn.functional as F

    path = str(tmp_path)
    hf = starcoder2(path)
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    runner = make_runner(path)
    torch.testing.assert_close(StaticBatch(runner).prompt_logprobs(ids), want, atol=1e-5, rtol=1e-5)
    for layer in runner.model.model.layers:
        layer.mlp.act_fn = F.gelu
    assert (StaticBatch(runner).prompt_logprobs(ids) - want).abs().max() > 1e-4


def test_biased_layernorm_is_torch_layernorm_with_the_residual_convention() -> None:
    """With a bias the norm is torch's layer_norm (transformers' nn.LayerNorm); norm(x, residual) returns
    (norm(x + residual), x + residual) as RMSNorm does; the bias-free (Cohere) form is unchanged; a biased norm over
    a per-head weight is refused."""
    from radixserve.layers.layernorm import LayerNorm

    x, res = torch.randn(5, 64), torch.randn(5, 64)
    ref = torch.nn.LayerNorm(64, eps=1e-5)
    with torch.no_grad():
        ref.weight.copy_(torch.randn(64))
        ref.bias.copy_(torch.randn(64))
    norm = LayerNorm(64, 1e-5, bias=True)
    norm.load_state_dict(ref.state_dict())
    torch.testing.assert_close(norm(x), ref(x), atol=0, rtol=0)
    normed, summed = norm(x, res)
    torch.testing.assert_close(summed, x + res, atol=0, rtol=0)
    torch.testing.assert_close(normed, ref(x + res), atol=0, rtol=0)
    plain = LayerNorm(64, 1e-5)
    assert plain.bias is None
    centred = x - x.mean(-1, keepdim=True)
    torch.testing.assert_close(plain(x), centred * torch.rsqrt(centred.pow(2).mean(-1, keepdim=True) + 1e-5))
    with pytest.raises(ValueError, match="takes a 1-D"):
        LayerNorm((4, 16), bias=True)


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = starcoder2(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    """--load-format dummy draws every parameter: the norms' weights near 1, their biases and the linear biases
    near 0 (not left at their initial ones and zeros)."""
    starcoder2(str(tmp_path))
    runner = make_runner(str(tmp_path), load_format="dummy")
    layer = runner.model.model.layers[0]
    assert not torch.equal(layer.input_layernorm.weight, torch.ones_like(layer.input_layernorm.weight))
    assert (layer.input_layernorm.weight - 1).abs().max() < 0.2 and layer.input_layernorm.bias.abs().max() < 0.2
    assert layer.mlp.up_proj.bias.abs().max() > 0
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.activation import activation_fn

    path = str(tmp_path / "m")
    starcoder2(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "hidden_act": "quick_gelu"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported"):
        make_runner(path)
    with pytest.raises(ValueError, match="hidden_act None is not supported"):
        activation_fn(None)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    json.dump({**cfg, "rope_parameters": rope}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="does not support partial_rotary_factor"):
        make_runner(path)
    with pytest.raises(ValueError, match="GGUF files of StarCoder2 are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "s.gguf"), "starcoder2"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Biased column- and row-parallel layers (the row-parallel biases added once), the tied embedding split over
    the ranks, KV heads split."""
    path = str(tmp_path)
    starcoder2(path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
