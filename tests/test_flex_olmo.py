"""FlexOlmo (FlexOlmoForCausalLM) against transformers in float32 on tiny random models: OLMo 2's post-norm layer
with its whole-width q/k norms around OLMoE's softmax top-k MoE block, with and without norm_topk_prob; the cpu
and torch_native backends, the scheduler with chunked prefill and the prefix cache, transformers 5's stacked expert
names, dummy weights, TP=2 over gloo and refusals. The post-feedforward norm over the MoE output and the
whole-width q/k norm are shown to change the tokens."""

from __future__ import annotations

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves
from parallel_utils import tp2_and_tp1_outputs
from test_olmoe import PerHeadNorm

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
STEPS = 8
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, num_experts=7, num_experts_per_tok=3,
            norm_topk_prob=True, initializer_range=0.2, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def flex_olmo(path: str, seed: int = 0, save: bool = True, **over: object) -> torch.nn.Module:
    """A tiny FlexOlmo (7 experts, top 3) with its norm weights away from 1 and a sharper router."""
    import transformers as tf

    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.FlexOlmoConfig(**{**TINY, **over})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.05)
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)
    if save:
        hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = STEPS, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("backend,over", [("cpu", {}), ("torch_native", {"norm_topk_prob": False}),
                                          ("cpu", {"attention_bias": True})])
def test_greedy_matches_transformers(backend: str, over: dict, tmp_path) -> None:  # noqa: ANN001
    hf = flex_olmo(str(tmp_path), **over)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 4
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, STEPS) == want
    layer = runner.model.model.layers[0]
    assert not hasattr(layer, "input_layernorm") and hasattr(layer.mlp, "experts")
    assert (layer.self_attn.qkv_proj.bias is not None) == over.get("attention_bias", False)


def test_post_norm_and_whole_width_norm_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass without the norm over the MoE block's output or with the q/k norm taken per
    head (Qwen3's). (norm_topk_prob scales each token's MoE output by one number, which that RMSNorm takes out.)"""
    path = str(tmp_path)
    hf = flex_olmo(path)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.post_feedforward_layernorm = torch.nn.Identity()
    assert StaticBatch(runner).generate(PROMPTS, STEPS) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        attn = layer.self_attn
        attn.q_norm, attn.k_norm = PerHeadNorm(attn.q_norm, attn.head_dim), PerHeadNorm(attn.k_norm, attn.head_dim)
    assert StaticBatch(runner).generate(PROMPTS, STEPS) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = flex_olmo(str(tmp_path))
    assert scheduler_waves(str(tmp_path), max_new_tokens=STEPS) == [hf_greedy(hf, p, STEPS) for p in WAVE_PROMPTS]


def test_stacked_names_and_dummy_weights(tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory stacked expert names load as the checkpoint's do; --load-format dummy serves
    the model."""
    path = str(tmp_path)
    hf = flex_olmo(path)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    names = dict(hf.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    runner = make_runner(path, load_format="dummy")
    assert [len(o) for o in StaticBatch(runner).generate(PROMPTS, 4)] == [4, 4, 4]
    runner = make_runner(path, load_format="dummy")  # (a fresh one: the CPU kernels keep packed weights they ran)
    runner.model.load_weights(names.items())
    assert StaticBatch(runner).generate(PROMPTS, STEPS) == want


def test_unsupported_configs_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.flex_olmo import FlexOlmoForCausalLM

    path = str(tmp_path)
    flex_olmo(path, save=False).config.save_pretrained(path)
    for key, value, match in (("sliding_window", 8, "sliding_window is not supported for FlexOlmo"),
                              ("hidden_act", "gelu", "hidden_act"), ("num_experts", 0, "num_experts > 0"),
                              ("num_experts_per_tok", 9, "num_experts_per_tok 9")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own checks
        with pytest.raises(ValueError, match=match):
            FlexOlmoForCausalLM(cfg)


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Whole-width q/k norms with each rank holding two of four q heads and one of two KV heads; experts split."""
    path = str(tmp_path)
    flex_olmo(path, seed=3)
    got, want = tp2_and_tp1_outputs(path, PROMPTS, max_new_tokens=STEPS)
    assert got == want
