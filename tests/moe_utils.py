"""Shared inputs of the MoE kernel tests (the grouped path and the small-batch path)."""

from __future__ import annotations

import torch

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # the CPU runs the kernels in Triton's interpreter


def expert_weights(e: int, h: int, i: int, seed: int = 0, gated: bool = True) -> tuple[torch.Tensor, torch.Tensor]:
    """Stacked w13 [e, 2i, h] ([e, i, h]: up rows alone, `gated` False) and w2 [e, h, i] on DEVICE."""
    g = torch.Generator().manual_seed(seed)
    rows = 2 * i if gated else i
    w13, w2 = torch.randn(e, rows, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2
    return w13.to(DEVICE), w2.to(DEVICE)


def skewed_ids(t: int, k: int, e: int, seed: int = 0) -> torch.Tensor:
    """Top-k ids (distinct per token) where expert 0 is chosen by every token and expert e-1 by none."""
    g = torch.Generator().manual_seed(seed)
    rest = [torch.randperm(e - 2, generator=g)[:k - 1] + 1 for _ in range(t)]
    ids = torch.stack(rest) if k > 1 else torch.empty(t, 0, dtype=torch.int64)
    return torch.cat([torch.zeros(t, 1, dtype=torch.int64), ids], dim=1).to(torch.int32)
