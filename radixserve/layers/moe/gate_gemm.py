"""The router for many tokens on the tensor cores: float32 logits of half-precision operands, and the top-k.

The router's logits are float32 (`MoEGate`: x.float() @ W.float()), which cuBLAS runs on the CUDA cores with a
separate cast of x. When the gate's weights are exactly half-precision values (a bf16 checkpoint's always are) and
x is in that dtype, a bf16 x bf16 product accumulated in float32 computes the same sums: each product is exact in
float32, only the order of the additions differs, as between any two GEMM algorithms. Two launches per layer:
program (p, s) of the first takes BLOCK_T tokens and all experts (E <= 256) and sums over the s-th chunk of the
hidden dim on the tensor cores (the chunks make enough programs for a batch of a few hundred tokens); the second
adds each token's chunks in order and stores the logits, or selects the token's experts as `_select_row` does
(scores, bias, repeated argmax, renormalisation, scaling), for routers without expert groups.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

MAX_EXPERTS = 256  # every expert's logit of a token in one program's registers
MAX_SPLITS = 16  # hidden-dim chunks the heuristic (`_splits`) makes at most


@triton.jit(do_not_specialize=["num_tokens"])
def _gate_partial_kernel(X, W, Partials, num_tokens, num_experts, hidden, stride_x, k_chunk,
                         BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, BLOCK_K: tl.constexpr,
                         UPCAST: tl.constexpr = False, PDL: tl.constexpr = 0):
    """Program (p, s): float32 sums over hidden [s·k_chunk, (s+1)·k_chunk) of BLOCK_T tokens' logits, every
    expert, into Partials[s]."""
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    split = tl.program_id(1)
    offs_e = tl.arange(0, E_PAD)
    offs_k = split * k_chunk + tl.arange(0, BLOCK_K)
    r_ok = rows < num_tokens
    e_ok = offs_e < num_experts
    x_ptrs = X + rows[:, None].to(tl.int64) * stride_x + offs_k[None, :]
    w_ptrs = W + offs_e[None, :].to(tl.int64) * hidden + offs_k[:, None]  # W^T's [BLOCK_K, E_PAD] tile
    end = tl.minimum(hidden, (split + 1) * k_chunk)
    acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    for k0 in range(split * k_chunk, end, BLOCK_K):
        k_ok = offs_k < end - (k0 - split * k_chunk)
        x = tl.load(x_ptrs, mask=r_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & e_ok[None, :], other=0.0)
        if UPCAST:  # Triton's interpreter multiplies bf16 operands wrongly; float32 gives the same sums
            x = x.to(tl.float32)
            w = w.to(tl.float32)
        acc += tl.dot(x, w)
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    out = Partials + split * num_tokens * num_experts
    tl.store(out + rows[:, None].to(tl.int64) * num_experts + offs_e[None, :], acc,
             mask=r_ok[:, None] & e_ok[None, :])


@triton.jit(do_not_specialize=["num_tokens", "splits"])
def _gate_finish_kernel(Partials, Bias, Logits, Weights, Ids, num_tokens, num_experts, scaling, splits,
                        MAX_SPLITS: tl.constexpr, BLOCK_T: tl.constexpr, E_PAD: tl.constexpr, K: tl.constexpr,
                        K_PAD: tl.constexpr, SIGMOID: tl.constexpr, HAS_BIAS: tl.constexpr, RENORM: tl.constexpr,
                        SELECT: tl.constexpr, PDL: tl.constexpr = 0):
    """BLOCK_T tokens: the logits (the `splits` partial sums added in order), then, SELECT, the experts as
    `_select_row` chooses them; else the logits stored. The loop is unrolled to MAX_SPLITS with the chunks past
    `splits` masked off (their loads all issued at once, and one compiled variant whatever the batch's count)."""
    pdl_prologue(PDL)
    rows = tl.program_id(0) * BLOCK_T + tl.arange(0, BLOCK_T)
    offs_e = tl.arange(0, E_PAD)
    r_ok = rows < num_tokens
    e_ok = offs_e < num_experts
    at = rows[:, None].to(tl.int64) * num_experts + offs_e[None, :]
    mask = r_ok[:, None] & e_ok[None, :]
    acc = tl.zeros([BLOCK_T, E_PAD], dtype=tl.float32)
    chunk = num_tokens.to(tl.int64) * num_experts
    for s in tl.static_range(MAX_SPLITS):
        acc += tl.load(Partials + s * chunk + at, mask=mask & (s * chunk + at < splits * chunk), other=0.0)
    if SELECT:
        valid = e_ok[None, :]  # (rows past the tokens hold zeros: finite scores, never stored)
        if SIGMOID:
            scores = tl.where(valid, 1.0 / (1.0 + tl.exp(-acc)), 0.0)
        else:
            logits = tl.where(valid, acc, float("-inf"))
            p = tl.exp(logits - tl.max(logits, axis=1)[:, None])
            scores = p / tl.sum(p, axis=1)[:, None]
        choice = scores
        if HAS_BIAS:
            choice = choice + tl.load(Bias + offs_e, mask=e_ok, other=0.0).to(tl.float32)[None, :]
        choice = tl.where(valid, choice, float("-inf"))
        offs_j = tl.arange(0, K_PAD)
        w_out = tl.zeros([BLOCK_T, K_PAD], dtype=tl.float32)
        i_out = tl.zeros([BLOCK_T, K_PAD], dtype=tl.int32)
        for j in tl.static_range(K):
            best = tl.argmax(choice, axis=1)
            hit = offs_e[None, :] == best[:, None]
            w_j = tl.sum(tl.where(hit, scores, 0.0), axis=1)
            w_out = tl.where(offs_j[None, :] == j, w_j[:, None], w_out)
            i_out = tl.where(offs_j[None, :] == j, best.to(tl.int32)[:, None], i_out)
            choice = tl.where(hit, float("-inf"), choice)
        if RENORM:
            total = tl.sum(w_out, axis=1)
            if SIGMOID:
                total += 1e-20
            w_out = w_out / total[:, None]
        kmask = r_ok[:, None] & (offs_j[None, :] < K)
        out = rows[:, None].to(tl.int64) * K + offs_j[None, :]
        tl.store(Weights + out, w_out * scaling, mask=kmask)
        tl.store(Ids + out, i_out, mask=kmask)
    else:
        tl.store(Logits + at, acc, mask=mask)


def gate_fits(x: torch.Tensor, weight_half: torch.Tensor) -> bool:
    """Whether `gate_logits` / `gate_topk_blocks` take x [T, H] with this [E, H] half-precision weight."""
    return (x.dim() == 2 and x.dtype == weight_half.dtype and x.stride(-1) == 1
            and weight_half.shape[1] == x.shape[1] and weight_half.shape[0] <= MAX_EXPERTS
            and weight_half.is_contiguous())


def _splits(t: int, hidden: int, block_t: int, block_k: int, num_sms: int) -> int:
    """Hidden-dim chunks per token block: about two programs a SM in all (a batch of 256 tokens is only 16 token
    blocks), each chunk at least two BLOCK_K steps."""
    blocks = triton.cdiv(t, block_t)
    return max(1, min(triton.cdiv(2 * num_sms, blocks), hidden // (2 * block_k), MAX_SPLITS))


def _launch(x: torch.Tensor, weight_half: torch.Tensor, select: tuple | None, interpreted: bool,
            config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, ...]:
    if not gate_fits(x, weight_half):
        raise ValueError(f"MoE gate: x {tuple(x.shape)} {x.dtype} does not fit the weight "
                         f"{tuple(weight_half.shape)} {weight_half.dtype} (same dtype, <= {MAX_EXPERTS} experts)")
    t, hidden = x.shape
    num_experts = weight_half.shape[0]
    e_pad = max(16, triton.next_power_of_2(num_experts))
    block_t, block_k = (16, 16) if interpreted else (16, 64 if e_pad >= 256 else 128)
    warps = 4
    if config is not None:
        block_t, block_k, splits, warps = config
        if block_t < 16 or block_k < 16 or block_t & (block_t - 1) or block_k & (block_k - 1) or splits < 1 \
                or warps not in (1, 2, 4, 8):
            raise ValueError(f"MoE gate config {config}: (BLOCK_T, BLOCK_K) powers of two >= 16, splits >= 1, "
                             "warps 1/2/4/8")
    else:
        sms = 4 if interpreted else torch.cuda.get_device_properties(x.device).multi_processor_count
        splits = _splits(t, hidden, block_t, block_k, sms)
    k_chunk = triton.cdiv(triton.cdiv(hidden, splits), block_k) * block_k
    splits = triton.cdiv(hidden, k_chunk)
    if select is None:
        logits = torch.empty((t, num_experts), dtype=torch.float32, device=x.device)
        outs: tuple[torch.Tensor, ...] = (logits,)
        top_k, sigmoid, renorm, scaling, bias = 1, False, False, 1.0, None
        weights = ids = logits
    else:
        top_k, sigmoid, renorm, scaling, bias = select
        weights = torch.empty((t, top_k), dtype=torch.float32, device=x.device)
        ids = torch.empty((t, top_k), dtype=torch.int32, device=x.device)
        logits = weights
        outs = (weights, ids)
    if t:
        partials = torch.empty((splits, t, num_experts), dtype=torch.float32, device=x.device)
        opts = {} if interpreted else {"num_warps": warps, "num_stages": 3, **pdl.launch_opts(x)}
        launch(_gate_partial_kernel, (triton.cdiv(t, block_t), splits), x, weight_half, partials, t, num_experts,
               hidden, x.stride(0), k_chunk, BLOCK_T=block_t, E_PAD=e_pad, BLOCK_K=block_k, UPCAST=interpreted,
               **opts)
        fin_t = 16 if interpreted else 4
        opts = {} if interpreted else {"num_warps": 4, **pdl.launch_opts(x)}
        launch(_gate_finish_kernel, (triton.cdiv(t, fin_t),), partials, bias if bias is not None else weights,
               logits, weights, ids, t, num_experts, float(scaling), splits,
               MAX_SPLITS=max(MAX_SPLITS, triton.next_power_of_2(splits)), BLOCK_T=fin_t, E_PAD=e_pad,
               K=top_k, K_PAD=triton.next_power_of_2(top_k), SIGMOID=sigmoid, HAS_BIAS=bias is not None,
               RENORM=renorm, SELECT=select is not None, **opts)
    return outs


def gate_logits(x: torch.Tensor, weight_half: torch.Tensor, interpreted: bool = False) -> torch.Tensor:
    """float32 [T, E] = x [T, H] @ weight_half [E, H]^T, summed in float32 (x in weight_half's dtype)."""
    return _launch(x, weight_half, None, interpreted)[0]


def gate_topk_blocks(x: torch.Tensor, weight_half: torch.Tensor, top_k: int, sigmoid: bool, renormalize: bool,
                     scaling: float, correction_bias: torch.Tensor | None = None, interpreted: bool = False,
                     config: tuple[int, int, int, int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """`fused_topk(gate_logits(x, weight_half), ...)` in two launches, the second choosing from the chunks' sums:
    (weights float32 [T, k], ids int32 [T, k]). `config`: (BLOCK_T, BLOCK_K, hidden-dim chunks, warps) of the
    first launch instead of the heuristic (`benchmarks/bench_router.py --tokens` sweeps them)."""
    if not 1 <= top_k <= weight_half.shape[0]:
        raise ValueError(f"MoE gate: top_k {top_k} must be in 1..{weight_half.shape[0]}")
    weights, ids = _launch(x, weight_half, (top_k, sigmoid, renormalize, scaling, correction_bias), interpreted,
                           config)
    return weights, ids
