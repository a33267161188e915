"""Nemotron (NemotronForCausalLM) against transformers in float32 on tiny random models: LayerNorm1P (a biased
LayerNorm scaling by 1 + weight, the + 1 added at load), the ungated relu2 MLP, partial rotation (half of each head,
laid out at load) with an explicit head_dim, the attention and MLP bias flags; through the scheduler with chunked
prefill and the prefix cache, dummy weights, and TP=2 over gloo. The + 1, the norm biases, the activation and the
rotary layout are each shown to change the tokens; a sliding window, unsupported activations and Nemotron GGUF
files are refused."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import TINY, WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
BIASED = {"attention_bias": True, "mlp_bias": True}


def nemotron(path: str, seed: int = 0, initializer_range: float = 0.2, **over: object) -> torch.nn.Module:
    """A tiny Nemotron saved at `path` (head_dim 32 over a 64-wide model: 4 heads project to 128), whose tokens depend
    on each term: the norms' stored weights away from 0 (their scale from 1), biases away from 0."""
    import transformers as tf

    torch.manual_seed(seed)
    kw = {**TINY, **over}
    eps, theta = kw.pop("rms_norm_eps"), kw.pop("rope_theta")
    share = kw.pop("partial_rotary_factor", 0.5)
    cfg = tf.NemotronConfig(**{"head_dim": 32, "norm_eps": eps, "bos_token_id": 1, "eos_token_id": 2,
                               "rope_parameters": {"rope_type": "default", "rope_theta": theta,
                                                   "partial_rotary_factor": share},
                               "initializer_range": initializer_range, **kw})
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.3)
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("over,backend", [({}, "cpu"), ({}, "torch_native"), (BIASED, "cpu"),
                                          ({"partial_rotary_factor": 1.0}, "cpu")])
def test_greedy_matches_transformers(over: dict, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = nemotron(str(tmp_path), **over)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    model = runner.model
    assert model.lm_head is not model.model.embed_tokens  # untied: transformers' Nemotron default
    attn, mlp = model.model.layers[0].self_attn, model.model.layers[0].mlp
    assert attn.head_dim == 32 and attn.rotary_emb.rotary_dim == int(32 * over.get("partial_rotary_factor", 0.5))
    biased = bool(over.get("attention_bias"))
    assert (attn.qkv_proj.bias is not None) == (attn.o_proj.bias is not None) == biased
    assert (mlp.up_proj.bias is not None) == (mlp.down_proj.bias is not None) == bool(over.get("mlp_bias"))
    assert model.model.layers[0].input_layernorm.bias is not None


def test_norm_one_plus_weight_is_loaded(tmp_path) -> None:  # noqa: ANN001
    """Every norm's weight is the checkpoint's + 1 (the scale NemotronLayerNorm1P applies); its bias as stored."""
    path = str(tmp_path)
    hf = nemotron(path)
    model = make_runner(path).model
    for name in ("model.layers.1.post_attention_layernorm", "model.norm"):
        theirs, ours_ = hf.get_submodule(name), model.get_submodule(name)
        torch.testing.assert_close(ours_.weight, theirs.weight + 1.0, atol=0, rtol=0)
        torch.testing.assert_close(ours_.bias, theirs.bias, atol=0, rtol=0)


def test_plus_one_bias_activation_and_layout_change_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass without the + 1 in the norms' scale, with their biases dropped, with relu in
    place of relu2, or with the partially rotated dims left in the checkpoint's order."""
    from radixserve.layers.activation import ACTIVATIONS
    from radixserve.models import glm4

    path = str(tmp_path)
    hf = nemotron(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]

    def each_norm(runner, fn) -> None:  # noqa: ANN001
        for name, module in runner.model.named_modules():
            if name.endswith("norm"):
                fn(module)

    for change in (lambda n: n.weight.sub_(1.0), lambda n: n.bias.zero_()):
        runner = make_runner(path)
        each_norm(runner, change)
        assert StaticBatch(runner).generate(PROMPTS, 12) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.mlp.act_fn = torch.relu
    assert StaticBatch(runner).generate(PROMPTS, 12) != want
    assert ACTIVATIONS["relu2"](torch.tensor([-2.0, 3.0])).tolist() == [0.0, 9.0]
    monkeypatch.setattr(glm4, "rotary_order", lambda head_dim, rotary_dim, interleaved: None)
    assert ours(path) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = nemotron(str(tmp_path), **BIASED)
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    """--load-format dummy draws the norms' scales near 1 (the parameter holds the scale: no + 1 is added to a
    dummy weight) and their biases near 0."""
    nemotron(str(tmp_path))
    runner = make_runner(str(tmp_path), load_format="dummy")
    norm = runner.model.model.norm
    assert 0 < (norm.weight - 1).abs().max() < 0.2 and 0 < norm.bias.abs().max() < 0.2
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / "m")
    nemotron(path)
    cfg_path = os.path.join(path, "config.json")
    cfg = json.load(open(cfg_path))
    json.dump({**cfg, "sliding_window": 8}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="sliding_window is not supported for Nemotron"):
        make_runner(path)
    json.dump({**cfg, "hidden_act": "relu6"}, open(cfg_path, "w"))
    with pytest.raises(ValueError, match="hidden_act 'relu6' is not supported"):
        make_runner(path)
    with pytest.raises(ValueError, match="GGUF files of Nemotron are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "n.gguf"), "nemotron"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads split over the ranks keep their rotary layout; biased up / down split column- and row-wise."""
    path = str(tmp_path)
    nemotron(path, seed=4, initializer_range=INIT_RANGE, **BIASED)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
