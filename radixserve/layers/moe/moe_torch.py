"""The experts in plain PyTorch, one expert at a time: the CPU path and the reference the fused kernel is tested
against. Same arithmetic as Hugging Face's experts: SiLU(x W_gate^T) * (x W_up^T), then W_down, times the routing
weight, summed over the token's experts."""

from __future__ import annotations

import torch
import torch.nn.functional as F


def moe_forward_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_offset: int = 0) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows); w2 [E, H, I]; topk_* [T, k] with global expert ids.
    Experts outside [expert_offset, expert_offset + E) are not held here and contribute nothing (expert
    parallelism: another rank adds them)."""
    num_local, inter = w13.shape[0], w2.shape[2]
    out = torch.zeros_like(x)
    if x.shape[0] == 0:
        return out
    local = topk_ids.long() - expert_offset
    flat = local.flatten()
    held = (flat >= 0) & (flat < num_local)
    order = torch.argsort(torch.where(held, flat, num_local), stable=True)
    counts = torch.bincount(flat[held], minlength=num_local).tolist()
    k = topk_ids.shape[1]
    start = 0
    for e, n in enumerate(counts):
        if n == 0:
            continue
        assign = order[start:start + n]
        start += n
        tok = assign // k
        h = F.linear(x[tok], w13[e])
        h = F.silu(h[:, :inter]) * h[:, inter:]
        y = F.linear(h, w2[e]) * topk_weights.flatten()[assign, None].to(x.dtype)
        out.index_add_(0, tok, y)
    return out
