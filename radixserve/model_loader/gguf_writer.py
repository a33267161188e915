"""Write a Llama-family model as a llama.cpp GGUF file with the `gguf` package: llama.cpp's tensor names and q/k
row order, the architecture metadata our loader and transformers read, and chosen linear weights quantized
(`gguf_formats.quantize_to_ggml`: gguf's own quantisers, ours for Q4_K). Used to make the embedded model's own
Q8_0 / Q4_K files for `benchmarks/bench_quality.py`."""

from __future__ import annotations

from collections.abc import Callable

import numpy as np
import torch

from radixserve.model_loader.gguf_loader import _BLOCK_NAMES, _TOP_NAMES, permute_qk

_HF_BLOCK = {hf: gg for gg, hf in _BLOCK_NAMES.items()}
_HF_TOP = {hf: gg for gg, hf in _TOP_NAMES.items()}


def hf_to_gguf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem in _HF_TOP:
        return f"{_HF_TOP[stem]}.{kind}"
    parts = stem.split(".", 3)  # model, layers, N, rest
    if len(parts) != 4 or parts[3] not in _HF_BLOCK:
        raise ValueError(f"no GGUF name for {name!r}")
    return f"blk.{parts[2]}.{_HF_BLOCK[parts[3]]}.{kind}"


def write_llama_gguf(path: str, tensors: dict[str, torch.Tensor], config: object,
                     qtype_of: Callable[[str, tuple[int, ...]], str | None]) -> dict[str, str]:
    """Write `tensors` (HF names, float) of a Llama-architecture `config` to `path`; `qtype_of(name, shape)` gives
    a GGML type name to quantize a tensor to, or None to keep it float32. Returns name -> type written."""
    import gguf

    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    w = gguf.GGUFWriter(path, "llama")
    w.add_name("radixserve-requantized")
    w.add_block_count(config.num_hidden_layers)
    w.add_context_length(config.max_position_embeddings)
    w.add_embedding_length(config.hidden_size)
    w.add_feed_forward_length(config.intermediate_size)
    w.add_head_count(heads)
    w.add_head_count_kv(kv_heads)
    from radixserve.models.llama import rope_params

    theta, scaling = rope_params(config)
    if scaling and scaling.get("rope_type", scaling.get("type", "default")) != "default":
        raise ValueError("writing rope scaling to GGUF is not supported")
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(config.vocab_size)
    w.add_rope_dimension_count(config.hidden_size // heads)
    w.add_file_type(0)
    written = {}
    for name, t in tensors.items():
        t = t.float()
        if name.endswith("self_attn.q_proj.weight"):
            t = permute_qk(t, heads)
        elif name.endswith("self_attn.k_proj.weight"):
            t = permute_qk(t, kv_heads)
        array = np.ascontiguousarray(t.numpy().astype(np.float32))
        qtype = qtype_of(name, tuple(t.shape))
        if qtype is None:
            w.add_tensor(hf_to_gguf_name(name), array)
            written[name] = "F32"
        else:
            from radixserve.layers.quantization.gguf_formats import quantize_to_ggml

            w.add_tensor(hf_to_gguf_name(name), quantize_to_ggml(array, qtype),
                         raw_dtype=gguf.GGMLQuantizationType[qtype])
            written[name] = qtype
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
