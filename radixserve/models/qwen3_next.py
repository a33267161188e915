"""The hybrid Qwen models: Qwen3-Next (`Qwen3NextForCausalLM`), Qwen3.5 dense and MoE (`Qwen3_5ForCausalLM`,
`Qwen3_5MoeForCausalLM`, and their `...ForConditionalGeneration` checkpoints served as text).

`layer_types` mixes Gated DeltaNet layers ("linear_attention", `layers/linear_attention.py`: a recurrent state per
request) with gated full-attention layers (three in four, one in four in the released models). The full-attention
layers are Qwen3's with three differences: q_proj yields each head's query and an output gate (the attention output
is multiplied by its sigmoid before o_proj), the rotation covers `partial_rotary_factor` of the head (q/k rows laid
out at load for our kernels: `glm4.rotary_order`), and every RMSNorm but the DeltaNet's scales by 1 + weight (1 added
at load). Only these layers hold KV: they take attention layer ids 0, 1, .. (`ModelConfig.kv_layer_count`).
Feed-forward blocks are Qwen2-MoE's (softmax top-k, a sigmoid-gated shared expert; Qwen3-Next's layers and
renormalisation as its config says, Qwen3.5-MoE's every layer and always renormalised, as transformers) or dense.

Serving constraints (`configs/hybrid.py` sets or refuses them at start): no prefix cache (a cached prefix's KV does
not bring the recurrent state at its end), no prefill / piecewise CUDA graphs (extend runs the DeltaNet request by
request), no speculative decoding, LoRA, torch.compile or double sparsity. Decode CUDA graphs work."""

from __future__ import annotations

import re
from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.configs.hybrid import linear_attention_layers
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import QKVParallelLinear
from radixserve.layers.linear_attention import GatedDeltaNet
from radixserve.layers.rotary_embedding import RotaryEmbedding
from radixserve.models.glm4 import rotary_order
from radixserve.models.llama import LlamaAttention, LlamaMLP, input_embedding, load_plain, model_rotary
from radixserve.models.multimodal_text import TextOfMultimodal
from radixserve.models.qwen2_moe import MoECausalLM, SparseMoeBlock, qwen2_moe_mlp
from radixserve.models.recurrent_state import RecurrentStates

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

_LAYER = re.compile(r"^model\.layers\.(\d+)\.")
_QKV = re.compile(r"\.self_attn\.[qkv]_proj\.")
# RMSNorms stored as (weight - 1): 1 is added at load (the DeltaNet's gated norm is a plain one)
_PLUS_ONE = (".input_layernorm.weight", ".post_attention_layernorm.weight", ".q_norm.weight", ".k_norm.weight")


class GatedAttention(LlamaAttention):
    """Qwen3-Next's full attention: q_proj gives each head [query; gate]; out = o_proj(attn * sigmoid(gate))."""

    def __init__(self, config: PretrainedConfig, kv_layer_id: int, tp_rank: int, tp_size: int,
                 rotary: RotaryEmbedding) -> None:
        bias = bool(getattr(config, "attention_bias", False))
        super().__init__(config, kv_layer_id, tp_rank, tp_size, rotary, qkv_bias=bias, qk_norm=True)
        kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
        # the query rows twice over: each head's query then its gate (the checkpoint's order, sharded by heads)
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, 2 * config.num_attention_heads,
                                          kv_heads, bias, tp_rank, tp_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch,
                qkv: torch.Tensor | None = None) -> torch.Tensor:
        qkv = self.qkv_proj(hidden) if qkv is None else qkv
        q_gate, k, v = qkv.split([2 * self.q_size, self.kv_size, self.kv_size], dim=-1)
        q_gate = q_gate.reshape(-1, self.num_heads, 2 * self.head_dim)
        q = q_gate[..., :self.head_dim].reshape(-1, self.q_size)
        gate = q_gate[..., self.head_dim:].reshape(-1, self.q_size)
        out = self.attend(positions, q, k, v, forward_batch)
        return self._out(out * torch.sigmoid(gate))


class HybridDecoderLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, layer_id: int, kv_layer_id: int | None, tp_rank: int,
                 tp_size: int, rotary: RotaryEmbedding) -> None:
        super().__init__()
        if kv_layer_id is None:
            self.linear_attn = GatedDeltaNet(config, tp_rank, tp_size)
        else:
            self.self_attn = GatedAttention(config, kv_layer_id, tp_rank, tp_size, rotary)
        if getattr(config, "num_experts", 0) and not str(config.model_type).startswith("qwen3_next"):
            # Qwen3.5-MoE: every layer sparse, the top-k weights always renormalised (its config has no flags)
            self.mlp = SparseMoeBlock(config, tp_rank, tp_size, renormalize=True,
                                      shared_size=config.shared_expert_intermediate_size, shared_gate=True)
        elif getattr(config, "num_experts", 0):
            self.mlp = qwen2_moe_mlp(config, layer_id, tp_rank, tp_size)
        else:
            self.mlp = LlamaMLP(config.hidden_size, config.intermediate_size, False, tp_rank, tp_size)
        self.input_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        if residual is None:
            residual, hidden = hidden, self.input_layernorm(hidden)
        else:
            hidden, residual = self.input_layernorm(hidden, residual)
        if hasattr(self, "linear_attn"):
            hidden = self.linear_attn(hidden, forward_batch)
        else:
            hidden = self.self_attn(positions, hidden, forward_batch)
        forward_norm = getattr(self.mlp, "forward_norm", None)
        if forward_norm is not None:  # MoE: the norm in the router's launch for a few tokens
            return forward_norm(hidden, residual, self.post_attention_layernorm)
        hidden, residual = self.post_attention_layernorm(hidden, residual)
        return self.mlp(hidden), residual


class HybridModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        rotary = model_rotary(config)
        linear = set(linear_attention_layers(config))
        kv_ids = {layer: i for i, layer in enumerate(j for j in range(config.num_hidden_layers) if j not in linear)}
        self.layers = nn.ModuleList(HybridDecoderLayer(config, i, kv_ids.get(i), tp_rank, tp_size, rotary)
                                    for i in range(config.num_hidden_layers))
        self.norm = RMSNorm(config.hidden_size, config.rms_norm_eps)

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def delta_nets(self) -> list[GatedDeltaNet]:
        return [layer.linear_attn for layer in self.layers if hasattr(layer, "linear_attn")]


class Qwen3NextForCausalLM(RecurrentStates, MoECausalLM):
    partial_rotary = True  # q/k laid out at load (`_laid_out`)

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        attn = next((layer.self_attn for layer in self.model.layers if hasattr(layer, "self_attn")), None)
        self.head_dim = attn.head_dim if attn is not None else 0
        self.dim_order = None if attn is None else \
            rotary_order(attn.rotary_emb.head_dim, attn.rotary_emb.rotary_dim, interleaved=False)
        self._qkv_blocks: tuple[int, int] | None = None  # block-wise fp8 q/k/v dequantised at load (their block)
        self._qkv_pending: dict[str, dict[str, torch.Tensor]] = {}

    def kept_unquantized(self, config: object) -> tuple[str, ...]:
        """With block-wise fp8 checkpoints the attention's q/k/v stay in 16 bits: the partial rotation's layout moves
        q/k rows across blocks (dims 32..63 of a 256-dim head land at 128..159), which block scales cannot follow,
        so each matrix is dequantised at load (`load_weight`) and laid out then."""
        block = getattr(config, "weight_block_size", None)
        if not block or not getattr(config, "serialized", False) or self.dim_order is None:
            return ()
        self._qkv_blocks = (int(block[0]), int(block[1]))
        return ("self_attn.qkv_proj",)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return HybridModel(config, tp_rank, tp_size)

    def state_layers(self) -> list:  # (RecurrentStates: what ModelRunner sizes and allocates)
        return self.model.delta_nets()

    # ------------------------------------------------------------------ weights
    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        n = self.config.num_hidden_layers

        def served() -> Iterable[tuple[str, torch.Tensor]]:
            for name, tensor in weights:
                m = _LAYER.match(name)
                if name.startswith("mtp.") or (m is not None and int(m.group(1)) >= n):
                    continue  # the multi-token-prediction module
                yield name, tensor

        super().load_weights(served())
        if self._qkv_pending:
            raise ValueError(f"block-wise fp8 q/k/v without their scales or weights: {sorted(self._qkv_pending)}")

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.endswith(_PLUS_ONE) or name == "model.norm.weight":
            tensor = tensor.float() + 1.0
        if ".linear_attn." in name:
            return self._load_linear(params, name, tensor)
        if ".self_attn." in name:
            if self._qkv_blocks is not None and _QKV.search(name):
                whole = self._dequantized(name, tensor)
                if whole is None:
                    return None  # its other half (weight or block scales) is still to come
                name, tensor = whole
            tensor = self._laid_out(name, tensor)
        return super().load_weight(params, name, tensor)

    def _dequantized(self, name: str, tensor: torch.Tensor) -> tuple[str, torch.Tensor] | None:
        """A block-wise fp8 q/k/v tensor: held until its weight and its block scales are both in, then the matrix
        dequantised (float32) under its weight's name."""
        from radixserve.layers.quantization.fp8 import dequantize_blocks

        module, _, leaf = name.rpartition(".")
        if leaf not in ("weight", "weight_scale_inv"):
            raise ValueError(f"{name}: a block-wise fp8 checkpoint's q/k/v carry a weight and weight_scale_inv only")
        parts = self._qkv_pending.setdefault(module, {})
        parts[leaf] = tensor
        if len(parts) < 2:
            return None
        del self._qkv_pending[module]
        return f"{module}.weight", dequantize_blocks(parts["weight"], parts["weight_scale_inv"], *self._qkv_blocks)

    def _laid_out(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """q's rows (not the gate's), k's rows and the q/k norms in the partial rotation's per-head layout."""
        order, d = self.dim_order, self.head_dim
        if order is None or not any(p in name for p in (".q_proj.", ".k_proj.", ".q_norm.", ".k_norm.")):
            return tensor
        if ".q_proj." in name:  # [heads x (query; gate), ...]: the query half of each head
            t = tensor.reshape(-1, 2, d, *tensor.shape[1:]).clone()
            t[:, 0] = t[:, 0][:, order]
            return t.reshape(tensor.shape)
        return tensor.reshape(-1, d, *tensor.shape[1:])[:, order].reshape(tensor.shape).contiguous()

    def _load_linear(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str:
        """A DeltaNet tensor: q/k/v/z's rows into in_proj_qkvz, b/a's into in_proj_ba (Qwen3.5 ships in_proj_qkv,
        _z, _b, _a; Qwen3-Next in_proj_qkvz and in_proj_ba grouped by key head), whatever the tensor is of them:
        the weight, an fp8 checkpoint's block scales (rows in blocks), per-channel scales or a scalar."""
        prefix, _, leaf = name.partition(".linear_attn.")
        net: GatedDeltaNet = self.model.layers[int(_LAYER.match(name).group(1))].linear_attn
        part, _, suffix = leaf.partition(".")
        hk, hv, dk, dv = net.hk * net.tp_size, net.hv * net.tp_size, net.dk, net.dv
        r = hv // hk
        layout = {"in_proj_qkv": ("in_proj_qkvz", [hk * dk, hk * dk, hv * dv], 0, 1),
                  "in_proj_z": ("in_proj_qkvz", [hv * dv], 3, 1),
                  "in_proj_b": ("in_proj_ba", [hv], 0, 1), "in_proj_a": ("in_proj_ba", [hv], 1, 1),
                  # Qwen3-Next: each key head's group holds [q, k, v's, z's] (and [b's, a's])
                  "in_proj_qkvz": ("in_proj_qkvz", [dk, dk, r * dv, r * dv], 0, hk),
                  "in_proj_ba": ("in_proj_ba", [r, r], 0, hk)}.get(part)
        if layout is None:
            ours = {"conv1d.weight": "conv_weight", "norm.weight": "norm_weight"}.get(leaf, leaf)
            target = f"{prefix}.linear_attn.{ours}"
            if target not in params:
                raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
            load_plain(params[target], name, tensor)
            return target
        module, sizes, first, groups = layout
        target = f"{prefix}.linear_attn.{module}.{suffix}"
        proj = params.get(target)
        if proj is None:
            raise ValueError(f"unexpected weight {name!r} for {type(self).__name__} (no {target})")
        if tensor.numel() == 1:  # a per-tensor scale: each of our matrices the tensor covers takes it
            for shard in range(first, first + len(sizes)):
                proj.weight_loader(proj, tensor.reshape(-1), shard)
            return target
        for shard, rows in enumerate(_split_rows(tensor, sizes, groups, name), start=first):
            proj.weight_loader(proj, rows, shard)
        return target


def _split_rows(tensor: torch.Tensor, sizes: list[int], groups: int, name: str) -> list[torch.Tensor]:
    """`tensor`'s rows as `groups` consecutive groups of `sizes` rows each -> one tensor a size (its rows of every
    group). The tensor may hold one row per `f` weight rows (block scales: f = the block) where every size is a
    multiple of f."""
    total = groups * sum(sizes)
    n = tensor.shape[0]
    f = total // n if n and total % n == 0 else 0
    if not f or any(s % f for s in sizes):
        raise ValueError(f"{name}: {n} rows do not cover {groups} x {sizes} rows in whole blocks")
    parts = tensor.reshape(groups, total // f // groups, *tensor.shape[1:]).split([s // f for s in sizes], dim=1)
    return [p.reshape(-1, *tensor.shape[1:]) for p in parts]


class Qwen3_5ForCausalLM(Qwen3NextForCausalLM):
    pass


class Qwen3_5MoeForCausalLM(Qwen3NextForCausalLM):
    pass


class Qwen3_5ForConditionalGeneration(TextOfMultimodal, Qwen3_5ForCausalLM):
    """Qwen3.5's image-text checkpoints served as text (`models/multimodal_text.py`)."""


class Qwen3_5MoeForConditionalGeneration(TextOfMultimodal, Qwen3_5MoeForCausalLM):
    """Qwen3.5-MoE's image-text checkpoints served as text."""
