"""Reading llama.cpp GGUF checkpoints as Hugging Face tensors.

Every tensor is dequantized to float32 and renamed from llama.cpp's names (`blk.3.attn_q.weight`) to Hugging
Face's (`model.layers.3.self_attn.q_proj.weight`). llama.cpp's converter reorders the rows of q_proj and k_proj of
llama-architecture models (rotary halves interleaved per head); that reordering is undone here so that the tensors
equal the original Hugging Face ones.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch

# llama.cpp per-block tensor name -> Hugging Face name inside `model.layers.N.`
_BLOCK_NAMES: dict[str, str] = {
    "attn_q": "self_attn.q_proj",
    "attn_k": "self_attn.k_proj",
    "attn_v": "self_attn.v_proj",
    "attn_output": "self_attn.o_proj",
    "attn_q_norm": "self_attn.q_norm",
    "attn_k_norm": "self_attn.k_norm",
    "attn_norm": "input_layernorm",
    "ffn_norm": "post_attention_layernorm",
    "ffn_gate": "mlp.gate_proj",
    "ffn_up": "mlp.up_proj",
    "ffn_down": "mlp.down_proj",
    # mixture-of-experts blocks (qwen2moe, qwen3moe): the router, the shared expert and its gate
    "ffn_gate_inp": "mlp.gate",
    "ffn_gate_shexp": "mlp.shared_expert.gate_proj",
    "ffn_up_shexp": "mlp.shared_expert.up_proj",
    "ffn_down_shexp": "mlp.shared_expert.down_proj",
    "ffn_gate_inp_shexp": "mlp.shared_expert_gate",
}
# The routed experts, stacked in one tensor each ([E, I, H] gate / up, [E, H, I] down): loaded one expert at a time
# under Hugging Face's per-expert names (`EXPERT` stands for the expert's number).
EXPERT = "{expert}"
_EXPERT_NAMES: dict[str, str] = {
    "ffn_gate_exps": f"mlp.experts.{EXPERT}.gate_proj",
    "ffn_up_exps": f"mlp.experts.{EXPERT}.up_proj",
    "ffn_down_exps": f"mlp.experts.{EXPERT}.down_proj",
}
# GGUF architectures with MoE blocks this loader maps (their per-layer metadata beyond transformers' config reader)
MOE_ARCHS = ("qwen2moe", "qwen3moe")
_TOP_NAMES: dict[str, str] = {
    "token_embd": "model.embed_tokens",
    "output_norm": "model.norm",
    "output": "lm_head",
}
# Tensors llama.cpp stores that Hugging Face derives from the config (Llama-3 RoPE frequency factors).
_SKIPPED = {"rope_freqs.weight", "rope_factors_long.weight", "rope_factors_short.weight"}
# Architectures whose q/k rows llama.cpp's converter permutes (Mistral is written as "llama").
_PERMUTED_ARCHS = {"llama", "mistral"}

_BLOCK_RE = re.compile(r"^blk\.(\d+)\.([a-z0-9_]+)\.(weight|bias)$")
_TOP_RE = re.compile(r"^([a-z0-9_]+)\.(weight|bias)$")


def gguf_to_hf_name(name: str) -> str | None:
    """The Hugging Face name of a llama.cpp tensor, None for tensors that have none (RoPE factors); for the stacked
    experts a template with EXPERT where each expert's number goes.

    Raises ValueError for a name it does not know."""
    if name in _SKIPPED:
        return None
    m = _BLOCK_RE.match(name)
    if m and m.group(2) in _BLOCK_NAMES:
        return f"model.layers.{m.group(1)}.{_BLOCK_NAMES[m.group(2)]}.{m.group(3)}"
    if m and m.group(2) in _EXPERT_NAMES:  # a template: EXPERT is replaced by each expert's number
        return f"model.layers.{m.group(1)}.{_EXPERT_NAMES[m.group(2)]}.{m.group(3)}"
    m = _TOP_RE.match(name)
    if m and m.group(1) in _TOP_NAMES:
        return f"{_TOP_NAMES[m.group(1)]}.{m.group(2)}"
    raise ValueError(f"unsupported GGUF tensor {name!r}")


def unpermute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """Undo llama.cpp's q/k row permutation.

    For each head, llama.cpp stores the rows as pairs (i, i + head_dim/2) interleaved; Hugging Face keeps the first
    half of the rotary dimensions, then the second half. `n_head` is the number of heads the rows belong to (the
    query heads for q_proj, the key/value heads for k_proj). Works for weights [rows, cols] and biases [rows]."""
    rows = weight.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot unpermute a tensor with {rows} rows into {n_head} heads")
    half = rows // n_head // 2
    rest = tuple(weight.shape[1:])
    return weight.reshape(n_head, half, 2, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def permute_qk(weight: torch.Tensor, n_head: int) -> torch.Tensor:
    """llama.cpp's q/k row permutation (the inverse of `unpermute_qk`), for writing test checkpoints."""
    rows = weight.shape[0]
    if n_head <= 0 or rows % (2 * n_head):
        raise ValueError(f"cannot permute a tensor with {rows} rows into {n_head} heads")
    half = rows // n_head // 2
    rest = tuple(weight.shape[1:])
    return weight.reshape(n_head, 2, half, *rest).transpose(1, 2).reshape(weight.shape).contiguous()


def open_gguf(path: str) -> Any:
    """A `gguf.GGUFReader` over the file, with a clear ValueError when the file is missing or unreadable."""
    from gguf import GGUFReader

    if not os.path.isfile(path):
        raise ValueError(f"GGUF file does not exist: {path}")
    try:
        return GGUFReader(path)
    except Exception as e:
        raise ValueError(f"cannot read GGUF file {path}: {e}") from e


def gguf_field(reader: Any, key: str, default: Any = None) -> Any:
    """The value of a GGUF metadata field (a scalar, string or list), or `default` when absent."""
    field = reader.fields.get(key)
    if field is None:
        return default
    return field.contents()


def _head_count(reader: Any, key: str, path: str) -> int | None:
    value = gguf_field(reader, key)
    if isinstance(value, list):  # per-layer counts; llama-arch models use one value for all layers
        values = set(value)
        if len(values) != 1:
            raise ValueError(f"GGUF file {path}: per-layer {key} {sorted(values)} are not supported")
        value = values.pop()
    return int(value) if value is not None else None


def count_gguf_tensors(reader: Any) -> int:
    """How many tensors `gguf_weights_iterator` yields for this reader (a stacked expert tensor: one per expert)."""
    return sum(int(t.shape.tolist()[-1]) if _is_stacked(t.name) else 1 for t in reader.tensors
               if t.name not in _SKIPPED)


def _is_stacked(name: str) -> bool:
    m = _BLOCK_RE.match(name)
    return bool(m) and m.group(2) in _EXPERT_NAMES


def patch_moe_config(config: Any, reader: Any) -> None:
    """Set what transformers' GGUF config reader leaves at its defaults for MoE architectures: each expert's
    intermediate size (`{arch}.expert_feed_forward_length`) and the shared expert's."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in MOE_ARCHS:
        return
    inter = gguf_field(reader, f"{arch}.expert_feed_forward_length")
    if inter is None:
        raise ValueError(f"GGUF {arch} file has no {arch}.expert_feed_forward_length")
    config.moe_intermediate_size = int(inter)
    shared = gguf_field(reader, f"{arch}.expert_shared_feed_forward_length")
    if shared is not None:
        config.shared_expert_intermediate_size = int(shared)


def patch_llama_experts_config(config: Any, reader: Any) -> None:
    """llama.cpp writes Mixtral as architecture "llama" (or "mistral") with experts (`{arch}.expert_count`, stacked
    `ffn_*_exps` tensors and the router `ffn_gate_inp`); transformers' GGUF reader gives a dense LlamaConfig and
    drops the expert counts. Name the Mixtral class and set them."""
    arch = gguf_field(reader, "general.architecture")
    if arch not in _PERMUTED_ARCHS:
        return
    experts = gguf_field(reader, f"{arch}.expert_count")
    if not experts:
        return
    used = gguf_field(reader, f"{arch}.expert_used_count")
    if not used or not 1 <= int(used) <= int(experts):
        raise ValueError(f"GGUF {arch} file with {experts} experts needs {arch}.expert_used_count in 1..{experts}, "
                         f"got {used}")
    config.num_local_experts = int(experts)
    config.num_experts_per_tok = int(used)
    inter = gguf_field(reader, f"{arch}.expert_feed_forward_length")
    if inter:
        config.intermediate_size = int(inter)
    config.architectures = ["MixtralForCausalLM"]


def _gguf_number(reader: Any, key: str) -> float | None:
    value = gguf_field(reader, key)
    if value is None:
        return None
    if isinstance(value, bool) or not isinstance(value, int | float):
        raise ValueError(f"GGUF field {key} must be a number, got {value!r}")
    return float(value)


def gguf_rope_scaling(reader: Any) -> dict[str, Any] | None:
    """The RoPE scaling llama.cpp's converter keeps in a GGUF file, as a Hugging Face `rope_scaling` dict, or None
    for plain RoPE. transformers' GGUF config reader drops it, so a Llama 3.x file would otherwise be served with
    unscaled frequencies. Sources: the `rope_freqs.weight` tensor (Llama 3.x: one divisor per frequency, llama.cpp's
    form of the `llama3` scaling) and the `{arch}.rope.scaling.*` metadata (linear, yarn). Raises ValueError for a
    scaling this loader cannot reproduce."""
    from gguf.quants import dequantize

    from radixserve.layers.rotary_embedding import FREQ_FACTORS

    arch = gguf_field(reader, "general.architecture")
    scaling: dict[str, Any] | None = None
    freqs = next((t for t in reader.tensors if t.name == "rope_freqs.weight"), None)
    if freqs is not None:
        factors = np.asarray(dequantize(freqs.data, freqs.tensor_type), dtype=np.float32).reshape(-1)
        scaling = {"rope_type": FREQ_FACTORS, "freq_factors": [float(f) for f in factors]}
    kind = gguf_field(reader, f"{arch}.rope.scaling.type")
    if kind in (None, "", "none"):
        return scaling
    if scaling is not None:
        raise ValueError(f"GGUF file has both a rope_freqs tensor and {arch}.rope.scaling.type {kind!r}")
    factor = _gguf_number(reader, f"{arch}.rope.scaling.factor")
    if factor is None or factor <= 0:
        raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} needs a positive {arch}.rope.scaling.factor, "
                         f"got {factor}")
    if kind == "linear":
        return {"rope_type": "linear", "factor": factor}
    if kind != "yarn":
        raise ValueError(f"GGUF {arch}.rope.scaling.type {kind!r} is not supported (supported: linear, yarn)")
    orig = _gguf_number(reader, f"{arch}.rope.scaling.original_context_length")
    if orig is None or orig <= 0:
        raise ValueError(f"GGUF yarn RoPE scaling needs {arch}.rope.scaling.original_context_length")
    for key, neutral in (("attn_factor", 1.0), ("yarn_attn_factor", 1.0), ("yarn_ext_factor", 1.0),
                         ("yarn_log_multiplier", 0.0)):  # llama.cpp's knobs beyond Hugging Face's yarn
        value = _gguf_number(reader, f"{arch}.rope.scaling.{key}")
        if value is not None and value != neutral:
            raise ValueError(f"GGUF {arch}.rope.scaling.{key} = {value} is not supported")
    scaling = {"rope_type": "yarn", "factor": factor, "original_max_position_embeddings": int(orig)}
    for key, hf_key in (("yarn_beta_fast", "beta_fast"), ("yarn_beta_slow", "beta_slow")):
        value = _gguf_number(reader, f"{arch}.rope.scaling.{key}")
        if value is not None:
            scaling[hf_key] = value
    return scaling


def patch_rope_config(config: Any, reader: Any) -> None:
    """Set the GGUF file's RoPE scaling (`gguf_rope_scaling`) on the config transformers read from it."""
    scaling = gguf_rope_scaling(reader)
    if scaling is None:
        return
    params = getattr(config, "rope_parameters", None)
    if isinstance(params, dict):  # transformers 5: one dict with rope_theta (setting rope_scaling would drop it)
        config.rope_parameters = {**{k: v for k, v in params.items() if k in ("rope_theta", "partial_rotary_factor")},
                                  **scaling}
    else:
        config.rope_scaling = scaling


def gguf_weights_iterator(path: str, reader: Any = None,
                          packed: set[str] | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(Hugging Face name, float32 cpu tensor) for every weight of a GGUF file, q/k rows restored to HF order.

    A weight named in `packed` (Q8_0 / Q4_K, kept quantized by `layers.quantization.gguf`) comes as its packed
    fields instead, each under the weight's name with `weight` replaced by the field (`...q_proj.qweight`,
    `...q_proj.d`, ...)."""
    from gguf.quants import dequantize

    from radixserve.layers.quantization import gguf_formats

    if reader is None:
        reader = open_gguf(path)
    arch = gguf_field(reader, "general.architecture")
    if not isinstance(arch, str):
        raise ValueError(f"GGUF file {path} has no general.architecture")
    n_head = _head_count(reader, f"{arch}.attention.head_count", path)
    n_head_kv = _head_count(reader, f"{arch}.attention.head_count_kv", path) or n_head
    permuted = arch in _PERMUTED_ARCHS
    if permuted and n_head is None:
        raise ValueError(f"GGUF file {path} has no {arch}.attention.head_count")

    for t in reader.tensors:
        try:
            hf_name = gguf_to_hf_name(t.name)
        except ValueError as e:
            raise ValueError(f"GGUF file {path}: {e}") from e
        if hf_name is None:
            continue
        shape = tuple(int(d) for d in reversed(t.shape.tolist()))  # GGUF lists dimensions innermost first
        if EXPERT in hf_name:  # stacked experts: dequantised (the experts' layers are not packed), one at a time
            try:
                array = dequantize(t.data, t.tensor_type)
            except NotImplementedError as e:
                raise ValueError(f"GGUF file {path}: tensor {t.name} has unsupported type {t.tensor_type.name}") \
                    from e
            array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
            if not array.flags.writeable:  # an unquantized tensor is a view of the read-only memory map
                array = array.copy()
            stacked = torch.from_numpy(array)
            for e in range(shape[0]):
                yield hf_name.replace(EXPERT, str(e)), stacked[e]
            continue
        if packed and hf_name in packed:
            n, k = shape
            raw = torch.from_numpy(np.ascontiguousarray(t.data).reshape(n, -1).copy())
            fields = gguf_formats.from_ggml_bytes(t.tensor_type.name, raw, n, k)
            heads = n_head if ".self_attn.q_proj." in hf_name else n_head_kv
            for field, value in fields.items():
                if permuted and (".self_attn.q_proj." in hf_name or ".self_attn.k_proj." in hf_name):
                    value = unpermute_qk(value, heads)
                yield hf_name[: -len("weight")] + field, value
            continue
        try:
            array = dequantize(t.data, t.tensor_type)
        except NotImplementedError as e:
            raise ValueError(f"GGUF file {path}: tensor {t.name} has unsupported type {t.tensor_type.name}") from e
        array = np.ascontiguousarray(array, dtype=np.float32).reshape(shape)
        if not array.flags.writeable:  # an unquantized tensor is a view of the read-only memory map
            array = array.copy()
        tensor = torch.from_numpy(array)
        if permuted and ".self_attn.q_proj." in hf_name:
            tensor = unpermute_qk(tensor, n_head)
        elif permuted and ".self_attn.k_proj." in hf_name:
            tensor = unpermute_qk(tensor, n_head_kv)
        yield hf_name, tensor
