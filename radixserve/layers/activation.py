"""SiLU(gate) * up on a tensor holding [gate | up] in its last dimension."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.triton_ops import use_fused


class SiluAndMul(nn.Module):
    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if use_fused(x) and x.dim() == 2 and x.stride(-1) == 1:
            from radixserve.layers.triton_ops.activation import silu_and_mul

            return silu_and_mul(x)
        d = x.shape[-1] // 2
        return F.silu(x[..., :d]) * x[..., d:]
