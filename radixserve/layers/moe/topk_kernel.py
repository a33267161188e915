"""Expert selection for one token per program, in one launch: scores (softmax or sigmoid), the correction bias,
top-k by repeated argmax, renormalisation and scaling — what `select_experts` does in torch with ~7 kernels. For
routers without expert groups (Mixtral, Qwen-MoE, DeepSeek-V2-Lite's greedy top-k); grouped routers stay in torch."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _topk_router_kernel(Logits, Bias, Weights, Ids, num_experts, stride_l, scaling,
                        E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    x = tl.load(Logits + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    if SIGMOID:
        scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-x)), 0.0)
    else:
        p = tl.exp(x - tl.max(x, axis=0))
        scores = p / tl.sum(p, axis=0)
    choice = scores
    if HAS_BIAS:
        choice = choice + tl.load(Bias + offs, mask=valid, other=0.0).to(tl.float32)
    choice = tl.where(valid, choice, float("-inf"))
    offs_k = tl.arange(0, K_PAD)
    w_out = tl.zeros([K_PAD], dtype=tl.float32)
    i_out = tl.zeros([K_PAD], dtype=tl.int32)
    for j in tl.static_range(K):
        best = tl.argmax(choice, axis=0)
        w = tl.sum(tl.where(offs == best, scores, 0.0), axis=0)
        w_out = tl.where(offs_k == j, w, w_out)
        i_out = tl.where(offs_k == j, best.to(tl.int32), i_out)
        choice = tl.where(offs == best, float("-inf"), choice)
    if RENORM:
        total = tl.sum(w_out, axis=0)
        if SIGMOID:
            total += 1e-20
        w_out = w_out / total
    w_out = w_out * scaling
    tl.store(Weights + t * K + offs_k, w_out, mask=offs_k < K)
    tl.store(Ids + t * K + offs_k, i_out, mask=offs_k < K)


def fused_topk(router_logits: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool, scaling: float,
               correction_bias: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """(weights float32 [T, k], ids int32 [T, k]) as `select_experts` gives them for an ungrouped router (the k
    experts in descending order of choice)."""
    t, num_experts = router_logits.shape
    weights = torch.empty((t, top_k), dtype=torch.float32, device=router_logits.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=router_logits.device)
    if t:
        bias = correction_bias if correction_bias is not None else weights
        launch(_topk_router_kernel, (t,), router_logits, bias, weights, ids, num_experts,
               router_logits.stride(0), float(scaling), E_PAD=triton.next_power_of_2(num_experts), K=top_k,
               K_PAD=triton.next_power_of_2(top_k), SIGMOID=sigmoid, HAS_BIAS=correction_bias is not None,
               RENORM=renormalize, num_warps=4 if num_experts >= 128 else 1)
    return weights, ids
