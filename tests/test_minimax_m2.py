"""MiniMax-M2 (MiniMaxM2ForCausalLM) against transformers in float32 on tiny random models: q/k RMS-normed over
their whole projected width, partial neox rotation (rotary_dim 16 of head_dim 32) laid out at load, sigmoid routing
with the correction bias for the choice only and the chosen scores renormalised; through the scheduler with chunked
prefill and the prefix cache, the multi-token-prediction layers skipped at load, a block-wise fp8 checkpoint, dummy
weights, and TP=2 over gloo."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves, stub_gguf
from parallel_utils import INIT_RANGE, tp2_and_tp1_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def minimax(path: str, seed: int = 0, **over: object) -> torch.nn.Module:
    """A tiny MiniMax-M2 whose tokens depend on each term: norms away from 1, softer router scores with a
    correction bias that can pass over the best-scored experts."""
    hf = make_tiny_model("minimax_m2", path, seed=seed, initializer_range=0.08, **over)
    with torch.no_grad():
        for name, p in hf.named_parameters():
            if "norm" in name:
                p.add_(torch.randn_like(p) * 0.3)
            if name.endswith("mlp.gate.weight"):
                p.mul_(0.25)  # softer scores (make_tiny_model sharpens them 40x): the bias can pass over the best
        for name, t in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                t.copy_(torch.randn_like(t) * 0.3)
    hf.save_pretrained(path)
    return hf


def ours(path: str, steps: int = 12, **server_kw: object) -> list[list[int]]:
    return StaticBatch(make_runner(path, **server_kw)).generate(PROMPTS, steps)


def _edit_config(path: str, **fields: object) -> None:
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    cfg.update(fields)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(cfg, f)


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = minimax(str(tmp_path))
    assert ours(str(tmp_path), attention_backend=backend) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_qk_norm_rotary_layout_and_correction_bias_change_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with q/k normed per head (Qwen3's), with the checkpoint's dim order in place
    of the partial-rotation layout, or with the routers' correction bias left out."""
    from radixserve.models import glm4
    from radixserve.models.minimax_m2 import MiniMaxM2Attention

    path = str(tmp_path)
    want = [hf_greedy(minimax(path), p, 12) for p in PROMPTS]
    runner = make_runner(path)
    assert runner.model.model.layers[0].self_attn.rotary_emb.rotary_dim == 16
    for layer in runner.model.model.layers:
        layer.mlp.gate.e_score_correction_bias.zero_()
    assert StaticBatch(runner).generate(PROMPTS, 12) != want

    def per_head(self: MiniMaxM2Attention, q: torch.Tensor, k: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        def norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
            heads = x.float().reshape(x.shape[0], -1, self.head_dim)
            heads = heads * torch.rsqrt(heads.pow(2).mean(-1, keepdim=True) + eps)
            return (weight * heads.reshape(x.shape)).to(x.dtype)
        return norm(q, self.q_norm.weight, self.q_norm.eps), norm(k, self.k_norm.weight, self.k_norm.eps)

    with monkeypatch.context() as m:
        m.setattr(MiniMaxM2Attention, "norm_qk", per_head)
        assert ours(path) != want
    monkeypatch.setattr(glm4, "rotary_order", lambda head_dim, rotary_dim, interleaved: None)
    assert ours(path) != want


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    hf = minimax(str(tmp_path))
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_mtp_layers_are_skipped_and_routing_bias_flag(tmp_path, caplog) -> None:  # noqa: ANN001
    """MiniMax-M2 checkpoints carry their multi-token-prediction modules as layers num_hidden_layers on: skipped
    with a log line, the tokens unchanged. use_routing_bias false builds routers without the bias and refuses a
    non-zero one in the checkpoint (transformers would route with it); a zero one loads past."""
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    hf = minimax(path)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    mtp = {name.replace("model.layers.1.", f"model.layers.{2 + i}."): t.clone() for name, t in tensors.items()
           for i in range(3) if name.startswith("model.layers.1.")}
    save_file({**tensors, **mtp}, file, metadata={"format": "pt"})
    with caplog.at_level(logging.INFO, logger="radixserve.models.minimax_m2"):
        assert ours(path) == want
    assert any("skipped" in r.message and "multi-token-prediction" in r.message for r in caplog.records)
    _edit_config(path, use_routing_bias=False)
    with pytest.raises(ValueError, match="non-zero e_score_correction_bias with use_routing_bias false"):
        make_runner(path)
    zero = {n: (torch.zeros_like(t) if n.endswith("e_score_correction_bias") else t) for n, t in tensors.items()}
    save_file(zero, file, metadata={"format": "pt"})
    runner = make_runner(path)
    assert runner.model.model.layers[0].mlp.gate.e_score_correction_bias is None


def test_bad_configs_are_refused(tmp_path) -> None:  # noqa: ANN001
    """Config values transformers' MiniMax-M2 does not implement, and a rotary_dim at odds with the rope
    parameters."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.minimax_m2 import MiniMaxM2ForCausalLM

    path = str(tmp_path)
    minimax(path)
    for key, value, match in (("scoring_func", "softmax", "scoring_func 'softmax' is not supported"),
                              ("use_qk_norm", False, "use_qk_norm false"),
                              ("qk_norm_type", "per_head", "qk_norm_type 'per_head'"),
                              ("shared_intermediate_size", 64, "shared experts are not supported"),
                              ("attn_type_list", [0, 1], "lightning-attention"),
                              ("sliding_window", 4, "sliding_window is not supported"),
                              ("routed_scaling_factor", 2.0, "routed_scaling_factor 2.0"),
                              ("num_local_experts", 0, "num_local_experts > 0"),
                              ("rotary_dim", 8, "rotary_dim 8 disagrees"),
                              ("hidden_act", "gelu", "hidden_act 'gelu' is not supported")):
        cfg = ModelConfig(path).hf_config
        cfg.__dict__[key] = value  # past the config class's own type checks
        with pytest.raises(ValueError, match=match):
            MiniMaxM2ForCausalLM(cfg)


def _write_block_fp8(path: str, block: int) -> str:
    """The tiny model at `path` rewritten as MiniMax's fp8 layout (every attention projection and expert matrix
    block-wise with `weight_scale_inv`); the dequantised weights saved with the other files in `path`/deq."""
    from model_utils import rewrite_checkpoint

    from radixserve.layers.quantization.fp8 import dequantize_blocks, quantize_blocks

    def convert(name: str, t: torch.Tensor) -> tuple[dict[str, torch.Tensor], torch.Tensor] | None:
        if not name.endswith(("proj.weight", ".w1.weight", ".w2.weight", ".w3.weight")) or ".layers." not in name:
            return None
        q, s = quantize_blocks(t.float(), block, block)
        return {name: q, name[:-len("weight")] + "weight_scale_inv": s}, dequantize_blocks(q, s, block, block)

    deq_dir = rewrite_checkpoint(path, convert)
    qc = {"quant_method": "fp8", "fmt": "float8_e4m3fn", "activation_scheme": "dynamic",
          "weight_block_size": [block, block],  # the release's quantization_config, its blocks scaled down
          "modules_to_not_convert": ["gate", "e_score_correction_bias", "lm_head"]}
    _edit_config(path, quantization_config=qc)
    return deq_dir


def test_block_fp8_checkpoint_matches_its_dequantized_weights(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """As the released checkpoints: fp8 blocks as tall as a head (here 32 = head_dim) keep their q/k scales as they
    are under the per-head layout; W8A16 forced, the tokens are transformers' on the dequantised weights. Blocks
    smaller than a head would need their scales split: refused."""
    import transformers as tf

    import radixserve.layers.quantization.fp8 as fp8mod

    path = str(tmp_path / "a")
    minimax(path)
    deq_dir = _write_block_fp8(path, 32)
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    runner = make_runner(path)
    assert runner.model.model.layers[0].mlp.experts.w13_weight.dtype == fp8mod.FP8
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    assert StaticBatch(runner).generate(PROMPTS[:2], 8) == [hf_greedy(hf, p, 8) for p in PROMPTS[:2]]
    small = str(tmp_path / "b")
    minimax(small)
    _write_block_fp8(small, 16)
    with pytest.raises(ValueError, match="block-wise or packed quantized q/k"):
        make_runner(small)


def test_dummy_weights_load_and_generate(tmp_path) -> None:  # noqa: ANN001
    """--load-format dummy: every parameter drawn (the whole-width q/k norms whole, then sliced), a forward runs."""
    minimax(str(tmp_path))
    runner = make_runner(str(tmp_path), load_format="dummy")
    attn = runner.model.model.layers[0].self_attn
    assert attn.q_norm.weight.shape == (4 * 32,) and attn.k_norm.weight.shape == (2 * 32,)
    out = StaticBatch(runner).generate(PROMPTS[:2], 4)
    assert [len(o) for o in out] == [4, 4]


def test_gguf_files_are_refused(tmp_path) -> None:  # noqa: ANN001
    """transformers reads llama.cpp's MiniMax-M2 config, but no tensor map here lays out its q/k: refused by name."""
    from radixserve.configs.model_config import ModelConfig

    file = stub_gguf(str(tmp_path / "m.gguf"), "minimax-m2")
    with pytest.raises(ValueError, match="GGUF files of MiniMax-M2 are not supported"):
        ModelConfig(file)


@pytest.mark.integration
@pytest.mark.parametrize("over", [{}, {"num_key_value_heads": 1}])  # KV heads split, or replicated
def test_tp2_matches_tp1(over: dict, tmp_path) -> None:  # noqa: ANN001
    """Heads split over the ranks keep each head's layout; the q/k norms' sums of squares all-reduced; experts
    split over the ranks."""
    path = str(tmp_path)
    make_tiny_model("minimax_m2", path, seed=4, initializer_range=INIT_RANGE, **over)
    got, want = tp2_and_tp1_outputs(path, PROMPTS)
    assert got == want


def test_rotary_dim_alone_sets_the_partial_rotation() -> None:
    """A config with `rotary_dim` and no partial_rotary_factor (as transformers before 5.2x keeps MiniMax-M2's)
    rotates rotary_dim dims of each head; a stated factor that disagrees is refused."""
    from types import SimpleNamespace

    from radixserve.models.minimax_m2 import minimax_rotary

    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=2, head_dim=32, rotary_dim=16,
                          max_position_embeddings=64, rope_theta=10000.0)
    assert minimax_rotary(cfg).rotary_dim == 16
    cfg = SimpleNamespace(hidden_size=64, num_attention_heads=2, head_dim=32, rotary_dim=16, partial_rotary_factor=1.0,
                          max_position_embeddings=64, rope_theta=10000.0)
    with pytest.raises(ValueError, match="rotary_dim 16 disagrees"):
        minimax_rotary(cfg)
