"""StableLM (StableLmForCausalLM) against transformers in float32 on tiny random models: biased LayerNorms, partial
rotation laid out at load (0.25), use_qkv_bias, the per-head q/k LayerNorms (qk_layernorm) and the parallel
residual (use_parallel_residual), each on and off; through the scheduler with chunked prefill and the prefix cache,
dummy weights, and TP=2 over gloo (per-head norms split with their heads). The norm biases, the per-head q/k norms
and the parallel residual are shown to change the tokens; unsupported activations and StableLM GGUF files are
refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
V2_12B = {"use_qkv_bias": False, "qk_layernorm": True, "use_parallel_residual": True}  # StableLM 2 12B's flags


def stablelm(path: str, seed: int = 0, initializer_range: float = 0.2, **over: object) -> torch.nn.Module:
    """A tiny StableLM saved at `path` (q/k/v biased unless over says otherwise): norms and biases away from 1
    and 0, each q/k head norm its own, sharper attention."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, "use_qkv_bias": True, **over}
    eps, theta = kw.pop("rms_norm_eps"), kw.pop("rope_theta")
    cfg = tf.StableLmConfig(**{"layer_norm_eps": eps, "bos_token_id": 1, "eos_token_id": 2,
                               "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                                   "partial_rotary_factor": 0.25},
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


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"), (V2_12B, "cpu"),
                                          ({"qk_layernorm": True}, "torch_native")])
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = stablelm(str(tmp_path), **over)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    layer = runner.model.model.layers[0]
    assert layer.self_attn.rotary_emb.rotary_dim == 4 and layer.self_attn.o_proj.bias is None
    assert (layer.self_attn.qkv_proj.bias is not None) == over.get("use_qkv_bias", True)
    assert layer.parallel == over.get("use_parallel_residual", False)
    if over.get("qk_layernorm"):
        assert tuple(layer.self_attn.k_norm.weight.shape) == (2, 16)


def test_norm_bias_head_norms_and_parallel_residual_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass without the LayerNorms' biases, with one q/k norm shared by the heads, or
    with the layers run sequentially."""
    path = str(tmp_path)
    hf = stablelm(path, **V2_12B)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.input_layernorm.bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        for norm in (layer.self_attn.q_norm, layer.self_attn.k_norm):
            norm.weight.copy_(norm.weight[:1].expand_as(norm.weight))
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.parallel, layer.post_attention_layernorm = False, layer.input_layernorm
    assert StaticBatch(runner).generate(PROMPTS, 12) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = stablelm(str(tmp_path), **V2_12B)
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    stablelm(str(tmp_path), **V2_12B)
    runner = make_runner(str(tmp_path), load_format="dummy")
    norm = runner.model.model.layers[0].self_attn.q_norm
    assert not torch.equal(norm.weight[0], norm.weight[1])
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / "m")
    stablelm(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "hidden_act": "gelu"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'gelu' is not supported"):
        make_runner(path)
    json.dump({**cfg, "sliding_window": 8}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="sliding_window is not supported for StableLM"):
        make_runner(path)
    with pytest.raises(ValueError, match="GGUF files of StableLM are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "s.gguf"), "stablelm"))


@pytest.mark.integration
@pytest.mark.parametrize("over", [{}, V2_12B])
def test_tp2_matches_tp1(over: dict, tmp_path) -> None:  # noqa: ANN001
    """Heads (laid out per head) and MLP columns split; the per-head q/k norms' rows split with their heads; the
    parallel residual's partial sums reduced once."""
    path = str(tmp_path)
    stablelm(path, seed=4, initializer_range=INIT_RANGE, **over)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
