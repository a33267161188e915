"""Expert selection for one token per program, in one launch: scores (softmax or sigmoid), the correction bias,
top-k by repeated argmax, renormalisation and scaling — what `select_experts` does in torch with ~7 kernels. For
routers without expert groups (Mixtral, Qwen-MoE, DeepSeek-V2-Lite's greedy top-k); grouped routers stay in torch.

For a few tokens (decode at small batch) `fused_gate_topk` also computes the router's logits in the same launch:
the float32 cast of the activations, the router GEMM and the top-k are one kernel instead of three."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _select_row(x, offs, valid, Bias, scaling, K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    """One token's (weights, ids) [K_PAD] from its float32 logits x [E_PAD] (invalid lanes -inf)."""
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
    return w_out * scaling, i_out


@triton.jit
def _topk_router_kernel(Logits, Bias, Weights, Ids, num_experts, stride_l, scaling,
                        E_PAD: tl.constexpr, K: tl.constexpr, K_PAD: tl.constexpr, SIGMOID: tl.constexpr,
                        HAS_BIAS: tl.constexpr, RENORM: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    offs = tl.arange(0, E_PAD)
    valid = offs < num_experts
    x = tl.load(Logits + t * stride_l + offs, mask=valid, other=float("-inf")).to(tl.float32)
    w_out, i_out = _select_row(x, offs, valid, Bias, scaling, K, K_PAD, SIGMOID, HAS_BIAS, RENORM)
    offs_k = tl.arange(0, K_PAD)
    tl.store(Weights + t * K + offs_k, w_out, mask=offs_k < K)
    tl.store(Ids + t * K + offs_k, i_out, mask=offs_k < K)


@triton.jit(do_not_specialize=["num_tokens"])  # a batch-dependent size: one variant for all
def _gate_topk_kernel(X, W, Logits, Done, Bias, Weights, Ids, Res, NormW, XOut, ResOut, num_tokens, num_experts,
                      hidden, stride_x, stride_r, scaling, eps,
                      BLOCK_E: tl.constexpr, H_PAD: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
                      K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                      NORM: tl.constexpr, PDL: tl.constexpr = 0):
    """The router's linear layer and the top-k in one launch, for a few tokens. Program p computes the float32
    logits of experts [p·BLOCK_E, (p+1)·BLOCK_E) for every token (its weight rows read once, held in registers);
    the last program to finish (a counter in `Done`, put back to 0 by it) selects every token's experts.
    NORM: the router's input is RMSNorm(X + Res) · NormW, rounded as `fused_add_rmsnorm` rounds; every program
    computes it for itself and program 0 also stores it (XOut) and the new residual (ResOut)."""
    pdl_prologue(PDL)
    offs_e = tl.program_id(0) * BLOCK_E + tl.arange(0, BLOCK_E)
    offs_h = tl.arange(0, H_PAD)
    e_ok = offs_e < num_experts
    h_ok = offs_h < hidden
    w = tl.load(W + offs_e[:, None].to(tl.int64) * hidden + offs_h[None, :], mask=e_ok[:, None] & h_ok[None, :],
                other=0.0).to(tl.float32)
    if NORM:
        nw = tl.load(NormW + offs_h, mask=h_ok, other=0.0).to(tl.float32)
    for t in range(num_tokens):
        if NORM:
            s = tl.load(X + t * stride_x + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            s += tl.load(Res + t * stride_r + offs_h, mask=h_ok, other=0.0).to(tl.float32)
            s = s.to(XOut.dtype.element_ty).to(tl.float32)
            rstd = tl.rsqrt(tl.sum(s * s, axis=0) / hidden + eps)
            y = ((s * rstd).to(XOut.dtype.element_ty).to(tl.float32) * nw).to(XOut.dtype.element_ty)
            if tl.program_id(0) == 0:
                tl.store(ResOut + t * hidden + offs_h, s.to(ResOut.dtype.element_ty), mask=h_ok)
                tl.store(XOut + t * hidden + offs_h, y, mask=h_ok)
            x = y.to(tl.float32)
        else:
            x = tl.load(X + t * stride_x + offs_h, mask=h_ok, other=0.0).to(tl.float32)
        tl.store(Logits + t * num_experts + offs_e, tl.sum(w * x[None, :], axis=1), mask=e_ok)
    tl.debug_barrier()  # every thread's logits are written before the counter moves
    finished = tl.atomic_add(Done, 1, sem="acq_rel")
    if finished == tl.num_programs(0) - 1:
        offs = tl.arange(0, E_PAD)
        valid = offs < num_experts
        offs_k = tl.arange(0, K_PAD)
        for t in range(num_tokens):
            x = tl.load(Logits + t * num_experts + offs, mask=valid, other=float("-inf"), cache_modifier=".cg")
            w_out, i_out = _select_row(x, offs, valid, Bias, scaling, K, K_PAD, SIGMOID, HAS_BIAS, RENORM)
            tl.store(Weights + t * K + offs_k, w_out, mask=offs_k < K)
            tl.store(Ids + t * K + offs_k, i_out, mask=offs_k < K)
        tl.atomic_xchg(Done, 0)


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


# Tokens up to which the router's norm, linear layer and top-k run as one launch. Its programs loop over the tokens
# and one program selects for all of them, so its time grows with the batch: on the H200 at Qwen3-30B-A3B's shape
# it took 6.9 us a layer at 1 token (the four launches it replaces, ~10 us) and 37 us at 8 tokens.
GATE_TOPK_TOKENS = 1
# (expert rows per program, warps) of that launch; None: the heuristic in `fused_gate_topk` (one row per program for
# the 2048-wide routers, at one warp: its top-k rounds then reduce within a warp; on the H200 with programmatic
# dependent launch 5.56 against 6.90 us at 4 warps for Qwen3-30B-A3B, 4.39 against 5.30 for DeepSeek-V2-Lite).
# benchmarks/bench_router.py times the choices.
GATE_TOPK_CONFIG: tuple[int, int] | None = None


def fused_gate_topk(x: torch.Tensor, weight: torch.Tensor, done: torch.Tensor, top_k: int, sigmoid: bool,
                    renormalize: bool, scaling: float, correction_bias: torch.Tensor | None = None,
                    interpreted: bool = False, norm: tuple[torch.Tensor, torch.Tensor, float] | None = None,
                    config: tuple[int, int] | None = None
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """`fused_topk(F.linear(x.float(), weight), ...)` in one launch: x [T, H] (any float dtype), weight float32
    [E, H] contiguous, done an int32 [1] counter at 0 (left at 0). Returns (weights, ids, None, None).
    With `norm` = (residual [T, H], norm weight [H], eps) the router's input is `fused_add_rmsnorm(x, residual,
    norm weight, eps)`'s output, and that output and the new residual are returned too. `config`: (expert rows per
    program, warps), else GATE_TOPK_CONFIG, else the heuristic."""
    t, hidden = x.shape
    num_experts = weight.shape[0]
    if weight.shape != (num_experts, hidden) or weight.dtype != torch.float32 or not weight.is_contiguous():
        raise ValueError(f"fused_gate_topk needs a contiguous float32 [E, {hidden}] weight, got "
                         f"{tuple(weight.shape)} {weight.dtype}")
    if x.stride(-1) != 1 or done.dtype != torch.int32 or done.numel() < 1:
        raise ValueError("fused_gate_topk needs x with unit stride in its last dim and an int32 counter")
    if norm is not None and (norm[0].shape != x.shape or norm[0].stride(-1) != 1 or norm[1].shape != (hidden,)):
        raise ValueError(f"fused_gate_topk: residual {tuple(norm[0].shape)} / norm weight {tuple(norm[1].shape)} "
                         f"do not match x {tuple(x.shape)}")
    weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
    ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
    x_out = res_out = None
    if norm is not None:
        x_out, res_out = torch.empty_like(x, memory_format=torch.contiguous_format), \
            torch.empty_like(x, memory_format=torch.contiguous_format)
    if t == 0:
        return weights, ids, x_out, res_out
    logits = torch.empty((t, num_experts), dtype=torch.float32, device=x.device)
    h_pad = triton.next_power_of_2(hidden)
    rows_per = max(1, min(8, 2048 // h_pad))  # many programs: few rows each
    block_e, warps = config or GATE_TOPK_CONFIG or (rows_per, 1 if rows_per * h_pad <= 2048 else
                                                    8 if rows_per * h_pad > 8192 else 4)
    if interpreted:
        block_e = 4
    bias = correction_bias if correction_bias is not None else weights
    res, nw, eps = norm if norm is not None else (x, x, 0.0)
    opts = {} if interpreted else {"num_warps": warps, **pdl.launch_opts(x)}
    launch(_gate_topk_kernel, (triton.cdiv(num_experts, block_e),), x, weight, logits, done, bias, weights, ids, res,
           nw, x_out if x_out is not None else x, res_out if res_out is not None else x, t, num_experts, hidden,
           x.stride(0), res.stride(0), float(scaling), float(eps), BLOCK_E=block_e, H_PAD=h_pad,
           E_PAD=triton.next_power_of_2(num_experts), K=top_k, K_PAD=triton.next_power_of_2(top_k),
           SIGMOID=sigmoid, HAS_BIAS=correction_bias is not None, RENORM=renormalize, NORM=norm is not None, **opts)
    return weights, ids, x_out, res_out
