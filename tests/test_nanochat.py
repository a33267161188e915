"""NanoChat (NanoChatForCausalLM) against transformers in float32 on tiny random models: weightless RMSNorms (the
embeddings normed before the first layer), the rotation turning the other way (each head's halves swapped at load),
per-head q/k norms after the rotation, the ungated relu2 MLP (fc1 / fc2), attention_bias on and off, soft-capped
logits; through the scheduler with chunked prefill and the prefix cache, dummy weights, and TP=2 over gloo. The
rotation's direction and the q/k norms are shown to change the tokens, the soft cap the logprobs; a sliding window and
unsupported activations are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
CAP = 2.0  # low enough for the cap to move these tokens (the releases': 15)


def nanochat(path: str, seed: int = 0, initializer_range: float = 0.2, **over: object) -> torch.nn.Module:
    """A tiny NanoChat saved at `path`: biases (where attention_bias) away from 0, sharper attention."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, "attention_bias": True, "final_logit_softcapping": CAP, **over}
    theta = kw.pop("rope_theta")
    cfg = tf.NanoChatConfig(**{"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0,
                               "rope_parameters": {"rope_type": "default", "rope_theta": theta},
                               "initializer_range": initializer_range, **kw})
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(2.0)
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"), ({"attention_bias": False}, "cpu")])
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = nanochat(str(tmp_path), **over)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    model = runner.model
    assert model.lm_head is not model.model.embed_tokens and model.logits_processor.cap == CAP
    layer = model.model.layers[0]
    assert not hasattr(layer.mlp, "gate_up_proj") and layer.mlp.up_proj.bias is None
    assert (layer.self_attn.o_proj.bias is not None) == over.get("attention_bias", True)


def test_rotation_direction_and_qk_norm_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with the q/k rows left in the checkpoint's order (the rotation turning
    transformers' Llama way) or without the q/k norms."""
    from radixserve.models.nanochat import NanoChatForCausalLM

    path = str(tmp_path)
    hf = nanochat(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    order = NanoChatForCausalLM._laid_out
    try:
        NanoChatForCausalLM._laid_out = lambda self, name, tensor: tensor
        assert ours(path) != want
    finally:
        NanoChatForCausalLM._laid_out = order
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.self_attn.q_norm = torch.nn.Identity()
        layer.self_attn.k_norm = torch.nn.Identity()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want


def test_prompt_logprobs_are_soft_capped(tmp_path) -> None:  # noqa: ANN001
    """The cap is monotonic (greedy tokens cannot show it): prompt logprobs equal transformers' to float32
    rounding, and move well past that without the cap."""
    path = str(tmp_path)
    hf = nanochat(path)
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    runner = make_runner(path)
    torch.testing.assert_close(StaticBatch(runner).prompt_logprobs(ids), want, atol=1e-5, rtol=1e-5)
    runner.model.logits_processor.cap = None
    assert (StaticBatch(runner).prompt_logprobs(ids) - want).abs().max() > 1e-2


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = nanochat(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    nanochat(str(tmp_path))
    runner = make_runner(str(tmp_path), load_format="dummy")
    assert runner.model.model.layers[0].self_attn.qkv_proj.bias.abs().max() > 0
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_unsupported_configs_are_refused(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "m")
    nanochat(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "sliding_window": 8}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="sliding_window is not supported for NanoChat"):
        make_runner(path)
    json.dump({**cfg, "hidden_act": "quick_gelu"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'quick_gelu' is not supported"):
        make_runner(path)
    rope = {"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}
    json.dump({**cfg, "rope_parameters": rope}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="does not support partial_rotary_factor"):
        make_runner(path)


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads split with their rows laid out, MLP columns split, the soft cap over the gathered logits."""
    path = str(tmp_path)
    nanochat(path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
