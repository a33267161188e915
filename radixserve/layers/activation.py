"""SiLU(gate) * up on a tensor holding [gate | up] in its last dimension; the elementwise activations of the
ungated MLPs (up -> act -> down), by their Hugging Face `hidden_act` names."""

from __future__ import annotations

from collections.abc import Callable

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


def _gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


def _relu2(x: torch.Tensor) -> torch.Tensor:
    return torch.square(F.relu(x))


# hidden_act -> the function transformers' ACT2FN applies under that name (the same torch ops)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": _gelu_tanh,  # StarCoder2
    "gelu": F.gelu,  # the exact (erf) GELU
    "relu2": _relu2,  # Nemotron, Arcee: relu(x) ** 2
    "silu": F.silu,
}


def activation_fn(name: str | None) -> Callable[[torch.Tensor], torch.Tensor]:
    """The elementwise activation named `name` (a config's hidden_act); ValueError for one not in ACTIVATIONS."""
    fn = ACTIVATIONS.get(name) if isinstance(name, str) else None
    if fn is None:
        raise ValueError(f"hidden_act {name!r} is not supported for this ungated MLP (supported: "
                         f"{', '.join(ACTIVATIONS)})")
    return fn
