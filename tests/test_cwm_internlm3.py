"""Two Llama-shaped families served by the Llama model, against transformers in float32 on tiny random models:
CWM (`CwmForCausalLM`: Llama 3 rope scaling, one full-attention layer in `layer_types` beside sliding-window ones)
and InternLM3 (`InternLM3ForCausalLM`: its config names the biases `qkv_bias` / `bias`, transformers maps them to
Llama's attention_bias / mlp_bias; dynamic NTK rope scaling, which leaves the frequencies alone within the original
context). The window and the biases are shown to change the tokens; a context past dynamic NTK's original one is
refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
LLAMA3 = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 64}


def _save(hf: torch.nn.Module, path: str) -> torch.nn.Module:
    with torch.no_grad():  # norms and biases away from 1 and 0, so that a dropped one shows
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    return hf


def cwm(path: str, seed: int = 0, initializer_range: float = 0.2, window: int = 5) -> torch.nn.Module:
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, "num_hidden_layers": 4}
    theta = kw.pop("rope_theta")
    cfg = tf.CwmConfig(**kw, head_dim=16, sliding_window=window, initializer_range=initializer_range,
                       rope_parameters={**LLAMA3, "rope_theta": theta}, bos_token_id=1, eos_token_id=2,
                       pad_token_id=0)
    cfg._attn_implementation = "eager"
    return _save(tf.AutoModelForCausalLM.from_config(cfg).float().eval(), path)


def internlm3(path: str, seed: int = 0, initializer_range: float = 0.2, bias: bool = True) -> torch.nn.Module:
    """As released: architectures InternLM3ForCausalLM, the biases under the config's own names."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = dict(TINY)
    theta = kw.pop("rope_theta")
    cfg = tf.InternLM3Config(**kw, qkv_bias=bias, bias=bias, head_dim=16, initializer_range=initializer_range,
                             rope_parameters={"rope_type": "dynamic", "factor": 6.0, "rope_theta": theta},
                             bos_token_id=1, eos_token_id=2, pad_token_id=0)
    hf = _save(tf.AutoModelForCausalLM.from_config(cfg).float().eval(), path)
    cfg_path = os.path.join(path, "config.json")
    raw = json.load(open(cfg_path))
    raw["architectures"] = ["InternLM3ForCausalLM"]
    raw["qkv_bias"], raw["bias"] = raw.pop("attention_bias"), raw.pop("mlp_bias")
    json.dump(raw, open(cfg_path, "w"))
    return hf


BUILDERS = {"cwm": cwm, "internlm3": internlm3}


@pytest.mark.parametrize("kind", sorted(BUILDERS))
@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = BUILDERS[kind](str(tmp_path))
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    if kind == "cwm":
        assert runner.model_config.sliding_windows == [-1, 5, 5, 5]
    else:
        attn = runner.model.model.layers[0].self_attn
        assert attn.qkv_proj.bias is not None and attn.o_proj.bias is not None
        assert runner.model.model.layers[0].mlp.down_proj.bias is not None


def test_window_and_biases_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The cases above could not pass with every CWM layer attending in full, or with InternLM3's biases dropped."""
    path = str(tmp_path / "cwm")
    hf = cwm(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    cfg_path = os.path.join(path, "config.json")
    raw = json.load(open(cfg_path))
    json.dump({**raw, "layer_types": ["full_attention"] * 4}, open(cfg_path, "w"))
    assert StaticBatch(make_runner(path)).generate(PROMPTS, 12) != want
    path = str(tmp_path / "internlm3")
    hf = internlm3(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.self_attn.qkv_proj.bias.zero_()
        layer.mlp.down_proj.bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want


def test_dynamic_ntk_context_is_bounded(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig

    internlm3(str(tmp_path))
    assert ModelConfig(str(tmp_path)).context_len == TINY["max_position_embeddings"]
    assert ModelConfig(str(tmp_path), context_length=100).context_len == 100
    with pytest.raises(ValueError, match="dynamic NTK rope scaling"):
        ModelConfig(str(tmp_path), context_length=TINY["max_position_embeddings"] + 1)


@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_scheduler_chunked_prefill_and_prefix_cache(kind: str, tmp_path) -> None:  # noqa: ANN001
    hf = BUILDERS[kind](str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


@pytest.mark.integration
@pytest.mark.parametrize("kind", sorted(BUILDERS))
def test_tp2_matches_tp1(kind: str, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    BUILDERS[kind](path, seed=4, initializer_range=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
