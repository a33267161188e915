"""Write a Llama-family model (or a Qwen2-MoE / Qwen3-MoE one) as a llama.cpp GGUF file with the `gguf` package:
llama.cpp's tensor names (the routed experts stacked one tensor per matrix) and q/k row order, the architecture
metadata our loader and transformers read, and chosen weights quantized (`gguf_formats.quantize_to_ggml`: gguf's
own quantisers, ours for Q4_K). Used to make the embedded model's own Q8_0 / Q4_K files for
`benchmarks/bench_quality.py` and the MoE files of the tests."""

from __future__ import annotations

import re
from collections.abc import Callable

import numpy as np
import torch

from radixserve.model_loader.gguf_loader import _BLOCK_NAMES, _EXPERT_NAMES, _TOP_NAMES, EXPERT, permute_qk

_HF_BLOCK = {hf: gg for gg, hf in _BLOCK_NAMES.items()}
_HF_TOP = {hf: gg for gg, hf in _TOP_NAMES.items()}
_HF_EXPERT = {hf.replace(f".{EXPERT}.", "."): gg for gg, hf in _EXPERT_NAMES.items()}  # mlp.experts.gate_proj
_EXPERT_RE = re.compile(r"^model\.layers\.(\d+)\.mlp\.experts\.(\d+)\.(gate_proj|up_proj|down_proj)\.weight$")


def hf_to_gguf_name(name: str) -> str:
    stem, kind = name.rsplit(".", 1)
    if stem in _HF_TOP:
        return f"{_HF_TOP[stem]}.{kind}"
    parts = stem.split(".", 3)  # model, layers, N, rest
    table = _HF_EXPERT if len(parts) == 4 and parts[3] in _HF_EXPERT else _HF_BLOCK
    if len(parts) != 4 or parts[3] not in table:
        raise ValueError(f"no GGUF name for {name!r}")
    return f"blk.{parts[2]}.{table[parts[3]]}.{kind}"


def _stack_experts(tensors: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF per-expert weights stacked as llama.cpp holds them (`blk.N.ffn_gate_exps.weight` [E, I, H]), under names
    `model.layers.N.mlp.experts.gate_proj.weight`; the other tensors as they are."""
    out: dict[str, torch.Tensor] = {}
    groups: dict[str, dict[int, torch.Tensor]] = {}
    for name, t in tensors.items():
        m = _EXPERT_RE.match(name)
        if m is None:
            out[name] = t
        else:
            groups.setdefault(f"model.layers.{m.group(1)}.mlp.experts.{m.group(3)}.weight", {})[int(m.group(2))] = t
    for name, parts in groups.items():
        out[name] = torch.stack([parts[e] for e in range(len(parts))])
    return out


def write_llama_gguf(path: str, tensors: dict[str, torch.Tensor], config: object,
                     qtype_of: Callable[[str, tuple[int, ...]], str | None], arch: str = "llama") -> dict[str, str]:
    """Write `tensors` (HF names, float) of `config` to `path` as GGUF architecture `arch` ("llama", or "qwen2moe" /
    "qwen3moe" for those MoE models, whose experts are written stacked); `qtype_of(name, shape)` gives a GGML type
    name to quantize a tensor to (for stacked experts the name `...mlp.experts.gate_proj.weight` and the [E, N, K]
    shape), or None to keep it float32. Returns name -> type written."""
    import gguf

    if arch not in ("llama", "qwen2moe", "qwen3moe"):
        raise ValueError(f"cannot write GGUF architecture {arch!r}")
    heads, kv_heads = config.num_attention_heads, config.num_key_value_heads
    w = gguf.GGUFWriter(path, arch)
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
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w.add_rope_dimension_count(head_dim)
    if arch != "llama":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        tensors = _stack_experts(tensors)
    w.add_file_type(0)
    written = {}
    for name, t in tensors.items():
        t = t.float()
        if arch == "llama" and name.endswith("self_attn.q_proj.weight"):
            t = permute_qk(t, heads)
        elif arch == "llama" and name.endswith("self_attn.k_proj.weight"):
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
