"""OLMo 2 and OLMo 3 against transformers in float32 on tiny random models: no input norms but post-attention and
post-feedforward norms, q/k RMS-normed over all their heads (not per head), OLMo 3's sliding layers and its
per-layer-type rotary (YaRN on the full layers only); through the scheduler with chunked prefill and the prefix
cache, and TP=2 over gloo (the q/k norm's sums of squares all-reduced, KV heads split or replicated)."""

from __future__ import annotations

import json
from types import SimpleNamespace

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def olmo(path: str, kind: str = "olmo3", seed: int = 0, **over: object) -> torch.nn.Module:
    hf = make_tiny_model(kind, path, seed=seed, **over)
    with torch.no_grad():  # norms away from 1 and sharper attention (q/k are normed: their norms set the scale)
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if "q_norm" in name or "k_norm" in name:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return hf


def greedy(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("kind,backend", [("olmo2", "cpu"), ("olmo3", "cpu"), ("olmo2", "torch_native"),
                                          ("olmo3", "torch_native")])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = olmo(str(tmp_path), kind)
    assert greedy(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_post_norms_and_whole_width_qk_norm_change_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with either post-norm left out, or with q/k normed per head (Qwen3's)."""
    from radixserve.models.olmo2 import OlmoAttention

    path = str(tmp_path)
    hf = olmo(path, "olmo2")
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    for norm in ("post_attention_layernorm", "post_feedforward_layernorm"):
        runner = make_runner(path)
        for layer in runner.model.model.layers:
            setattr(layer, norm, torch.nn.Identity())
        assert StaticBatch(runner).generate(PROMPTS, 12) != want, norm

    def per_head(self: OlmoAttention, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            heads = x.float().reshape(x.shape[0], -1, self.head_dim)
            heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)
            return (weight * heads.reshape(x.shape)).to(x.dtype)
        return norm(q, self.q_norm.weight, self.q_norm.eps), norm(k, self.k_norm.weight, self.k_norm.eps)

    monkeypatch.setattr(OlmoAttention, "norm_qk", per_head)
    assert greedy(path) != want


def test_window_changes_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """OLMo 3's cases above could not pass with its sliding layers attending to the whole prompt."""
    path = str(tmp_path)
    hf = olmo(path, "olmo3")
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    with open(f"{path}/config.json") as f:
        cfg = json.load(f)
    cfg["sliding_window"] = 10**6
    with open(f"{path}/config.json", "w") as f:
        json.dump(cfg, f)
    assert greedy(path) != want


def test_rotary_tables_per_layer_type(tmp_path) -> None:  # noqa: ANN001
    """The sliding layers rotate with their own base and no scaling, the full ones with YaRN (frequencies and the
    attention factor on cos/sin): our tables equal transformers' per type, and the two types differ."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.olmo2 import Olmo3ForCausalLM, olmo3_rotary

    path = str(tmp_path)
    hf = olmo(path, "olmo3")
    model = Olmo3ForCausalLM(ModelConfig(path).hf_config)
    positions = torch.arange(100)[None]
    half = hf.config.hidden_size // hf.config.num_attention_heads // 2
    for layer, kind in zip(model.model.layers, hf.config.layer_types, strict=True):
        cos, sin = hf.model.rotary_emb(torch.zeros(1), positions, kind)
        torch.testing.assert_close(layer.self_attn.rotary_emb.cos_cache[:100], cos[0, :, :half])
        torch.testing.assert_close(layer.self_attn.rotary_emb.sin_cache[:100], sin[0, :, :half])
    sliding, full = (olmo3_rotary(hf.config, t) for t in ("sliding_attention", "full_attention"))
    assert not torch.allclose(sliding.cos_cache[:100], full.cos_cache[:100])
    flat = SimpleNamespace(hidden_size=64, num_attention_heads=4, max_position_embeddings=512, rope_theta=1e4,
                           rope_scaling={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 128})
    # a transformers-4 config: theta and scaling flat, the sliding layers unscaled
    assert olmo3_rotary(flat, "sliding_attention")._attention_factor == 1.0
    assert olmo3_rotary(flat, "full_attention")._attention_factor > 1.0


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    """Chunks of 5 tokens and prompts sharing cached prefixes longer than the window."""
    hf = olmo(str(tmp_path), "olmo3")
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_bad_configs_and_norm_weights_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.olmo2 import Olmo3ForCausalLM

    path = str(tmp_path)
    olmo(path, "olmo3")
    cfg = ModelConfig(path).hf_config
    model = Olmo3ForCausalLM(cfg)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match="expected \\(64,\\)"):  # a per-head norm weight (head_dim 16)
        model.load_weight(params, "model.layers.0.self_attn.q_norm.weight", torch.ones(16))
    cfg.layer_types = ["sliding_attention", "chunked_attention"]
    with pytest.raises(ValueError, match="chunked_attention"):
        Olmo3ForCausalLM(cfg)
    cfg.layer_types = ["sliding_attention"]
    with pytest.raises(ValueError, match="1 entries for 2 layers"):
        Olmo3ForCausalLM(cfg)


def test_dummy_weights_do_not_depend_on_the_tp_split() -> None:
    """--load-format dummy generates each q/k norm weight whole and gives each rank its heads' slice of it."""
    from radixserve.model_loader.dummy import initialize_dummy_weights
    from radixserve.models.olmo2 import WholeWidthRMSNorm

    whole = torch.nn.ModuleDict({"q_norm": WholeWidthRMSNorm(64, 64, 0, 1e-6)})
    rank1 = torch.nn.ModuleDict({"q_norm": WholeWidthRMSNorm(64, 32, 32, 1e-6)})
    initialize_dummy_weights(whole)
    initialize_dummy_weights(rank1)
    assert torch.equal(rank1.q_norm.weight, whole.q_norm.weight[32:])
    assert not torch.equal(whole.q_norm.weight[:32], whole.q_norm.weight[32:])


def test_gguf_files_are_refused(tmp_path) -> None:  # noqa: ANN001
    """llama.cpp writes both generations as "olmo2" (post-norms no GGUF name here maps): refused by name."""

    from radixserve.configs.model_config import ModelConfig

    file = stub_gguf(str(tmp_path / "olmo2.gguf"), "olmo2")
    with pytest.raises(ValueError, match="GGUF files of OLMo 2 / OLMo 3 are not supported"):
        ModelConfig(file)


@pytest.mark.integration
@pytest.mark.parametrize("kind,over", [("olmo2", {}), ("olmo3", {"num_key_value_heads": 1})])  # KV heads replicated
def test_tp2_matches_tp1(kind: str, over: dict, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    make_tiny_model(kind, path, seed=4, initializer_range=INIT_RANGE, **over)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want
