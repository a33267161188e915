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


# Mixtral's HF names -> the per-expert names the writer stacks (w1 gate, w3 up, w2 down; the router `mlp.gate`)
_MIXTRAL_RE = re.compile(r"\.block_sparse_moe\.(?:experts\.(\d+)\.(w[123])|(gate))\.")
_MIXTRAL_PART = {"w1": "gate_proj", "w3": "up_proj", "w2": "down_proj"}


def _mixtral_name(m: re.Match[str]) -> str:
    return ".mlp.gate." if m.group(3) else f".mlp.experts.{m.group(1)}.{_MIXTRAL_PART[m.group(2)]}."


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


def _write_rope_scaling(w: object, scaling: dict | None, theta: float, head_dim: int) -> np.ndarray | None:
    """RoPE scaling as llama.cpp's converter writes it: `llama3` as the per-frequency divisors of a `rope_freqs`
    tensor (returned, to be added with the weights), linear and yarn as `rope.scaling.*` metadata."""
    import gguf

    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type", "default"))
    if kind in ("default", None):
        return None
    if kind == "llama3":
        from radixserve.layers.rotary_embedding import _llama3_inv_freq

        inv_freq = 1.0 / (theta ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        return (inv_freq / _llama3_inv_freq(inv_freq, scaling)).numpy().astype(np.float32)
    if kind == "linear":
        w.add_rope_scaling_type(gguf.RopeScalingType.LINEAR)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        return None
    if kind == "yarn" and not scaling.get("attention_factor") and not scaling.get("mscale"):
        w.add_rope_scaling_type(gguf.RopeScalingType.YARN)
        w.add_rope_scaling_factor(float(scaling["factor"]))
        w.add_rope_scaling_orig_ctx_len(int(scaling["original_max_position_embeddings"]))
        for key, add in (("beta_fast", w.add_rope_scaling_yarn_beta_fast),
                         ("beta_slow", w.add_rope_scaling_yarn_beta_slow)):
            if scaling.get(key) is not None:
                add(float(scaling[key]))
        return None
    raise ValueError(f"writing rope scaling {kind!r} to GGUF is not supported")


def write_llama_gguf(path: str, tensors: dict[str, torch.Tensor], config: object,
                     qtype_of: Callable[[str, tuple[int, ...]], str | None], arch: str = "llama") -> dict[str, str]:
    """Write `tensors` (HF names, float) of `config` to `path` as GGUF architecture `arch` ("llama", Mixtral too as
    llama.cpp writes it, or "qwen2moe" / "qwen3moe" for those MoE models; experts are written stacked); RoPE scaling
    as llama.cpp's converter writes it; `qtype_of(name, shape)` gives a GGML type name to quantize a tensor to (for
    stacked experts the name `...mlp.experts.gate_proj.weight` and the [E, N, K] shape), or None to keep it float32.
    Returns name -> type written."""
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
    w.add_rope_freq_base(theta)
    w.add_layer_norm_rms_eps(float(config.rms_norm_eps))
    w.add_vocab_size(config.vocab_size)
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    w.add_rope_dimension_count(head_dim)
    rope_freqs = _write_rope_scaling(w, scaling, theta, head_dim)
    if arch != "llama":
        w.add_key_length(head_dim)
        w.add_value_length(head_dim)
        w.add_expert_count(config.num_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        w.add_expert_feed_forward_length(config.moe_intermediate_size)
        if getattr(config, "shared_expert_intermediate_size", None):
            w.add_expert_shared_feed_forward_length(config.shared_expert_intermediate_size)
        tensors = _stack_experts(tensors)
    elif getattr(config, "num_local_experts", None):  # Mixtral: llama.cpp writes it as "llama" with experts
        w.add_expert_count(config.num_local_experts)
        w.add_expert_used_count(config.num_experts_per_tok)
        tensors = _stack_experts({_MIXTRAL_RE.sub(_mixtral_name, name): t for name, t in tensors.items()})
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
    if rope_freqs is not None:
        w.add_tensor("rope_freqs.weight", rope_freqs)
        written["rope_freqs.weight"] = "F32"
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return written
