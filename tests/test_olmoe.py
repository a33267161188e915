"""OLMoE against transformers in float32 on tiny random models: whole-width q/k norms, clip_qkv, softmax top-k
routing with and without norm_topk_prob; the cpu and torch_native backends, the scheduler with chunked prefill and
the prefix cache, TP=2 over gloo (the norms' sums of squares all-reduced), transformers 5's stacked expert names,
dummy weights and refusals."""

from __future__ import annotations

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves, stub_gguf
from parallel_utils import tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
STEPS = 8
TINY = dict(hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-5, num_experts=8, num_experts_per_tok=3,
            norm_topk_prob=True, clip_qkv=0.6, initializer_range=0.2, pad_token_id=0, bos_token_id=1,
            eos_token_id=2, rope_parameters={"rope_type": "default", "rope_theta": 10000.0})


def olmoe(path: str, seed: int = 0, save: bool = True, **over: object) -> torch.nn.Module:
    """A tiny OLMoE (8 experts, top 3) with its q/k norm weights away from 1 and a clip_qkv that clamps many q/k/v
    values."""
    import transformers as tf

    torch.manual_seed(seed)
    hf = tf.AutoModelForCausalLM.from_config(tf.OlmoeConfig(**{**TINY, **over})).float().eval()
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("mlp.gate.weight"):
                p.mul_(4.0)
    if save:
        hf.save_pretrained(path)
    return hf


class PerHeadNorm(torch.nn.Module):
    """The same weights applied per head (each head's own mean of squares), as Qwen3's q/k norms."""

    def __init__(self, norm: torch.nn.Module, head_dim: int) -> None:
        super().__init__()
        self.weight, self.eps, self.head_dim = norm.weight, norm.eps, head_dim

    def forward(self, x: torch.Tensor, sum_sq: torch.Tensor | None = None) -> torch.Tensor:
        h = x.reshape(-1, self.head_dim)
        return self.weight * (h * torch.rsqrt(h.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(x.shape)


def greedy(path: str, steps: int = STEPS, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


@pytest.mark.parametrize("backend,over", [("cpu", {}), ("torch_native", {"norm_topk_prob": False}),
                                          ("cpu", {"clip_qkv": None, "attention_bias": True})])
def test_greedy_matches_transformers(backend: str, over: dict, tmp_path) -> None:  # noqa: ANN001
    hf = olmoe(str(tmp_path), **over)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 4
    assert greedy(str(tmp_path), attention_backend=backend) == want


def test_clip_and_whole_width_norm_change_the_tokens(tmp_path) -> None:  # noqa: ANN001
    """The case above could not pass without clip_qkv, nor with the q/k norm taken per head (Qwen3's) in place of
    over the whole width."""
    path = str(tmp_path)
    hf = olmoe(path)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        layer.self_attn.clip = None
    assert StaticBatch(runner).generate(PROMPTS, STEPS) != want
    runner = make_runner(path)
    for layer in runner.model.model.layers:
        attn = layer.self_attn
        attn.q_norm, attn.k_norm = PerHeadNorm(attn.q_norm, attn.head_dim), PerHeadNorm(attn.k_norm, attn.head_dim)
    assert StaticBatch(runner).generate(PROMPTS, STEPS) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = olmoe(str(tmp_path))
    assert scheduler_waves(str(tmp_path), max_new_tokens=STEPS) == [hf_greedy(hf, p, STEPS) for p in WAVE_PROMPTS]


def test_stacked_names_and_dummy_weights(tmp_path) -> None:  # noqa: ANN001
    """transformers 5's in-memory stacked expert names load as the checkpoint's per-expert ones do; --load-format
    dummy serves the model."""
    path = str(tmp_path)
    hf = olmoe(path)
    want = [hf_greedy(hf, p, STEPS) for p in PROMPTS]
    names = dict(hf.state_dict())
    assert "model.layers.0.mlp.experts.gate_up_proj" in names
    runner = make_runner(path, load_format="dummy")
    assert [len(o) for o in StaticBatch(runner).generate(PROMPTS, 4)] == [4, 4, 4]
    runner = make_runner(path, load_format="dummy")  # (a fresh one: the CPU kernels keep packed weights they ran)
    runner.model.load_weights(names.items())
    assert StaticBatch(runner).generate(PROMPTS, STEPS) == want


def test_unsupported_configs_and_gguf_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.olmoe import OlmoeForCausalLM

    path = str(tmp_path)
    olmoe(path, save=False).config.save_pretrained(path)
    for key, value, match in (("head_dim", 32, "head_dim 32"), ("sliding_window", 8, "sliding_window"),
                              ("clip_qkv", -1.0, "clip_qkv must be"), ("hidden_act", "gelu", "hidden_act"),
                              ("num_experts_per_tok", 9, "num_experts_per_tok 9")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own checks
        with pytest.raises(ValueError, match=match):
            OlmoeForCausalLM(cfg)
    with pytest.raises(ValueError, match="GGUF files of OLMoE are not supported"):
        ModelConfig(stub_gguf(str(tmp_path / "olmoe.gguf"), "olmoe"))


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """q/k norms over the whole width with each rank holding two of four q heads and one of two KV heads."""
    path = str(tmp_path)
    olmoe(path, seed=3)
    got, want = tp2_and_tp1_outputs(path, PROMPTS, max_new_tokens=STEPS)
    assert got == want
