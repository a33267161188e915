"""Gemma 1 (GemmaForCausalLM) against transformers in float32 on tiny random models: the embedding scaled by
sqrt(hidden_size), norms scaling by (1 + weight), the GELU-tanh MLP, head_dim set apart from hidden / heads (as the
7B's 256), multi-query attention (as the 2B's) or not; the releases' legacy hidden_act "gelu"; through the scheduler
with chunked prefill and the prefix cache, and TP=2 over gloo."""

from __future__ import annotations

import json
import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
SHAPE = dict(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
             head_dim=32, max_position_embeddings=512, rms_norm_eps=1e-6)
KINDS = {"mqa": {"num_key_value_heads": 1}, "mha": {"num_key_value_heads": 4}}  # 2B: one KV head; 7B: as many


def gemma1(path: str, kind: str = "mqa", seed: int = 0, init: float = 0.08) -> torch.nn.Module:
    """A tiny Gemma 1 saved to `path` whose tokens depend on each term: norms away from 1 + 0, sharper attention."""
    import transformers as tf

    torch.manual_seed(seed)
    cfg = tf.GemmaConfig(**SHAPE, **KINDS[kind], initializer_range=init)
    hf = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return hf


def ours(path: str, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, 12)


def _edit_config(path: str, **fields: object) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("kind", list(KINDS))
@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:
    hf = gemma1(str(tmp_path), kind)
    assert ours(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_embedding_scale_and_norm_offset_change_the_tokens(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The cases above could not pass without the sqrt(hidden) scale or the norms' + 1."""
    from radixserve.models import gemma

    path = str(tmp_path)
    want = [hf_greedy(gemma1(path), p, 12) for p in PROMPTS]
    with monkeypatch.context() as m:
        m.setattr(gemma, "embedding_scale", lambda config: 1.0)
        assert ours(path) != want
    original = gemma.GemmaFamilyForCausalLM.load_weight

    def without_offset(self, params, name, tensor):  # noqa: ANN001, ANN202
        return original(self, params, name, tensor - 1.0 if name.endswith("norm.weight") else tensor)

    monkeypatch.setattr(gemma.GemmaFamilyForCausalLM, "load_weight", without_offset)
    assert ours(path) != want


def test_legacy_gelu_config_and_other_activations(tmp_path) -> None:
    """The releases' config.json says hidden_act "gelu", meaning the tanh approximation (transformers runs it so):
    the same tokens. An activation Gemma does not use is refused."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.gemma import GemmaForCausalLM

    path = str(tmp_path)
    hf = gemma1(path)
    _edit_config(path, hidden_act="gelu")
    assert ours(path) == [hf_greedy(hf, p, 12) for p in PROMPTS]
    cfg = ModelConfig(path).hf_config
    cfg.__dict__["hidden_act"] = "silu"  # past the config class's own conversion
    with pytest.raises(ValueError, match="hidden_act 'silu' is not supported"):
        GemmaForCausalLM(cfg)


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:
    hf = gemma1(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_gguf_files_are_refused(tmp_path) -> None:
    """llama.cpp stores Gemma's norm weights with the 1 added: no tensor map here, refused by name."""
    from radixserve.configs.model_config import ModelConfig

    file = stub_gguf(str(tmp_path / "m.gguf"), "gemma")
    with pytest.raises(ValueError, match="GGUF files of Gemma 1 are not supported"):
        ModelConfig(file)


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:
    """Heads split over two ranks (the one KV head replicated), the tied embedding / LM head split by vocabulary."""
    path = str(tmp_path)
    gemma1(path, seed=3, init=INIT_RANGE)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
