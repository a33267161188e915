"""Phi3ForCausalLM (Phi-3 / 3.5 / 4 / 4-mini) against transformers in float32 on tiny random models: q/k/v and
gate/up stored fused, a sliding window, partial rotation (`partial_rotary_factor`) and LongRoPE; through the
scheduler with chunked prefill and the prefix cache, and TP=2 over gloo."""

from __future__ import annotations

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, make_tiny_model, scheduler_waves
from parallel_utils import INIT_RANGE, SERVER_KW, reference_outputs

from radixserve.bench_one_batch import StaticBatch
from radixserve.layers.rotary_embedding import RotaryEmbedding, partial_rotary_order

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
LONGROPE = {"rope_type": "longrope", "short_factor": [1.0, 1.1, 1.2, 1.3], "long_factor": [2.0, 3.0, 4.0, 5.0]}
KINDS = {
    "window": dict(sliding_window=5),
    "partial": dict(partial_rotary_factor=0.75),  # Phi-4-mini's share
    # head_dim 16, rotary_dim 8: 4 factors; the prompts stay inside the original 128 positions (see below)
    "longrope": dict(partial_rotary_factor=0.5, original_max_position_embeddings=128, rope_scaling=LONGROPE),
}


def phi3(path: str, kind: str, seed: int = 0, **over: object) -> torch.nn.Module:
    hf = make_tiny_model("phi3", path, seed=seed, **{**KINDS[kind], **over})
    with torch.no_grad():  # sharper attention, so that positions and the window show in the tokens
        for name, p in hf.named_parameters():
            if "qkv_proj" in name:
                p.mul_(3.0)
    hf.save_pretrained(path)
    return hf


@pytest.mark.parametrize("kind,backend", [("window", "cpu"), ("partial", "cpu"), ("longrope", "cpu"),
                                          ("longrope", "torch_native")])
def test_greedy_matches_transformers(kind: str, backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = phi3(str(tmp_path), kind)
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_layout_and_window_change_the_tokens(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """The cases above could not pass with the q/k layout for partial rotation or the window left out."""
    import radixserve.models.phi3 as phi3_module

    hf = phi3(str(tmp_path), "longrope")
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    monkeypatch.setattr(phi3_module, "partial_rotary_order", lambda head_dim, rotary_dim: torch.arange(head_dim))
    assert StaticBatch(make_runner(str(tmp_path))).generate(PROMPTS, 12) != want
    hf = phi3(str(tmp_path / "w"), "window")
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    hf.config.sliding_window = 10**6
    assert [hf_greedy(hf, p, 12) for p in PROMPTS] != want


def test_longrope_turns_past_the_original_context_with_the_long_factors(tmp_path) -> None:  # noqa: ANN001
    """Positions from original_max_position_embeddings on use the long factors (transformers switches a whole
    forward to them once it passes that point: its long frequencies are what ours use there), scaled by
    sqrt(1 + ln(512 / 128) / ln(128)); the unrotated dims pass unscaled."""
    hf = phi3(str(tmp_path), "longrope")
    emb = hf.model.rotary_emb
    with torch.no_grad():
        cos_long, sin_long = emb(torch.zeros(1), torch.arange(200)[None])  # past 128: transformers goes long
        cos_short, sin_short = emb(torch.zeros(1), torch.arange(100)[None])
    ours = RotaryEmbedding(16, 512, 10000.0, {**LONGROPE, "original_max_position_embeddings": 128}, rotary_dim=8)
    torch.testing.assert_close(ours.cos_cache[:100, :4], cos_short[0, :, :4])
    torch.testing.assert_close(ours.sin_cache[:100, :4], sin_short[0, :, :4])
    torch.testing.assert_close(ours.cos_cache[128:200, :4], cos_long[0, 128:, :4])
    torch.testing.assert_close(ours.sin_cache[128:200, :4], sin_long[0, 128:, :4])
    assert bool((ours.cos_cache[:, 4:] == 1).all()) and bool((ours.sin_cache[:, 4:] == 0).all())
    assert partial_rotary_order(8, 4).tolist() == [0, 1, 4, 5, 2, 3, 6, 7]


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    """Chunks of 5 tokens and prompts sharing cached prefixes, on the window + LongRoPE + partial model."""
    hf = phi3(str(tmp_path), "longrope", sliding_window=6)
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_quantized_fused_tensors_and_unsupported_partial_rotation_are_refused(tmp_path) -> None:  # noqa: ANN001
    from radixserve.configs.model_config import ModelConfig
    from radixserve.models.llama import LlamaForCausalLM
    from radixserve.models.phi3 import Phi3ForCausalLM

    phi3(str(tmp_path), "partial")
    model = Phi3ForCausalLM(ModelConfig(str(tmp_path)).hf_config)
    params = dict(model.named_parameters())
    with pytest.raises(ValueError, match="quantized Phi-3 checkpoints"):
        model.load_weight(params, "model.layers.0.self_attn.qkv_proj.weight_scale", torch.ones(1))
    with pytest.raises(ValueError, match="quantized Phi-3 checkpoints"):
        model.load_weight(params, "model.layers.0.mlp.gate_up_proj.weight",
                          torch.zeros(256, 64, dtype=torch.float8_e4m3fn))
    with pytest.raises(ValueError, match="expected 128 rows"):
        model.load_weight(params, "model.layers.0.self_attn.qkv_proj.weight", torch.zeros(96, 64))
    with pytest.raises(ValueError, match="does not support partial_rotary_factor"):
        LlamaForCausalLM(ModelConfig(str(tmp_path)).hf_config)


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    """Heads split over the ranks keep each head's partial-rotation layout."""
    from radixserve import Engine

    path = str(tmp_path)
    make_tiny_model("phi3", path, seed=4, initializer_range=INIT_RANGE, **KINDS["longrope"])
    want = reference_outputs(path, PROMPTS, {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True})
    with Engine(model_path=path, tp_size=2, **SERVER_KW) as engine:
        got = engine.generate(input_ids=PROMPTS, sampling_params={"max_new_tokens": 12, "temperature": 0,
                                                                  "ignore_eos": True})
    assert [o["output_ids"] for o in got] == want


def test_gguf_phi3_files_are_refused(tmp_path) -> None:  # noqa: ANN001
    """llama.cpp's phi3 files keep q/k/v and gate/up fused and LongRoPE as tensors, which the GGUF loader does not
    map: a clear error instead of a model served wrong."""
    import gguf
    import numpy as np

    from radixserve.configs.model_config import ModelConfig

    path = str(tmp_path / "phi3.gguf")
    w = gguf.GGUFWriter(path, "phi3")
    w.add_block_count(1)
    w.add_context_length(64)
    w.add_embedding_length(16)
    w.add_feed_forward_length(32)
    w.add_head_count(2)
    w.add_tensor("token_embd.weight", np.zeros((8, 16), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    with pytest.raises(ValueError, match="GGUF files of Phi-3 / Phi-4"):
        ModelConfig(path)


def split_qkv_adapter(fused: str, out: str, q_rows: int, kv_rows: int) -> None:
    """A PEFT adapter of Phi-3's fused `qkv_proj` written as q/k/v adapters (A shared, B split by rows): the same
    delta, in the layout Llama-family adapters (and write_random_adapter) have."""
    import json
    from pathlib import Path

    from safetensors.torch import load_file, save_file

    tensors = {}
    for name, t in load_file(f"{fused}/adapter_model.safetensors").items():
        if ".qkv_proj." not in name:
            tensors[name] = t
            continue
        parts = [t] * 3 if ".lora_A." in name else t.split([q_rows, kv_rows, kv_rows])
        for proj, part in zip(("q_proj", "k_proj", "v_proj"), parts, strict=True):
            tensors[name.replace("qkv_proj", proj)] = part.clone()
    Path(out).mkdir(parents=True)
    save_file(tensors, f"{out}/adapter_model.safetensors")
    cfg = json.loads(Path(fused, "adapter_config.json").read_text())
    cfg["target_modules"] = ["q_proj", "k_proj", "v_proj", "o_proj"]
    Path(out, "adapter_config.json").write_text(json.dumps(cfg))


def test_q_k_lora_follows_the_partial_rotation_layout(tmp_path) -> None:  # noqa: ANN001
    """A q/k adapter's B rows are laid out as the base q/k rows (partial_rotary_order): an adapter equal to PEFT's
    fused qkv_proj one gives PEFT's tokens (the fused one itself is refused: PEFT's qkv_proj is not a target here)."""
    from lora_utils import make_adapter, peft_greedy
    from test_lora import submit_lora
    from test_scheduler import drain, make_scheduler

    path = str(tmp_path / "base")
    hf = phi3(path, "partial")
    make_adapter(path, str(tmp_path / "fused"), 4, 8, False, ["qkv_proj", "o_proj"], seed=3)
    head_dim = hf.config.hidden_size // hf.config.num_attention_heads
    split_qkv_adapter(str(tmp_path / "fused"), str(tmp_path / "split"), hf.config.num_attention_heads * head_dim,
                      hf.config.num_key_value_heads * head_dim)
    want = peft_greedy(path, str(tmp_path / "fused"), PROMPTS, 8)
    assert want != peft_greedy(path, None, PROMPTS, 8)
    s = make_scheduler(path, lora_paths=[f"split={tmp_path / 'split'}"])
    for i, prompt in enumerate(PROMPTS):
        submit_lora(s, str(i), prompt, 8, "split")
    res = drain(s)
    assert [res[str(i)]["ids"] for i in range(len(PROMPTS))] == want
