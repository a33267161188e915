"""Phi-3, Phi-3.5, Phi-4 and Phi-4-mini (`Phi3ForCausalLM`): Llama's blocks, with the checkpoint's q/k/v stored as
one `qkv_proj` and gate/up as one `gate_up_proj` (split here into the shards the stacked layers load), LongRoPE
(`rotary_embedding._longrope`) and, for Phi-4-mini, partial rotation: q and k rows are laid out per head in
`partial_rotary_order` so the rotary kernels need nothing new."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.rotary_embedding import partial_rotary_order
from radixserve.models.llama import LlamaForCausalLM

if TYPE_CHECKING:
    from transformers import PretrainedConfig

FUSED = (".qkv_proj.", ".gate_up_proj.")


class Phi3ForCausalLM(LlamaForCausalLM):
    partial_rotary = True

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        attn = self.model.layers[0].self_attn if len(self.model.layers) else None
        self.head_dim = attn.head_dim if attn is not None else 0
        heads = config.num_attention_heads
        kv_heads = getattr(config, "num_key_value_heads", None) or heads
        self.qkv_rows = [heads * self.head_dim, kv_heads * self.head_dim, kv_heads * self.head_dim]
        rotary = attn.rotary_emb if attn is not None else None
        self.dim_order = None if rotary is None or rotary.rotary_dim == rotary.head_dim else \
            partial_rotary_order(rotary.head_dim, rotary.rotary_dim)

    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        fused = next((f for f in FUSED if f in name), None)
        if fused is None:
            return super().load_weight(params, self._check_unfused(name), self._laid_out(name, tensor))
        if not name.endswith((".weight", ".bias")) or tensor.dtype not in (torch.float32, torch.float16,
                                                                           torch.bfloat16):
            raise ValueError(f"{name}: quantized Phi-3 checkpoints (q/k/v and gate/up stored fused) are not "
                             f"supported; serve the 16-bit checkpoint (with --quantization fp8 to quantize it)")
        if fused == ".qkv_proj.":
            if tensor.shape[0] != sum(self.qkv_rows):
                raise ValueError(f"{name}: expected {sum(self.qkv_rows)} rows (q, k, v), got {tensor.shape[0]}")
            parts = zip(("q_proj", "k_proj", "v_proj"), tensor.split(self.qkv_rows), strict=True)
        else:
            if tensor.shape[0] % 2:
                raise ValueError(f"{name}: expected an even number of rows (gate, up), got {tensor.shape[0]}")
            parts = zip(("gate_proj", "up_proj"), tensor.chunk(2), strict=True)
        target = None
        for part, t in parts:
            shard_name = name.replace(fused, f".{part}.")
            target = super().load_weight(params, shard_name, self._laid_out(shard_name, t.contiguous()))
        return target

    def _check_unfused(self, name: str) -> str:
        """Unfused q/k tensors under partial rotation are laid out here too, but only whole weights and biases."""
        if self.dim_order is not None and (".q_proj." in name or ".k_proj." in name) \
                and not name.endswith((".weight", ".bias")):
            raise ValueError(f"{name}: quantized q/k tensors are not supported with partial_rotary_factor")
        return name

    def lora_b_layout(self, module: str, b: torch.Tensor) -> torch.Tensor:
        """A LoRA adapter's B [out, r] for `module` with its rows laid out as the base weight's (q and k under
        partial rotation: the delta must land on the dims the rotation expects). A B whose rows are not whole heads
        is left as it is, for the adapter's shape check to refuse."""
        if b.dim() != 2 or b.shape[0] % max(self.head_dim, 1):
            return b
        return self._laid_out(f".{module}.", b)

    def _laid_out(self, name: str, tensor: torch.Tensor) -> torch.Tensor:
        """q/k rows in partial_rotary_order within each head (weights [rows, in] and biases [rows])."""
        if self.dim_order is None or not (".q_proj." in name or ".k_proj." in name) or tensor.numel() == 1:
            return tensor
        heads = tensor.shape[0] // self.head_dim
        return tensor.reshape(heads, self.head_dim, *tensor.shape[1:])[:, self.dim_order] \
            .reshape(tensor.shape).contiguous()
