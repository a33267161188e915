"""The experts in plain PyTorch, one expert at a time: the CPU path and the reference the fused kernel is tested
against. Same arithmetic as Hugging Face's experts: SiLU(x W_gate^T) * (x W_up^T) (or GPT-OSS's activation, with
its biases, or Nemotron 3's relu(x W_up^T) ** 2), then W_down, times the routing weight, summed over the token's
experts."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers.moe.activation import SILU, ExpertActivation, ExpertBias
from radixserve.layers.quantization.fp8 import dequantize_blocks

if TYPE_CHECKING:
    from radixserve.layers.moe.methods import ExpertScales


def _act(x: torch.Tensor, group: int | None) -> torch.Tensor:
    """x in float32, or its fp8 quantisation per row and `group` columns, dequantised."""
    if group is None:
        return x.float()
    from radixserve.layers.quantization.fp8 import quantize_groups_ref

    q, s = quantize_groups_ref(x, group)
    return (q.float().view(x.shape[0], -1, group) * s[..., None]).view(x.shape)


def moe_forward_torch(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                      topk_ids: torch.Tensor, expert_offset: int = 0, scales: ExpertScales | None = None,
                      act_group: int | None = None, act: ExpertActivation = SILU,
                      bias: ExpertBias | None = None) -> torch.Tensor:
    """x [T, H]; w13 [E, 2I, H] (gate rows then up rows; [E, I, H], up rows alone, for a non-gated `act`);
    w2 [E, H, I]; topk_* [T, k] with global expert ids. Experts outside [expert_offset, expert_offset + E) are not
    held here and contribute nothing (expert parallelism: another rank adds them). With `scales` the weights are
    fp8: each expert used is dequantised and its products taken in float32, the intermediate and the output rounded
    to x's dtype as the kernels round them;
    `act_group`: x and the intermediate quantised to fp8 per row and act_group columns first (the W8A8 kernels).
    `act` / `bias`: the activation between the products and the experts' biases (GPT-OSS, Nemotron 3;
    `activation.py`)."""
    b13 = bias.w13 if bias is not None else None
    b2 = bias.w2 if bias is not None else None
    num_local = w13.shape[0]
    if w13.shape[1] != act.w13_rows(w2.shape[2]):
        raise ValueError(f"moe_forward_torch: w13 {tuple(w13.shape)} does not match w2 {tuple(w2.shape)} for "
                         f"{act.kind} experts")
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
        if scales is None:
            h = F.linear(x[tok], w13[e], None if b13 is None else b13[e])
            h = act(h)
            y = F.linear(h, w2[e], None if b2 is None else b2[e]) * topk_weights.flatten()[assign, None].to(x.dtype)
        else:
            g = scales.group_n
            h = F.linear(_act(x[tok], act_group), dequantize_blocks(w13[e], scales.w13[e], g, scales.group_k13))
            h = act(h).to(x.dtype)
            y = F.linear(_act(h, act_group), dequantize_blocks(w2[e], scales.w2[e], g, scales.group_k2))
            y = (y * topk_weights.flatten()[assign, None].float()).to(x.dtype)
        out.index_add_(0, tok, y)
    return out
