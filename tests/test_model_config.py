"""ModelConfig from Hugging Face folders, GGUF files and the embedded model."""

from __future__ import annotations

import json
import logging
import os

import pytest
import torch
from transformers import GenerationConfig, LlamaConfig, Qwen2Config, Qwen3Config

from radixserve.configs.model_config import ModelConfig

LLAMA3_SCALING = {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                  "original_max_position_embeddings": 8192}


def _tiny_llama(**kw: object) -> LlamaConfig:
    args = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=256, max_position_embeddings=512)
    args.update(kw)
    return LlamaConfig(**args)


def test_llama_folder(tmp_path: os.PathLike) -> None:
    cfg = _tiny_llama(eos_token_id=[5, 6], dtype="bfloat16", architectures=["LlamaForCausalLM"])
    cfg.save_pretrained(tmp_path)
    GenerationConfig(eos_token_id=[6, 7], bos_token_id=1).save_pretrained(tmp_path)

    mc = ModelConfig(str(tmp_path))
    assert mc.model_path == str(tmp_path)
    assert mc.tokenizer_path == str(tmp_path)
    assert not mc.is_gguf
    assert mc.load_format == "safetensors"
    assert mc.architectures == ["LlamaForCausalLM"]
    assert (mc.hidden_size, mc.num_hidden_layers, mc.vocab_size) == (64, 2, 256)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (4, 2, 16)
    assert mc.context_len == 512
    assert mc.tie_word_embeddings is False
    assert mc.torch_dtype == torch.bfloat16
    assert mc.eos_token_ids == {5, 6, 7}
    assert mc.rope_theta == 10000.0 and mc.rope_scaling is None
    assert mc.hf_config.model_type == "llama"


def test_qwen2_folder_tied_and_default_dtype(tmp_path: os.PathLike) -> None:
    cfg = Qwen2Config(hidden_size=96, intermediate_size=128, num_hidden_layers=2, num_attention_heads=6,
                      num_key_value_heads=2, vocab_size=300, max_position_embeddings=1024, tie_word_embeddings=True,
                      eos_token_id=11, rope_theta=1e6, architectures=["Qwen2ForCausalLM"])
    cfg.save_pretrained(tmp_path)
    mc = ModelConfig(str(tmp_path))
    assert mc.architectures == ["Qwen2ForCausalLM"]
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (6, 2, 16)
    assert mc.tie_word_embeddings is True
    assert mc.torch_dtype == torch.float32  # nothing in the config: float32
    assert mc.eos_token_ids == {11}
    assert mc.rope_theta == 1e6
    assert mc.context_len == 1024


def test_explicit_head_dim(tmp_path: os.PathLike) -> None:
    # Qwen3-style: head_dim is not hidden / heads
    Qwen3Config(hidden_size=64, intermediate_size=128, num_hidden_layers=1, num_attention_heads=4,
                num_key_value_heads=1, head_dim=32, vocab_size=100,
                architectures=["Qwen3ForCausalLM"]).save_pretrained(tmp_path)
    mc = ModelConfig(str(tmp_path))
    assert (mc.head_dim, mc.num_key_value_heads) == (32, 1)


def test_llama3_rope_scaling(tmp_path: os.PathLike) -> None:
    _tiny_llama(rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING), max_position_embeddings=131072,
                architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    mc = ModelConfig(str(tmp_path))
    assert mc.rope_theta == 500000.0
    assert mc.rope_scaling is not None
    for key, value in LLAMA3_SCALING.items():
        assert mc.rope_scaling[key] == value
    assert mc.context_len == 131072


def test_llama3_rope_scaling_legacy_keys(tmp_path: os.PathLike) -> None:
    """A config.json as Llama-3.1 ships it (flat rope_theta + rope_scaling, torch_dtype)."""
    _tiny_llama(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    path = os.path.join(tmp_path, "config.json")
    with open(path) as f:
        data = json.load(f)
    data.pop("rope_parameters", None)
    data.pop("dtype", None)
    data.update(rope_theta=500000.0, rope_scaling=dict(LLAMA3_SCALING), torch_dtype="bfloat16",
                max_position_embeddings=131072)
    with open(path, "w") as f:
        json.dump(data, f)
    mc = ModelConfig(str(tmp_path))
    assert mc.rope_theta == 500000.0
    assert mc.rope_scaling is not None and mc.rope_scaling["rope_type"] == "llama3"
    assert mc.rope_scaling["factor"] == 8.0
    assert mc.torch_dtype == torch.bfloat16


def test_context_length_override(tmp_path: os.PathLike, caplog: pytest.LogCaptureFixture) -> None:
    _tiny_llama(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with caplog.at_level(logging.WARNING):
        assert ModelConfig(str(tmp_path), context_length=128).context_len == 128
    assert not caplog.records
    with caplog.at_level(logging.WARNING):
        assert ModelConfig(str(tmp_path), context_length=4096).context_len == 4096
    assert any("4096" in r.getMessage() and "512" in r.getMessage() for r in caplog.records)
    with pytest.raises(ValueError, match="context_length"):
        ModelConfig(str(tmp_path), context_length=0)


def test_missing_folder(tmp_path: os.PathLike) -> None:
    missing = os.path.join(tmp_path, "nope")
    with pytest.raises(ValueError, match="does not exist") as e:
        ModelConfig(missing)
    assert missing in str(e.value)


def test_folder_without_config(tmp_path: os.PathLike) -> None:
    with pytest.raises(ValueError, match="no config.json"):
        ModelConfig(str(tmp_path))


def test_unreadable_config(tmp_path: os.PathLike) -> None:
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        f.write("{not json")
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig(str(tmp_path))


def test_unknown_model_type(tmp_path: os.PathLike) -> None:
    with open(os.path.join(tmp_path, "config.json"), "w") as f:
        json.dump({"model_type": "definitely-not-a-model", "hidden_size": 8}, f)
    with pytest.raises(ValueError, match="config.json"):
        ModelConfig(str(tmp_path))


def test_not_a_gguf_file(tmp_path: os.PathLike) -> None:
    path = os.path.join(tmp_path, "weights.bin")
    with open(path, "wb") as f:
        f.write(b"\0" * 16)
    with pytest.raises(ValueError, match="not a .gguf"):
        ModelConfig(path)


def test_corrupt_gguf_file(tmp_path: os.PathLike) -> None:
    path = os.path.join(tmp_path, "broken.gguf")
    with open(path, "wb") as f:
        f.write(b"GGUF" + b"\x03" * 20)
    with pytest.raises(ValueError, match="broken.gguf"):
        ModelConfig(path)


def test_bad_arguments(tmp_path: os.PathLike) -> None:
    _tiny_llama(architectures=["LlamaForCausalLM"]).save_pretrained(tmp_path)
    with pytest.raises(ValueError, match="load_format"):
        ModelConfig(str(tmp_path), load_format="pickle")
    with pytest.raises(ValueError, match="dtype"):
        ModelConfig(str(tmp_path), dtype="int8")
    with pytest.raises(ValueError, match="gguf"):
        ModelConfig(str(tmp_path), load_format="gguf")
    assert ModelConfig(str(tmp_path), load_format="dummy").load_format == "dummy"


def test_gguf_file(tmp_path: os.PathLike, gguf_writer, tiny_llama_tensors) -> None:
    path = os.path.join(tmp_path, "tiny.gguf")
    gguf_writer(path, tiny_llama_tensors(tied=True))
    mc = ModelConfig(path)
    assert mc.is_gguf and mc.model_path == path and mc.load_format == "gguf"
    assert mc.architectures == ["LlamaForCausalLM"]  # GGUF metadata names no class; derived from model_type
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (4, 2, 16)
    assert mc.context_len == 256
    assert mc.tie_word_embeddings is True  # no output.weight in the file
    assert mc.torch_dtype == torch.float32
    with pytest.raises(ValueError, match="safetensors"):
        ModelConfig(path, load_format="safetensors")
    # a folder holding exactly one GGUF and no config.json resolves to that file
    assert ModelConfig(str(tmp_path)).model_path == path


def test_embedded_model_config(embedded_model_path: str) -> None:
    mc = ModelConfig(None)
    assert mc.model_path == embedded_model_path and not mc.is_gguf
    assert mc.architectures == ["LlamaForCausalLM"]
    assert (mc.hidden_size, mc.num_hidden_layers, mc.vocab_size) == (576, 30, 49152)
    assert (mc.num_attention_heads, mc.num_key_value_heads, mc.head_dim) == (9, 3, 64)
    assert mc.context_len == 8192
    assert mc.tie_word_embeddings is True
    assert mc.rope_theta == 100000.0 and mc.rope_scaling is None
    assert mc.eos_token_ids == {2}
    assert mc.torch_dtype == torch.float32


@pytest.mark.parametrize("shape,billions", [("gemma-2-9b", 9.24), ("gemma-3-12b", 11.77), ("phi-4", 14.66),
                                            ("qwen2.5-vl-7b", 7.62),  # its language model: 7,615,616,512
                                            ("gpt-oss-20b", 20.91), ("glm-4.5-air", 106.85),  # no MTP layer
                                            # 29,943,393,920 (3.90B a token: 4 of 64 experts), no MTP layer
                                            ("glm-4.7-flash", 29.94),
                                            ("olmo-2-7b", 7.30),  # 7,298,617,344
                                            ("command-r7b", 8.03),  # 8,028,033,024, the tied embedding once
                                            ("ernie-4.5-21b-a3b", 21.83),  # 21,825,437,888: no MTP layer
                                            ("llama-4-scout-17b-16e", 107.77),  # text: 107,769,861,120
                                            # 228,689,764,864: the release's 228,703,644,928 less its 13,880,064
                                            # fp8 block scales; no MTP module
                                            ("minimax-m2", 228.69),
                                            ("seed-oss-36b", 36.15),  # 36,151,104,512
                                            ("exaone-4.0-32b", 32.0),  # 32,003,216,384; 30.95B without embeddings
                                            ("granite-3.1-3b-a800m", 3.3),  # 3,298,793,472, tied embedding
                                            ("hunyuan-a13b", 80.39),  # 80,393,183,232, the tied embedding once
                                            ("phi-3.5-moe", 41.87),  # 41,873,153,344
                                            ("starcoder2-7b", 7.17),  # 7,173,923,840, the tied embedding once
                                            ("minitron-8b-base", 8.27),  # 8,271,699,968: 2.10B of it embeddings
                                            ("afm-4.5b", 4.62),  # 4,619,184,640 (the "4.5B" of its name)
                                            ("olmoe-1b-7b-0924", 6.92),  # 6,919,161,856: the 6.9B published
                                            ("dbrx-base", 131.6),  # 131,596,523,520: the 132B published
                                            ("dots.llm1.base", 142.77),  # 142,774,381,696: the 142B published
                                            ("cwm", 32.58),  # 32,581,097,472: transformers' CwmConfig defaults
                                            ("qwen3.5-9b", 8.95),  # 8,953,803,264: Qwen3_5TextConfig's defaults
                                            ("qwen3.5-35b-a3b", 34.66),  # 34,660,610,688: no MTP layer
                                            # 31,577,940,288: the 31.6B published for Nemotron 3 Nano 30B-A3B
                                            ("nemotron-3-nano-30b-a3b", 31.58)])
def test_family_shapes_build_with_the_released_sizes(shape: str, billions: float) -> None:
    """configs/shapes for dummy-weight GPU runs: each builds (on the meta device) with its release's parameter count
    (Gemma 3 12B and Llama 4 Scout without their vision towers: Scout's 108.64 B with it is the 109 B published;
    Hunyuan-A13B's is the 80 B published, Phi-3.5-MoE's the 41.9 B)."""
    from radixserve.models.registry import get_model_class

    cfg = ModelConfig(os.path.join(os.path.dirname(__file__), "..", "radixserve", "configs", "shapes", shape),
                      load_format="dummy")
    with torch.device("meta"):
        model = get_model_class(cfg.architectures)(cfg.hf_config)
    assert round(sum(p.numel() for p in model.parameters()) / 1e9, 2) == billions
