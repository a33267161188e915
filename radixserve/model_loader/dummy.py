"""Random weights for any model shape, generated in place on the parameters' device (no CPU round trip)."""

from __future__ import annotations

import torch
from torch import nn

_MATRIX_STD = 0.02
_NORM_NOISE_STD = 0.02


def _is_norm(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    owner = leaf[-2] if len(leaf) >= 2 else name
    return "norm" in owner


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 42) -> None:
    """Fill every parameter of `model` in place from a generator seeded by `seed`.

    Norm weights get 1 plus small noise (a model whose norms are all zero would output constants), biases and
    matrices a normal distribution with std 0.02. Parameters are visited in `named_parameters()` order with one
    generator per device, so the same seed gives the same weights on the same device.
    """
    generators: dict[torch.device, torch.Generator] = {}
    for name, param in model.named_parameters():
        device = param.device
        if device.type == "meta":
            raise ValueError(f"parameter {name} is on the meta device; build the model on a real device first")
        gen = generators.get(device)
        if gen is None:
            gen = torch.Generator(device=device)
            gen.manual_seed(seed)
            generators[device] = gen
        data = param.data
        if not data.is_floating_point():
            data.zero_()
            continue
        if _is_norm(name) and name.endswith(".weight"):
            data.normal_(1.0, _NORM_NOISE_STD, generator=gen)
        else:
            data.normal_(0.0, _MATRIX_STD, generator=gen)
