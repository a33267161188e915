"""RadixAttention: the attention layer the models hold. It knows its shapes; the backend does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 v_head_dim: int | None = None) -> None:
        super().__init__()
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim  # of q and k
        self.v_head_dim = v_head_dim or head_dim  # of v and the output (MLA: the latent rank, smaller than k's)
        self.scaling = scaling
        self.layer_id = layer_id
        # per-tensor scales of an fp8 KV cache: the pool holds k / k_scale (the checkpoint's k_scale / v_scale when
        # it has them, else 1.0); ignored by a 16/32-bit pool
        self.k_scale = 1.0
        self.v_scale = 1.0

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
