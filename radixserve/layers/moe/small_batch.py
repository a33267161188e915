"""The experts for a few tokens (decode at small batch) in two launches, with no sorting step.

At a handful of tokens the expert GEMMs are matrix-vector products: what costs is reading the chosen experts'
weights once and launching as little as possible. So instead of bucketing the assignments by expert (align, padded
row blocks, a separate top-k sum), each assignment (token t, its j-th expert) is one row of work:

1. gate/up: program (assignment, column block) reads x[t] and the expert's gate and up rows of that column block,
   and stores SiLU(gate)·up for the assignment (fp32 accumulation, one store in the model dtype);
2. down: program (token, output column block) reads the token's k activated rows and its k experts' W_down
   columns, applies the routing weights and sums over k in registers: one store of the layer's output per token.

Shared experts (DeepSeek's `shared_experts`) may ride along as extra assignments of weight 1: a shared MLP whose
intermediate size (per rank) is c times the routed one is c more "experts" for every token, read from its own
gate_up / down weights (no copy into the routed stack). Experts not held on this rank (expert parallelism)
contribute nothing. Tokens that choose the same expert read its weights again (from L2 when close in time): the
path is for batches of up to `SMALL_BATCH_TOKENS` tokens, the sorted grouped GEMM of `fused_moe.py` for the rest.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch

SMALL_BATCH_TOKENS = 16  # tokens up to which the MoE layer takes this path


@dataclass(frozen=True)
class SmallMoEConfig:
    block_n_gate_up: int = 16
    block_k_gate_up: int = 512
    block_n_down: int = 8
    block_k_down: int = 128
    warps_gate_up: int = 4
    warps_down: int = 4


DEFAULT = SmallMoEConfig()
INTERPRETED = SmallMoEConfig(8, 16, 8, 16, 1, 1)  # Triton's CPU interpreter: small tiles keep the tests quick


@triton.jit
def _small_gate_up_kernel(X, W13, W13S, Inter, Ids, top_k, slots, offset, num_local, inter_size, shared_inter,
                          hidden, stride_x, stride_we, stride_wn, stride_ws, stride_i,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    a = tl.program_id(0)  # assignment: token a // slots, slot a % slots (routed slots first, then shared chunks)
    tok = a // slots
    j = a % slots
    is_routed = j < top_k
    e = tl.load(Ids + tok * top_k + j, mask=is_routed, other=0).to(tl.int32) - offset
    held = (e >= 0) & (e < num_local)
    use = held | (j >= top_k)
    e64 = tl.where(held, e, 0).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter_size
    n_read = offs_n < tl.where(use, inter_size, 0)  # no weight read for an expert held elsewhere
    # routed: rows of W13[e] (gate rows, then up rows inter_size further); shared chunk c: rows c·I.. of the
    # shared MLP's gate_up weight (gate rows, then up rows shared_inter further)
    chunk = (j - top_k).to(tl.int64)
    gate_rows = tl.where(is_routed, offs_n, chunk * inter_size + offs_n).to(tl.int64)
    up_shift = tl.where(is_routed, inter_size, shared_inter).to(tl.int64)
    stride_row = tl.where(is_routed, stride_wn, stride_ws).to(tl.int64)
    base = tl.where(is_routed, W13 + e64 * stride_we, W13S)
    g_ptrs = base + gate_rows[:, None] * stride_row
    u_ptrs = base + (gate_rows + up_shift)[:, None] * stride_row
    x_row = X + tok.to(tl.int64) * stride_x
    acc_g = tl.zeros([BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < hidden
        x = tl.load(x_row + offs_k, mask=k_ok, other=0.0).to(tl.float32)
        m = n_read[:, None] & k_ok[None, :]
        wg = tl.load(g_ptrs + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        wu = tl.load(u_ptrs + offs_k[None, :], mask=m, other=0.0).to(tl.float32)
        acc_g += tl.sum(wg * x[None, :], axis=1)
        acc_u += tl.sum(wu * x[None, :], axis=1)
    act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    tl.store(Inter + a.to(tl.int64) * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=n_ok)


@triton.jit
def _small_down_kernel(Inter, W2, W2S, Out, Weights, Ids, top_k, slots, offset, num_local, hidden, inter_size,
                       stride_i, stride_we, stride_wn, stride_ws, stride_o,
                       S_PAD: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    tok = tl.program_id(0)
    offs_j = tl.arange(0, S_PAD)
    is_routed = offs_j < top_k
    e = tl.load(Ids + tok * top_k + offs_j, mask=is_routed, other=0).to(tl.int32) - offset
    held = is_routed & (e >= 0) & (e < num_local)
    use = held | ((offs_j >= top_k) & (offs_j < slots))
    # routing weights; shared chunks add with weight 1
    wt = tl.load(Weights + tok * top_k + offs_j, mask=held, other=0.0).to(tl.float32)
    wt = tl.where(is_routed, wt, tl.where(use, 1.0, 0.0))
    e64 = tl.where(held, e, 0).to(tl.int64)
    chunk = (offs_j - top_k).to(tl.int64)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    # routed: W2[e][n, k]; shared chunk c: the shared down weight's [n, c·I + k]
    row_stride = tl.where(is_routed, stride_wn, stride_ws).to(tl.int64)
    col0 = tl.where(is_routed, 0, chunk * inter_size)
    base = tl.where(is_routed, W2 + e64 * stride_we, W2S + col0)
    w_ptrs = base[:, None, None] + offs_n.to(tl.int64)[None, :, None] * row_stride[:, None, None]
    a_ptrs = Inter + (tok * slots + offs_j).to(tl.int64)[:, None] * stride_i
    acc = tl.zeros([S_PAD, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        offs_k = k0 + tl.arange(0, BLOCK_K)
        k_ok = offs_k < inter_size
        act = tl.load(a_ptrs + offs_k[None, :], mask=use[:, None] & k_ok[None, :], other=0.0).to(tl.float32)
        m = use[:, None, None] & n_ok[None, :, None] & k_ok[None, None, :]
        w = tl.load(w_ptrs + offs_k[None, None, :], mask=m, other=0.0).to(tl.float32)
        acc += tl.sum(w * act[:, None, :], axis=2)
    out = tl.sum(acc * wt[:, None], axis=0)
    tl.store(Out + tok.to(tl.int64) * stride_o + offs_n, out.to(Out.dtype.element_ty), mask=n_ok)


def small_batch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, expert_offset: int = 0, shared_w13: torch.Tensor | None = None,
                    shared_w2: torch.Tensor | None = None, config: SmallMoEConfig | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t]) (+ the shared MLP SiLU(x G^T)·(x U^T) D^T when
    `shared_w13` [2S, H] / `shared_w2` [H, S] are given, S a multiple of the routed intermediate size), for
    x [T, H], w13 [E, 2I, H], w2 [E, H, I]; experts outside [expert_offset, expert_offset + E) add nothing."""
    num_tokens, hidden = x.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    if w13.shape != (num_local, 2 * inter, hidden) or w2.shape != (num_local, hidden, inter):
        raise ValueError(f"small_batch_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match hidden "
                         f"{hidden}")
    if w13.stride(2) != 1 or w2.stride(2) != 1:
        raise ValueError("small_batch_moe: expert weights must be contiguous in their last dimension")
    chunks, shared_inter = 0, 0
    if shared_w13 is not None:
        if shared_w2 is None:
            raise ValueError("small_batch_moe: shared_w13 given without shared_w2")
        shared_inter = shared_w2.shape[1]
        if shared_inter % inter or shared_w13.shape != (2 * shared_inter, hidden) or \
                shared_w2.shape != (hidden, shared_inter) or shared_w13.stride(1) != 1 or shared_w2.stride(1) != 1:
            raise ValueError(f"small_batch_moe: shared weights {tuple(shared_w13.shape)} / "
                             f"{tuple(shared_w2.shape)} are not [2S, H] / [H, S] with S a multiple of {inter}")
        chunks = shared_inter // inter
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted

    interp = is_interpreted()
    cfg = config or (INTERPRETED if interp else DEFAULT)
    x = x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    slots = top_k + chunks
    act = torch.empty((num_tokens * slots, inter), dtype=x.dtype, device=x.device)
    sw13 = w13 if shared_w13 is None else shared_w13
    sw2 = w2 if shared_w2 is None else shared_w2
    launch(_small_gate_up_kernel, (num_tokens * slots, triton.cdiv(inter, cfg.block_n_gate_up)), x, w13, sw13, act,
           ids, top_k, slots, expert_offset, num_local, inter, shared_inter, hidden, x.stride(0), w13.stride(0),
           w13.stride(1), sw13.stride(-2), act.stride(0), BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up,
           **({} if interp else {"num_warps": cfg.warps_gate_up}))
    launch(_small_down_kernel, (num_tokens, triton.cdiv(hidden, cfg.block_n_down)), act, w2, sw2, out, weights, ids,
           top_k, slots, expert_offset, num_local, hidden, inter, act.stride(0), w2.stride(0), w2.stride(1),
           sw2.stride(-2), out.stride(0), S_PAD=triton.next_power_of_2(slots), BLOCK_N=cfg.block_n_down,
           BLOCK_K=cfg.block_k_down, **({} if interp else {"num_warps": cfg.warps_down}))
    return out
