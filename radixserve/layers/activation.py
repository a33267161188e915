"""SiLU(gate) * up on a tensor holding [gate | up] in its last dimension; the elementwise activations of the
ungated MLPs (up -> act -> down), by their Hugging Face `hidden_act` names; xIELU (Apertus), whose two
parameters are learned per layer."""

from __future__ import annotations

import math
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


def _gelu_new(x: torch.Tensor) -> torch.Tensor:
    """The tanh GELU in transformers' NewGELUActivation's own ops (Phi-1 / 1.5 / 2): the same function as
    gelu_pytorch_tanh, rounded otherwise."""
    return 0.5 * x * (1.0 + torch.tanh(math.sqrt(2.0 / math.pi) * (x + 0.044715 * torch.pow(x, 3.0))))


# hidden_act -> the function transformers' ACT2FN applies under that name (the same torch ops)
ACTIVATIONS: dict[str, Callable[[torch.Tensor], torch.Tensor]] = {
    "gelu_pytorch_tanh": _gelu_tanh,  # StarCoder2
    "gelu": F.gelu,  # the exact (erf) GELU
    "gelu_new": _gelu_new,  # Phi
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


class XIELU(nn.Module):
    """xIELU (arXiv 2411.13010; transformers' XIELUActivation, its Python form): with a_p = softplus(alpha_p) and
    a_n = beta + softplus(alpha_n), x > 0 gives a_p x^2 + beta x, else (expm1(min(x, eps)) - x) a_n + beta x.
    alpha_p / alpha_n are the layer's learned [1] parameters (held whole on every TP rank: it is elementwise);
    beta and eps are constants (0.5, -1e-6) that checkpoints store too (`set_constant`)."""

    def __init__(self, beta: float = 0.5, eps: float = -1e-6) -> None:
        super().__init__()
        # transformers' initial values: softplus(alpha_p) = 0.8, beta + softplus(alpha_n) = 0.8
        self.alpha_p = nn.Parameter(torch.tensor([math.log(math.expm1(0.8))]), requires_grad=False)
        self.alpha_n = nn.Parameter(torch.tensor([math.log(math.expm1(0.8 - beta))]), requires_grad=False)
        self.beta, self.eps = float(beta), float(eps)

    def set_constant(self, leaf: str, value: torch.Tensor) -> None:
        """A checkpoint's `beta` or `eps` (one number)."""
        if leaf not in ("beta", "eps") or value.numel() != 1:
            raise ValueError(f"xIELU has no constant {leaf!r} of shape {tuple(value.shape)} (beta, eps: one value)")
        setattr(self, leaf, float(value.float().item()))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        alpha_p = F.softplus(self.alpha_p.to(x.dtype))
        alpha_n = self.beta + F.softplus(self.alpha_n.to(x.dtype))
        negative = (torch.expm1(torch.clamp(x, max=self.eps)) - x) * alpha_n
        return torch.where(x > 0, alpha_p * x * x + self.beta * x, negative + self.beta * x)
