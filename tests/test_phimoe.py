"""Phi-3.5-MoE against transformers in float32 on tiny random models: biased LayerNorms, q/k/v/o and LM-head
biases, LongRoPE with the config's mscales, the sparsemixer top-2 router; the cpu and torch_native backends (and a
sliding window), the scheduler with chunked prefill and the prefix cache, TP=2 over gloo, transformers 5's stacked
expert names, dummy weights and refusals."""

from __future__ import annotations

import json
import math

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
ROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "original_max_position_embeddings": 64,
        "short_factor": [1.0, 1.1, 1.3, 1.6, 2.0, 2.5, 3.0, 4.0],
        "long_factor": [1.0, 2.0, 3.0, 4.0, 6.0, 8.0, 12.0, 16.0],
        "short_mscale": 1.4, "long_mscale": 1.6}  # (the release's are equal, 1.2432; unequal here, so each shows)
TINY = dict(hidden_size=64, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, num_local_experts=4,
            num_experts_per_tok=2, attention_bias=True, lm_head_bias=True, router_jitter_noise=0.1,
            initializer_range=0.1, pad_token_id=0, bos_token_id=1, eos_token_id=2, rope_parameters=ROPE)


def phimoe(path: str, seed: int = 0, save: bool = True, **over: object) -> torch.nn.Module:
    """A tiny Phi-3.5-MoE (4 experts) with its norms' weights and biases and every bias away from their init, and a
    wider router jitter than the release's 0.01, so that the sparsemixer's masked softmax keeps several experts."""
    import transformers as tf

    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.PhimoeConfig(**{**TINY, **over})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("router.weight"):
                p.mul_(5.0)
    if save:
        hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


def _edit_config(path: str, **changes: object) -> None:
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg.update(changes)
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("backend,window", [("cpu", None), ("torch_native", None), ("cpu", 6)])
def test_greedy_matches_transformers(backend: str, window: int | None, tmp_path) -> None:  # noqa: ANN001
    hf = phimoe(str(tmp_path), sliding_window=window)
    assert greedy(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_router_biases_and_mscale_change_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with a plain softmax top-2 router (renormalised, as Mixtral's), with the
    LayerNorm or LM-head biases left out, or with LongRoPE's own attention factor in place of the mscales."""
    from radixserve.models import phimoe as ours

    path = str(tmp_path)
    hf = phimoe(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]

    def softmax_top2(logits: torch.Tensor, jitter_eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        w, ids = logits.softmax(dim=-1).topk(2, dim=-1)
        return w / w.sum(dim=-1, keepdim=True), ids.to(torch.int32)

    with monkeypatch.context() as m:
        m.setattr(ours, "sparsemixer", softmax_top2)
        assert greedy(path) != want
    for which in ("lm_head", "norms"):
        runner = make_runner(path)
        with torch.no_grad():
            for name, p in runner.model.named_parameters():
                if name.endswith(".bias") and (name.startswith("lm_head") if which == "lm_head" else "norm" in name):
                    p.zero_()
        assert StaticBatch(runner).generate(PROMPTS, 12) != want, which
    factor = math.sqrt(1 + math.log(512 / 64) / math.log(64))  # what LongRoPE scales by without mscales
    _edit_config(path, rope_parameters={**ROPE, "short_mscale": factor, "long_mscale": factor})
    assert greedy(path) != want


def test_rotary_tables_short_and_long(tmp_path) -> None:  # noqa: ANN001
    """Below original_max_position_embeddings our cos/sin are transformers' (short factors, short_mscale); from it
    on, the long factors with long_mscale (transformers' long frequencies; it would turn a long forward with the
    short ones, see the module's note)."""
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    path = str(tmp_path)
    hf = phimoe(path)
    rotary = make_runner(path).model.model.layers[0].self_attn.rotary_emb
    pos = torch.arange(64)[None]
    cos, sin = hf.model.rotary_emb(torch.zeros(1, dtype=torch.float32), pos)
    assert torch.equal(rotary.cos_cache[:64], cos[0, :, :8]) and torch.equal(rotary.sin_cache[:64], sin[0, :, :8])
    long_freq, _ = ROPE_INIT_FUNCTIONS["longrope"](hf.config, None, seq_len=65)
    freqs = torch.outer(torch.arange(64, 512, dtype=torch.float32), long_freq)
    assert torch.equal(rotary.cos_cache[64:512], freqs.cos() * 1.6)
    assert torch.equal(rotary.sin_cache[64:512], freqs.sin() * 1.6)


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = phimoe(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_stacked_names_hub_name_and_dummy_weights(tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory names (`mlp.router`, stacked `mlp.experts.gate_up_proj` / `down_proj`) load as the
    checkpoint's do; the hub's `PhiMoEForCausalLM` serves the same model; --load-format dummy serves it."""
    path = str(tmp_path)
    hf = phimoe(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    _edit_config(path, architectures=["PhiMoEForCausalLM"])
    runner = make_runner(path, load_format="dummy")
    assert type(runner.model).__name__ == "PhiMoEForCausalLM"
    assert [len(o) for o in StaticBatch(runner).generate(PROMPTS, 4)] == [4, 4, 4]
    names = dict(hf.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names and "model.layers.0.mlp.router.weight" in names
    runner = make_runner(path, load_format="dummy")  # (a fresh one: the CPU kernels keep packed weights they ran)
    runner.model.load_weights(names.items())
    assert StaticBatch(runner).generate(PROMPTS, 12) == want


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.phimoe import PhimoeForCausalLM

    path = str(tmp_path)
    phimoe(path)
    cases = (({"num_experts_per_tok": 3}, "picks 2 experts"),
             ({"rope_parameters": {"rope_type": "yarn", "rope_theta": 1e4, "factor": 2.0}}, "not supported"),
             ({"rope_parameters": {k: v for k, v in ROPE.items() if k != "long_mscale"}}, "long_mscale"))
    for change, match in cases:
        cfg = ModelConfig(path).hf_config
        cfg.__dict__.update(change)
        if "rope_parameters" in change:
            cfg.__dict__["rope_scaling"] = change["rope_parameters"]
        with pytest.raises(ValueError, match=match):
            PhimoeForCausalLM(cfg)
    with pytest.raises(ValueError, match="GGUF files of Phi-3.5-MoE"):
        ModelConfig(stub_gguf(str(tmp_path / "phimoe.gguf"), "phimoe"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads split (biased q/k/v, o_proj's bias on one rank), experts' intermediate slices, the biased LM head's
    vocabulary slices."""
    path = str(tmp_path)
    phimoe(path, seed=3, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
