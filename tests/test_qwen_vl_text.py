"""Qwen2-VL, Qwen2.5-VL and Qwen3-VL served as text (`models/qwen_vl.py`) against transformers in float32 on tiny
random models (2 text layers beside a vision tower of 1-2 blocks): text prompts give transformers' greedy tokens with
the multimodal RoPE (contiguous or interleaved sections) read as the 1-D rotary, a scaled (YaRN) M-RoPE too; both
checkpoint layouts (`model.layers.*` + `visual.*` under a flat config, `model.language_model.*` + `model.visual.*`
under a nested one); the scheduler with chunked prefill and the prefix cache; a LoRA adapter whose targets also
match the vision blocks serves only its language-model layers."""

from __future__ import annotations

import importlib
import json
import os
from typing import Any

import pytest
import torch
from model_utils import WAVE_PROMPTS, hf_greedy, make_runner, scheduler_waves

from radixserve.bench_one_batch import StaticBatch
from radixserve.configs.model_config import ModelConfig

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]
TEXT = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            vocab_size=256, max_position_embeddings=512, rms_norm_eps=1e-6, initializer_range=0.08)
SPECIAL = dict(image_token_id=250, video_token_id=251, vision_start_token_id=252, vision_end_token_id=253)
# (transformers class, config class, text config, vision config, tied embeddings): head_dim 16 for the Qwen2
# blocks (sections of 8 frequencies as the released 16/24/24 of 64), 32 for Qwen3-VL (interleaved over 16)
FAMILIES: dict[str, tuple[str, str, dict[str, Any], dict[str, Any], bool]] = {
    "qwen2_vl": ("Qwen2VLForConditionalGeneration", "Qwen2VLConfig",
                 {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
                 dict(depth=1, embed_dim=32, hidden_size=64, num_heads=2, mlp_ratio=2), True),
    "qwen2_5_vl": ("Qwen2_5_VLForConditionalGeneration", "Qwen2_5_VLConfig",
                   {"rope_parameters": {"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]}},
                   dict(depth=1, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                        fullatt_block_indexes=[0]), False),
    "qwen3_vl": ("Qwen3VLForConditionalGeneration", "Qwen3VLConfig",
                 {"head_dim": 32, "rope_parameters": {"rope_type": "default", "rope_theta": 10000.0,
                                                      "mrope_section": [6, 5, 5], "mrope_interleaved": True}},
                 dict(depth=2, hidden_size=32, intermediate_size=64, out_hidden_size=64, num_heads=2,
                      num_position_embeddings=16, deepstack_visual_indexes=[0]), True),
}
# Qwen2.5-VL's documented long-context setting (YaRN over the M-RoPE), scaled down to the tiny model
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "mrope_section": [2, 3, 3], "factor": 4.0,
        "original_max_position_embeddings": 32}


def qwen_vl(family: str, path: str, seed: int = 0, rope: dict[str, Any] | None = None) -> Any:
    """A tiny random checkpoint of `family` saved to `path` (transformers 5 saves Qwen2-VL / Qwen2.5-VL as the
    released files, `model.layers.*` + `visual.*`, Qwen3-VL as `model.language_model.*` + `model.visual.*`)."""
    import transformers as tf

    model_cls, config_cls, text_over, vision, tied = FAMILIES[family]
    text = {**TEXT, **text_over, **({"rope_parameters": rope} if rope else {})}
    torch.manual_seed(seed)
    cfg = getattr(tf, config_cls)(text_config=text, vision_config=vision, tie_word_embeddings=tied, **SPECIAL)
    model = getattr(tf, model_cls)(cfg).float().eval()
    with torch.no_grad():  # norms and biases away from their init, sharper attention: each term shows in the tokens
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith(".bias"):
                p.add_(torch.randn_like(p) * 0.2)
            if any(part in name for part in ("q_proj", "k_proj", "q_norm", "k_norm")):
                p.mul_(3.0)
    model.save_pretrained(path)
    return model


def engine_tokens(path: str, prompts: list[list[int]] = PROMPTS) -> list[list[int]]:
    return StaticBatch(make_runner(path)).generate(prompts, 12)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_greedy_matches_transformers(family: str, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    hf = qwen_vl(family, path)
    mc = ModelConfig(path)
    assert mc.architectures == [FAMILIES[family][0]] and mc.rope_scaling is None and mc.rope_theta == 10000.0
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert len({tuple(w) for w in want}) == len(want) and len({t for w in want for t in w}) > 12  # varied
    assert engine_tokens(path) == want


def flatten(path: str, family: str) -> None:
    """The other checkpoint layout: Qwen2-VL / Qwen2.5-VL's weights under `model.language_model.*` and
    `model.visual.*` with the config flat as the released config.json (its text keys at the top level, the M-RoPE as
    `rope_scaling: {"type": "mrope", ...}`); Qwen3-VL's as `model.layers.*` + `visual.*`."""
    from safetensors.torch import load_file, save_file

    file = os.path.join(path, "model.safetensors")
    tensors = load_file(file)
    if family == "qwen3_vl":
        renamed = {n.replace("model.language_model.", "model.").replace("model.visual.", "visual."): t
                   for n, t in tensors.items()}
    else:
        renamed = {("model." + n if n.startswith("visual.") else n.replace("model.", "model.language_model.", 1)): t
                   for n, t in tensors.items()}
        with open(os.path.join(path, "config.json")) as f:
            cfg = json.load(f)
        text = cfg.pop("text_config")
        rope = text.pop("rope_parameters")
        cfg.update(text, model_type=cfg["model_type"], rope_theta=rope.pop("rope_theta"),
                   rope_scaling={"type": "mrope", "mrope_section": rope["mrope_section"]})
        with open(os.path.join(path, "config.json"), "w") as f:
            json.dump(cfg, f)
    assert set(renamed) != set(tensors)
    save_file(renamed, file, metadata={"format": "pt"})


@pytest.mark.parametrize("family", list(FAMILIES))
def test_other_checkpoint_layout(family: str, tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path)
    hf = qwen_vl(family, path, seed=1)
    flatten(path, family)
    assert ModelConfig(path).hf_config.get_text_config().num_hidden_layers == 2
    assert engine_tokens(path) == [hf_greedy(hf, p, 12) for p in PROMPTS]


def test_scaled_mrope_and_rope_theta_matter(tmp_path) -> None:  # noqa: ANN001
    """YaRN over the M-RoPE (mrope_section kept beside it) is the 1-D YaRN rotary: transformers' tokens, which
    differ from the unscaled model's; a wrong rope_theta changes the tokens (so the tests above can fail)."""
    path = str(tmp_path / "yarn")
    hf = qwen_vl("qwen2_5_vl", path, rope=YARN)
    assert ModelConfig(path).rope_scaling["rope_type"] == "yarn"
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert engine_tokens(path) == want
    plain = str(tmp_path / "plain")
    hf_plain = qwen_vl("qwen2_5_vl", plain)  # the same weights (seed), the rotary unscaled
    want_plain = [hf_greedy(hf_plain, p, 12) for p in PROMPTS]
    assert want_plain != want and engine_tokens(plain) == want_plain
    with open(os.path.join(plain, "config.json")) as f:
        cfg = json.load(f)
    cfg["text_config"]["rope_parameters"]["rope_theta"] = 1000.0
    with open(os.path.join(plain, "config.json"), "w") as f:
        json.dump(cfg, f)
    assert engine_tokens(plain) != want_plain


@pytest.mark.parametrize("family", list(FAMILIES))
@pytest.mark.parametrize("rope", ["default", "yarn"])
def test_mrope_is_the_1d_rotary_on_text(family: str, rope: str) -> None:
    """transformers' M-RoPE tables (sections contiguous, or interleaved for Qwen3-VL; YaRN's frequencies and
    attention factor) at text positions, where the temporal, height and width components are the token's
    position, are the engine's 1-D rotary tables; at positions whose components differ, they are not."""
    import transformers as tf

    from radixserve.models.llama import model_rotary
    from radixserve.models.multimodal_text import text_config

    _, config_cls, text_over, vision, _ = FAMILIES[family]
    params = {**text_over["rope_parameters"], **({**YARN, "mrope_section": text_over["rope_parameters"]
                                                  ["mrope_section"]} if rope == "yarn" else {})}
    cfg = getattr(tf, config_cls)(text_config={**TEXT, **text_over, "rope_parameters": params},
                                  vision_config=vision, **SPECIAL)
    text = text_config(cfg)
    module = importlib.import_module(f"transformers.models.{family}.modeling_{family}")
    rotary_cls = {"qwen2_vl": "Qwen2VLRotaryEmbedding", "qwen2_5_vl": "Qwen2_5_VLRotaryEmbedding",
                  "qwen3_vl": "Qwen3VLTextRotaryEmbedding"}[family]
    hf_rotary = getattr(module, rotary_cls)(text)
    ours = model_rotary(text)
    half = ours.head_dim // 2
    positions = torch.arange(300)
    x = torch.zeros(1, dtype=torch.float32)
    cos, sin = hf_rotary(x, positions.view(1, 1, -1).expand(3, 1, -1))
    assert cos.shape[-1] == 2 * half and (ours._attention_factor != 1.0) == (rope == "yarn")
    torch.testing.assert_close(cos[0, :, :half], ours.cos_cache[:300], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(sin[0, :, :half], ours.sin_cache[:300], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(cos[0, :, half:], cos[0, :, :half])
    image = torch.stack([positions, positions // 2, positions % 7]).view(3, 1, -1)  # an image's own components
    assert not torch.allclose(hf_rotary(x, image)[0][0, :, :half], ours.cos_cache[:300], atol=1e-3)


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    """Qwen3-VL (q/k norms, interleaved M-RoPE) through the scheduler: 5-token chunks and cached prefixes."""
    hf = qwen_vl("qwen3_vl", str(tmp_path), seed=2)
    assert scheduler_waves(str(tmp_path)) == [hf_greedy(hf, p, 12) for p in WAVE_PROMPTS]


def test_lora_serves_the_language_model_layers(tmp_path) -> None:  # noqa: ANN001
    """PEFT's gate_proj / down_proj targets on Qwen2.5-VL match its vision blocks' MLPs too (`visual.blocks.N.mlp`):
    served as text, the adapter's language-model layers apply (transformers + PEFT's tokens for text input), the
    vision blocks' LoRA is skipped."""
    import transformers as tf
    from peft import LoraConfig, PeftModel, get_peft_model
    from safetensors.torch import load_file
    from test_lora import submit_lora
    from test_scheduler import drain, make_scheduler

    path, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    base = qwen_vl("qwen2_5_vl", path)
    want_base = [hf_greedy(base, p, 8) for p in PROMPTS]
    targets = ["q_proj", "v_proj", "gate_proj", "down_proj"]
    peft = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, target_modules=targets, lora_dropout=0.0))
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in peft.named_parameters():
            if "lora_" in name:
                p.copy_(torch.randn(p.shape, generator=g) * 0.15)
    peft.save_pretrained(adapter)
    assert any(".visual." in name for name in load_file(f"{adapter}/adapter_model.safetensors"))
    ref = PeftModel.from_pretrained(tf.Qwen2_5_VLForConditionalGeneration.from_pretrained(path), adapter).eval()
    want = [hf_greedy(ref, p, 8) for p in PROMPTS]
    assert want != want_base
    s = make_scheduler(path, lora_paths=[f"vl={adapter}"])
    for i, prompt in enumerate(PROMPTS):
        submit_lora(s, str(i), prompt, 8, "vl")
    res = drain(s)
    assert [res[str(i)]["ids"] for i in range(len(PROMPTS))] == want


def test_names_registry_and_raw_mrope_config() -> None:
    """The three classes are registered; the vision tower's tensors (either layout) are skipped; a config read
    without transformers' renaming (rope_scaling type "mrope") gives the plain rotary and no rope scaling."""
    from types import SimpleNamespace

    from radixserve.layers.rotary_embedding import RotaryEmbedding
    from radixserve.models.multimodal_text import text_weight_name
    from radixserve.models.registry import supported_architectures

    assert {FAMILIES[f][0] for f in FAMILIES} <= set(supported_architectures())
    for name in ("visual.blocks.0.attn.qkv.weight", "model.visual.merger.linear_fc1.weight",
                 "model.visual.deepstack_merger_list.0.norm.weight"):
        assert text_weight_name(name) is None
    assert text_weight_name("model.layers.1.self_attn.q_proj.bias") == "model.layers.1.self_attn.q_proj.bias"
    assert text_weight_name("model.language_model.embed_tokens.weight") == "model.embed_tokens.weight"
    raw = {"type": "mrope", "mrope_section": [2, 3, 3]}
    mrope, plain = RotaryEmbedding(16, 64, 10000.0, raw), RotaryEmbedding(16, 64, 10000.0)
    assert torch.equal(mrope.cos_cache, plain.cos_cache) and torch.equal(mrope.sin_cache, plain.sin_cache)
    assert ModelConfig._rope(SimpleNamespace(rope_theta=1e6, rope_scaling=raw)) == (1e6, None)
