"""dots.llm1 against transformers in float32 on tiny random models: per-head q/k norms, a dense first layer, sigmoid
routing with e_score_correction_bias over expert groups, routed_scaling_factor and the shared experts; the cpu and
torch_native backends (and sliding layers), the scheduler with chunked prefill and the prefix cache, transformers
5's stacked expert names, dummy weights and refusals."""

from __future__ import annotations

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
STEPS = 8
TINY = dict(hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, vocab_size=256, max_position_embeddings=512,
            rms_norm_eps=1e-5, n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=4,
            topk_group=2, first_k_dense_replace=1, norm_topk_prob=True, routed_scaling_factor=2.5,
            sliding_window=None, initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def dots1(path: str, seed: int = 0, save: bool = True, **over: object) -> torch.nn.Module:
    """A tiny dots.llm1 (8 experts in 4 groups, 2 groups eligible, top 2; one shared expert; layer 0 dense) with a
    non-zero e_score_correction_bias (a buffer: the parameter loop would miss it) and norm weights away from 1."""
    import transformers as tf

    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.Dots1Config(**{**TINY, **over})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("mlp.gate.weight"):
                p.mul_(5.0)
        for layer in hf.model.layers[TINY["first_k_dense_replace"]:]:
            layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    if save:
        hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = STEPS, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("backend,over", [("cpu", {}), ("torch_native", {"attention_bias": True}),
                                          ("cpu", {"sliding_window": 6, "layer_types": ["full_attention",
                                                   "sliding_attention", "sliding_attention"]})])
def test_greedy_matches_transformers(backend: str, over: dict, tmp_path) -> None:  # noqa: ANN001
    hf = dots1(str(tmp_path), **over)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 4
    assert greedy(str(tmp_path), attention_backend=backend) == want


def test_routing_features_and_shared_experts_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass without the correction bias, the expert groups, routed_scaling_factor or the
    shared experts."""
    import dataclasses

    path = str(tmp_path)
    hf = dots1(path)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    changes = {"bias": lambda mlp: mlp.gate.e_score_correction_bias.zero_(),
               "groups": lambda mlp: setattr(mlp.experts, "router", dataclasses.replace(
                   mlp.experts.router, num_groups=None, topk_groups=None)),
               "scale": lambda mlp: setattr(mlp.experts, "router", dataclasses.replace(
                   mlp.experts.router, routed_scaling_factor=1.0)),
               "shared": lambda mlp: setattr(mlp, "shared_experts", None)}
    for what, change in changes.items():
        runner = make_runner(path)
        with torch.no_grad():
            for layer in runner.model.model.layers[1:]:
                change(layer.mlp)
        assert StaticBatch(runner).generate(PROMPTS, STEPS) != want, what


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = dots1(str(tmp_path))
    assert scheduler_waves(str(tmp_path), max_new_tokens=STEPS) == [hf_greedy(hf, p, STEPS) for p in WAVE_PROMPTS]


def test_stacked_names_and_dummy_weights(tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory stacked expert names load as the checkpoint's per-expert ones do; --load-format
    dummy serves the model; layer 0 is dense, the others hold 8 experts and the shared MLP."""
    from radixserve.models.deepseek_v2 import DeepseekMoE
    from radixserve.models.llama import LlamaMLP

    path = str(tmp_path)
    hf = dots1(path)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    runner = make_runner(path, load_format="dummy")
    layers = runner.model.model.layers
    assert isinstance(layers[0].mlp, LlamaMLP) and all(isinstance(la.mlp, DeepseekMoE) for la in layers[1:])
    assert layers[1].mlp.experts.w13_weight.shape == (8, 64, 64) and layers[1].self_attn.qk_norm
    assert [len(o) for o in StaticBatch(runner).generate(PROMPTS, 4)] == [4, 4, 4]
    names = dict(hf.state_dict())
    assert "model.layers.1.mlp.experts.gate_up_proj" in names
    runner = make_runner(path, load_format="dummy")  # (a fresh one: the CPU kernels keep packed weights they ran)
    runner.model.load_weights(names.items())
    assert StaticBatch(runner).generate(PROMPTS, STEPS) == want


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.dots1 import Dots1ForCausalLM

    path = str(tmp_path)
    dots1(path, save=False).config.save_pretrained(path)
    cases = (("scoring_func", "softmax", "scoring_func 'softmax'"), ("moe_layer_freq", 2, "moe_layer_freq 2"),
             ("n_shared_experts", None, "n_shared_experts >= 0"), ("n_group", 8, "groups of at least 2"),
             ("layer_types", ["sliding_attention"] * 3, "use_sliding_window is false"),
             ("hidden_act", "gelu", "hidden_act 'gelu'"))
    for key, value, match in cases:
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own checks
        if key == "layer_types":
            cfg.__dict__["use_sliding_window"] = False
        with pytest.raises(ValueError, match=match):
            Dots1ForCausalLM(cfg)
    with pytest.raises(ValueError, match="GGUF files of dots.llm1 are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "dots1.gguf"), "dots1"))
