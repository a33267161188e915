"""The experts for a few tokens (decode at small batch) in two launches, with no sorting step.

At a handful of tokens what costs is reading the chosen experts' weights once and launching as little as possible.
So instead of bucketing the assignments by expert (align, padded row blocks, a separate top-k sum), each assignment
(token t, its j-th expert) is one row of work, multiplied on the tensor cores as row 0 of a 16-row tile (the other
rows are zeros: compute is free here, and `tl.dot` gets Triton's pipelined loads):

1. gate/up: program (assignment, column block) reads x[t] and the expert's gate and up rows of that column block,
   and stores SiLU(gate)·up for the assignment (fp32 accumulation, one store in the model dtype; GPT-OSS's experts:
   their gate/up bias added, then their clamped activation; Nemotron 3's non-gated experts: relu(up)² of their up
   rows alone; `activation.py`, as the grouped GEMMs compute it);
2. down: program (assignment, output column block) multiplies the activated row by the expert's W_down block (plus
   its down bias, GPT-OSS) and its routing weight into a float32 partial; the last of the token's programs for that
   block (a counter per (token, block), put back to 0 by it) sums the token's partials in slot order and stores the
   output.

Shared experts (DeepSeek's `shared_experts`) may ride along as extra assignments of weight 1: a shared MLP whose
intermediate size (per rank) is c times the routed one is c more "experts" for every token, read from its own
gate_up / down weights (no copy into the routed stack; with fp8 experts, an fp8 MLP whose scales have the
experts' form, read from its own scale tensors). Experts not held on this rank (expert parallelism)
contribute nothing. Tokens that choose the same expert read its weights again (from L2 when close in time): the
path is for batches of up to `SMALL_BATCH_TOKENS` tokens, the sorted grouped GEMM of `fused_moe.py` for the rest.

fp8 experts (`ExpertScales`, `fp8_form`): the products run on the CUDA cores (`_fp8_rows`, runs of 8 products
summed in the thread: the fp8 tile through `tl.dot`'s operand path read the weights at ~1.4 TB/s on an H200, slower
than bf16), a per-row scale applied once after the loop, block-wise scales to each K step's sums (a step within one
128-column group); `RADIXSERVE_MOE_FP8_BLOCKS=dot` takes block-wise experts through `tl.dot` instead, each K step's
products scaled. Each form has its own default tiles.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from radixserve.layers.moe.activation import SILU, ExpertActivation, ExpertBias
from radixserve.layers.moe.fused_moe import _wdot, scale_args
from radixserve.layers.quantization.fp8_gemv import _runs8
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

if TYPE_CHECKING:
    from radixserve.layers.moe.methods import ExpertScales

# Tokens up to which the MoE layer takes this path. On the H200 at Qwen3-30B-A3B's layer shape (one layer's experts,
# CUDA graphs, benchmarks/bench_moe_kernels.py): 25.8 us against the grouped path's 32.4 at 1 token, 130.6 against
# 134.6 at 8, 210.0 against 185.4 at 16 (tokens choosing the same expert read it again).
SMALL_BATCH_TOKENS = 8
# fp8 experts whose larger batches take the W8A8 grouped GEMMs (`fused_moe.fp8_activations`): the same comparison
# (2026-12-04, fp8 weights, bf16 activations), µs a layer at 1 / 2 / 3 / 4 / 6 / 8 tokens, small against grouped —
# per-row scales 20.9 / 28.9 / 45.3 / 52.2 / 72.3 / 93.4 against 29.5 / 36.0 / 47.8 / 60.4 / 70.8 / 83.1; 128 x 128
# blocks through `tl.dot` 26.4 / 37.7 / 52.7 / 62.5 / 87.7 / 113.2 against 28.9 / 35.8 / 48.5 / 55.0 / 75.1 / 84.3;
# 128 x 128 blocks on the CUDA cores (FP8_BLOCKS_FORM "rows", another machine) 22.9 / 28.4 / - / 53.7 at 1 / 2 / 4
# against 28.8 / 35.7 / - / 56.0 (DeepSeek-V2-Lite's shape: 50.1 / 59.0 / 88.2 against 53.1 / 63.6 / 87.7).
SMALL_BATCH_TOKENS_FP8 = 4  # the CUDA-core forms (per-row scales; block-wise ones in the "rows" form)
SMALL_BATCH_TOKENS_FP8_DOT = 1  # block-wise scales through `tl.dot`


@dataclass(frozen=True)
class SmallMoEConfig:
    block_n_gate_up: int = 32
    block_k_gate_up: int = 128
    block_n_down: int = 64
    block_k_down: int = 128
    # 2 warps: on the H200 (benchmarks/bench_moe_kernels.py --sweep-small) 25.0 / 129.8 us a layer at 1 / 8 tokens
    # against 25.3 / 130.7 at 4 for Qwen3-30B-A3B, 39.7 / 165.9 against 40.0 / 167.4 for DeepSeek-V2-Lite
    warps: int = 2
    stages: int = 4


DEFAULT = SmallMoEConfig()
# fp8 experts (H200, benchmarks/bench_moe_kernels.py --sweep-small --fp8 channel|block, Qwen3-30B-A3B's shape, µs a
# layer at 1 / 8 tokens): per-row scales on the CUDA cores 21.1 / 94.6 (bf16's DEFAULT: 25.0 / 129.8); block-wise
# scales (K steps cut to the 128-column groups) on the tensor cores 26.4 / 113.5. With runs-of-8 accumulators and
# gate / up in one loop (`_fp8_rows`) the per-row tile stayed within 4% of the sweep's best at 1 / 2 / 4 tokens:
# 19.0 / 24.9 / 47.2 (DeepSeek-V2-Lite's shape: 46.5 / 56.3 / 81.0, within 6%)
DEFAULT_FP8_ROWS = SmallMoEConfig(16, 256, 32, 256, 4, 2)
DEFAULT_FP8_BLOCKS = SmallMoEConfig(32, 128, 32, 256, 4, 3)
# Block-wise fp8 experts: "dot" widens each tile for the tensor cores (`fused_moe._wdot`), "rows" multiplies on the
# CUDA cores as per-row experts do, each step's sums scaled by its block (`_fp8_rows`, BLOCKS). On an H200 (one
# layer, 128 x 128 blocks, `bench_moe_kernels.py --tokens 1 2 4 --sweep-small --fp8 block`, each form at its default
# tile) "rows" took 22.9 / 28.4 / 53.7 µs at 1 / 2 / 4 tokens against 26.5 / 37.3 / 62.8 for Qwen3-30B-A3B's shape,
# 50.1 / 59.0 / 88.2 against 51.0 / 70.1 / 104.0 for DeepSeek-V2-Lite's.
FP8_BLOCKS_FORM = os.environ.get("RADIXSERVE_MOE_FP8_BLOCKS", "rows")
if FP8_BLOCKS_FORM not in ("dot", "rows"):
    raise ValueError(f"RADIXSERVE_MOE_FP8_BLOCKS must be dot or rows; got {FP8_BLOCKS_FORM!r}")
INTERPRETED = SmallMoEConfig(16, 16, 16, 16, 1, 1)  # Triton's CPU interpreter: small tiles keep the tests quick
ROWS = 16  # the dot's M: row 0 is the assignment's, the rest are zeros (compute is free here, bytes are not)


@triton.jit
def _fp8_rows(w_rows, shift, x_row, Scale, s_rows, s_rows2, n_read, K, group_k, BLOCK_K: tl.constexpr,
              TWO: tl.constexpr, BLOCKS: tl.constexpr = False):
    """The products of BLOCK_N fp8 weight rows (w_rows: each row's first byte, K contiguous) with one activation
    row, on the CUDA cores, times each row's scale (s_rows: its offset in Scale). Each step widens a [BLOCK_N,
    BLOCK_K] tile (read evict-first) to float32, multiplies it by the x chunk and sums each thread's runs of 8
    products into a [BLOCK_N, BLOCK_K / 8] accumulator (its registers, not instructions, limit how many bytes an SM
    keeps in flight); the row sums come once, after the loop. TWO: also the rows `shift` bytes further (scales at
    s_rows2) in the same loop (gate and up: twice the bytes in flight a program); else the second result is the
    first. BLOCKS: a scale per row block and `group_k` columns (s_rows + k // group_k), applied to each step's sums
    (a step never spans two groups: BLOCK_K divides group_k)."""
    offs_k = tl.arange(0, BLOCK_K)
    # x through a [BLOCK_N, BLOCK_K] pointer tile (every row the same; L1 serves the repeats): the weight tile's
    # layout, so nothing is exchanged through shared memory inside the loop
    x_ptrs = x_row + offs_k[None, :] + tl.zeros([w_rows.shape[0], 1], dtype=tl.int32)
    acc = tl.zeros([w_rows.shape[0], BLOCK_K // 8], dtype=tl.float32)
    acc2 = tl.zeros([w_rows.shape[0], BLOCK_K // 8], dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        k_ok = offs_k < K - k0
        ptrs = w_rows[:, None] + k0 + offs_k[None, :]
        mask = n_read[:, None] & k_ok[None, :]
        x = tl.load(x_ptrs + k0, mask=k_ok[None, :], other=0.0).to(tl.float32)
        part = _runs8(tl.load(ptrs, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32) * x)
        if BLOCKS:
            part = part * tl.load(Scale + s_rows + k0 // group_k, mask=n_read, other=0.0)[:, None]
        acc += part
        if TWO:
            part2 = _runs8(tl.load(ptrs + shift, mask=mask, other=0.0, eviction_policy="evict_first").to(tl.float32)
                           * x)
            if BLOCKS:
                part2 = part2 * tl.load(Scale + s_rows2 + k0 // group_k, mask=n_read, other=0.0)[:, None]
            acc2 += part2
    out = tl.sum(acc, axis=1)
    out2 = tl.sum(acc2, axis=1)
    if not BLOCKS:
        out = out * tl.load(Scale + s_rows, mask=n_read, other=0.0)
        out2 = out2 * tl.load(Scale + s_rows2, mask=n_read, other=0.0)
    if not TWO:
        out2 = out
    return out, out2


@triton.jit
def _small_gate_up_kernel(X, W13, W13S, Inter, Ids, top_k, slots, offset, num_local, inter_size, shared_inter,
                          hidden, stride_x, stride_we, stride_wn, stride_ws, stride_i, Scale, stride_se, stride_sn,
                          group_n, group_k, SScale, stride_ss, Bias, stride_be, alpha, limit,
                          BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr = 0,
                          QUANT: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0):
    """QUANT: W13 is fp8 with float32 scales per row (1: multiplied on the CUDA cores, `_fp8_rows`) or per block (2:
    widened for the tensor cores, each K step scaled, `fused_moe._wdot`; 3: on the CUDA cores, `_fp8_rows`); the
    shared MLP's gate_up (W13S) then has scales of the same form in SScale (its rows of scales stride_ss apart).
    HAS_BIAS: the routed experts' Bias [E, 2I] (gate then up) is added to the products; ACT
    (`ExpertActivation.code`): 0 SiLU(gate)·up, 1 GPT-OSS's clamped gate·sigmoid(alpha·gate)·(up + 1), 2 relu(up)²
    with W13 [E, I, H] holding the up rows alone (no gate read; Bias [E, I]), as `fused_moe._gate_up_kernel` computes
    them."""
    pdl_prologue(PDL)
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
    if ACT == 2:  # not gated: a routed expert's up rows come first (and alone)
        routed_up = 0
    else:
        routed_up = inter_size
    up_shift = tl.where(is_routed, routed_up, shared_inter).to(tl.int64)
    stride_row = tl.where(is_routed, stride_wn, stride_ws).to(tl.int64)
    base = tl.where(is_routed, W13 + e64 * stride_we, W13S)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, 16)
    g_ptrs = base + gate_rows[None, :] * stride_row + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    u_ptrs = base + (gate_rows + up_shift)[None, :] * stride_row + offs_k[:, None]
    x_ptrs = X + tok.to(tl.int64) * stride_x + rows[:, None] * 0 + offs_k[None, :]  # [16, BLOCK_K]
    # the gate and up columns' scale rows: the expert's, or the shared MLP's (rows of chunk c at c·I.., up rows
    # shared_inter further)
    sg_cols = tl.where(is_routed, e64 * stride_se + (offs_n // group_n) * stride_sn,
                       (gate_rows // group_n) * stride_ss)
    su_cols = tl.where(is_routed, e64 * stride_se + ((routed_up + offs_n) // group_n) * stride_sn,
                       ((gate_rows + up_shift) // group_n) * stride_ss)
    Scale = tl.where(is_routed, Scale, SScale)
    if QUANT == 1 or QUANT == 3:
        x_row = X + tok.to(tl.int64) * stride_x
        g, u = _fp8_rows(base + gate_rows * stride_row, up_shift * stride_row, x_row, Scale, sg_cols, su_cols, n_read,
                         hidden, group_k, BLOCK_K, ACT != 2, QUANT == 3)  # (non-gated: u = g, the up rows')
    else:
        acc_g = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        acc_u = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, hidden, BLOCK_K):
            k_ok = offs_k < hidden - k0
            x = tl.load(x_ptrs, mask=(rows == 0)[:, None] & k_ok[None, :], other=0.0)
            m = k_ok[:, None] & n_read[None, :]
            if ACT != 2:
                wg = tl.load(g_ptrs, mask=m, other=0.0)
            wu = tl.load(u_ptrs, mask=m, other=0.0)
            if ACT != 2:
                acc_g = acc_g + _wdot(x, wg, Scale, sg_cols, n_read, k0, group_k, QUANT == 2, FP32)
            acc_u = acc_u + _wdot(x, wu, Scale, su_cols, n_read, k0, group_k, QUANT == 2, FP32)
            x_ptrs += BLOCK_K
            g_ptrs += BLOCK_K
            u_ptrs += BLOCK_K
        g = tl.sum(tl.where((rows == 0)[:, None], acc_g, 0.0), axis=0)
        u = tl.sum(tl.where((rows == 0)[:, None], acc_u, 0.0), axis=0)
    if HAS_BIAS:  # routed experts only (a shared MLP has none)
        b_ptrs = Bias + e64 * stride_be + offs_n
        b_ok = offs_n < tl.where(is_routed & held, inter_size, 0)
        if ACT != 2:
            g += tl.load(b_ptrs, mask=b_ok, other=0.0).to(tl.float32)
        u += tl.load(b_ptrs + routed_up, mask=b_ok, other=0.0).to(tl.float32)
    if ACT == 0:
        act = g / (1.0 + tl.exp(-g)) * u
    elif ACT == 1:
        g = tl.minimum(g, limit)
        u = tl.minimum(tl.maximum(u, -limit), limit)
        act = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    else:
        r = tl.maximum(u, 0.0)
        act = r * r
    tl.store(Inter + a.to(tl.int64) * stride_i + offs_n, act.to(Inter.dtype.element_ty), mask=n_ok)


@triton.jit
def _small_down_kernel(Inter, W2, W2S, Out, Partial, Count, Weights, Ids, top_k, slots, offset, num_local, hidden,
                       inter_size, stride_i, stride_we, stride_wn, stride_ws, stride_o, Scale, stride_se, stride_sn,
                       group_n, group_k, SScale, stride_ss, Bias, stride_be, S_PAD: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr, PDL: tl.constexpr = 0,
                       QUANT: tl.constexpr = 0, HAS_BIAS: tl.constexpr = False):
    """Program (assignment, column block): its weighted down-projection into Partial (float32); the last of a
    token's `slots` programs for a column block (a counter per block in Count, put back to 0 by it) sums them in
    slot order and stores the token's output. fp8 (QUANT): the shared MLP's down weight (W2S) has scales of the
    experts' form in SScale (rows stride_ss apart; block-wise, chunk c's columns start at group c·I / group_k).
    HAS_BIAS: the routed experts' Bias [E, H] is added to the product before the routing weight."""
    pdl_prologue(PDL)
    a = tl.program_id(0)
    nb = tl.program_id(1)
    tok = a // slots
    j = a % slots
    is_routed = j < top_k
    e = tl.load(Ids + tok * top_k + j, mask=is_routed, other=0).to(tl.int32) - offset
    held = (e >= 0) & (e < num_local)
    use = held | (j >= top_k)
    wt = tl.where(is_routed, tl.load(Weights + tok * top_k + j, mask=is_routed & held, other=0.0).to(tl.float32),
                  1.0)  # shared chunks add with weight 1
    e64 = tl.where(held, e, 0).to(tl.int64)
    offs_n = nb * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    n_read = offs_n < tl.where(use, hidden, 0)
    # routed: W2[e][n, k]; shared chunk c: the shared down weight's [n, c·I + k]
    chunk = (j - top_k).to(tl.int64)
    stride_row = tl.where(is_routed, stride_wn, stride_ws).to(tl.int64)
    base = tl.where(is_routed, W2 + e64 * stride_we, W2S + chunk * inter_size)
    offs_k = tl.arange(0, BLOCK_K)
    rows = tl.arange(0, 16)
    w_ptrs = base + offs_n.to(tl.int64)[None, :] * stride_row + offs_k[:, None]  # [BLOCK_K, BLOCK_N]
    a_ptrs = Inter + a.to(tl.int64) * stride_i + rows[:, None] * 0 + offs_k[None, :]  # [16, BLOCK_K]
    s_chunk = 0 if QUANT == 1 else chunk * (inter_size // group_k)  # per row: one scale over all columns
    s_cols = tl.where(is_routed, e64 * stride_se + (offs_n // group_n) * stride_sn,
                      (offs_n // group_n) * stride_ss + s_chunk)
    Scale = tl.where(is_routed, Scale, SScale)
    if QUANT == 1 or QUANT == 3:
        part, _ = _fp8_rows(base + offs_n.to(tl.int64) * stride_row, 0, Inter + a.to(tl.int64) * stride_i, Scale,
                            s_cols, s_cols, n_read, inter_size, group_k, BLOCK_K, False, QUANT == 3)
    else:
        acc = tl.zeros([16, BLOCK_N], dtype=tl.float32)
        for k0 in range(0, inter_size, BLOCK_K):
            k_ok = offs_k < inter_size - k0
            act = tl.load(a_ptrs, mask=(rows == 0)[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=k_ok[:, None] & n_read[None, :], other=0.0)
            acc = acc + _wdot(act, w, Scale, s_cols, n_read, k0, group_k, QUANT == 2, FP32)
            a_ptrs += BLOCK_K
            w_ptrs += BLOCK_K
        part = tl.sum(tl.where((rows == 0)[:, None], acc, 0.0), axis=0)
    if HAS_BIAS:  # routed experts held here only (a shared chunk has none; another rank's expert adds nothing)
        b_ok = offs_n < tl.where(is_routed & held, hidden, 0)
        part += tl.load(Bias + e64 * stride_be + offs_n, mask=b_ok, other=0.0).to(tl.float32)
    part = part * wt
    tl.store(Partial + a.to(tl.int64) * hidden + offs_n, part, mask=n_ok)
    tl.debug_barrier()  # every thread's partial is written before the counter moves
    counter = Count + tok * tl.num_programs(1) + nb
    if tl.atomic_add(counter, 1, sem="acq_rel") == slots - 1:
        offs_j = tl.arange(0, S_PAD)
        parts = tl.load(Partial + (tok * slots + offs_j).to(tl.int64)[:, None] * hidden + offs_n[None, :],
                        mask=(offs_j < slots)[:, None] & n_ok[None, :], other=0.0, cache_modifier=".cg")
        tl.store(Out + tok.to(tl.int64) * stride_o + offs_n, tl.sum(parts, axis=0).to(Out.dtype.element_ty),
                 mask=n_ok)
        tl.atomic_xchg(counter, 0)


def small_batch_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
                    topk_ids: torch.Tensor, expert_offset: int = 0, shared_w13: torch.Tensor | None = None,
                    shared_w2: torch.Tensor | None = None, config: SmallMoEConfig | None = None,
                    counters: torch.Tensor | None = None, scales: ExpertScales | None = None,
                    shared_scales: tuple[torch.Tensor, torch.Tensor] | None = None, act: ExpertActivation = SILU,
                    bias: ExpertBias | None = None) -> torch.Tensor:
    """sum_j topk_weights[t, j] · expert_{topk_ids[t, j]}(x[t]) (+ the shared MLP SiLU(x G^T)·(x U^T) D^T when
    `shared_w13` [2S, H] / `shared_w2` [H, S] are given, S a multiple of the routed intermediate size), for
    x [T, H], w13 [E, 2I, H] ([E, I, H] for a non-gated `act`), w2 [E, H, I]; experts outside [expert_offset,
    expert_offset + E) add nothing. With `scales` the routed weights are fp8, widened in the kernels; an fp8 shared
    MLP then comes with `shared_scales` of the same form: per row (block) [ceil(2S / gn), 1] / [ceil(H / gn), 1], or
    per block of the experts' groups [ceil(2S / gn), ceil(H / gk13)] / [ceil(H / gn), S / gk2] (I a multiple of
    gk2).
    `act` / `bias`: the routed experts' activation and biases (GPT-OSS, Nemotron 3, `activation.py`; bias.w13 added
    before the activation, bias.w2 [E, H] before the routing weight), as `fused_moe` takes them; a shared MLP rides
    along with SiLU experts only."""
    num_tokens, hidden = x.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    rows13 = act.w13_rows(inter)
    if w13.shape != (num_local, rows13, hidden) or w2.shape != (num_local, hidden, inter):
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
        if act != SILU:
            raise ValueError(f"small_batch_moe: a shared MLP (SiLU) cannot ride along with {act.kind} experts")
        _check_shared_scales(scales, shared_scales, shared_inter, hidden, inter)
    out = torch.empty_like(x)
    if num_tokens == 0:
        return out
    from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted

    interp = is_interpreted()
    quant = fp8_form(scales)
    cfg = config or (INTERPRETED if interp else _TILES[quant])
    if quant >= 2:  # a K step within one scale group
        cfg = replace(cfg, block_k_gate_up=min(cfg.block_k_gate_up, scales.group_k13),
                      block_k_down=min(cfg.block_k_down, scales.group_k2))
    q13, q2 = scale_args(scales, w13, w2)
    b13 = bias.w13 if bias is not None else None
    b2 = bias.w2 if bias is not None else None
    for name, b, want in (("gate_up", b13, (num_local, rows13)), ("down", b2, (num_local, hidden))):
        if b is not None and (tuple(b.shape) != want or b.stride(-1) != 1):
            raise ValueError(f"small_batch_moe: {name} bias {tuple(b.shape)}; expected {want}, contiguous in the "
                             f"last dimension")
    blocks_down = triton.cdiv(hidden, cfg.block_n_down)
    if counters is None:
        counters = torch.zeros(num_tokens * blocks_down, dtype=torch.int32, device=x.device)
    elif counters.dtype != torch.int32 or counters.numel() < num_tokens * blocks_down:
        raise ValueError(f"small_batch_moe: {num_tokens * blocks_down} int32 counters needed, got "
                         f"{counters.numel()} {counters.dtype}")
    x = x.contiguous()
    ids = topk_ids.contiguous()
    weights = topk_weights.contiguous()
    slots = top_k + chunks
    inter_out = torch.empty((num_tokens * slots, inter), dtype=x.dtype, device=x.device)
    partial = torch.empty((num_tokens * slots, hidden), dtype=torch.float32, device=x.device)
    sw13 = w13 if shared_w13 is None else shared_w13
    sw2 = w2 if shared_w2 is None else shared_w2
    ss13, ss2 = shared_scales if shared_scales is not None and chunks else (q13[0], q2[0])  # (placeholders)
    fp32 = x.dtype == torch.float32
    opts = {} if interp else {"num_warps": cfg.warps, "num_stages": cfg.stages, **pdl.launch_opts(x)}
    launch(_small_gate_up_kernel, (num_tokens * slots, triton.cdiv(inter, cfg.block_n_gate_up)), x, w13, sw13,
           inter_out, ids, top_k, slots, expert_offset, num_local, inter, shared_inter, hidden, x.stride(0),
           w13.stride(0), w13.stride(1), sw13.stride(-2), inter_out.stride(0), *q13, ss13, ss13.stride(0),
           w13 if b13 is None else b13, 0 if b13 is None else b13.stride(0), act.alpha, act.limit,
           BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k_gate_up, FP32=fp32, QUANT=quant, HAS_BIAS=b13 is not None,
           ACT=act.code, **opts)
    launch(_small_down_kernel, (num_tokens * slots, blocks_down), inter_out, w2, sw2, out, partial, counters,
           weights, ids, top_k, slots, expert_offset, num_local, hidden, inter, inter_out.stride(0), w2.stride(0),
           w2.stride(1), sw2.stride(-2), out.stride(0), *q2, ss2, ss2.stride(0), w2 if b2 is None else b2,
           0 if b2 is None else b2.stride(0), S_PAD=triton.next_power_of_2(slots), BLOCK_N=cfg.block_n_down,
           BLOCK_K=cfg.block_k_down, FP32=fp32, QUANT=quant, HAS_BIAS=b2 is not None, **opts)
    return out


def _check_shared_scales(scales: ExpertScales | None, shared: tuple[torch.Tensor, torch.Tensor] | None,
                         shared_inter: int, hidden: int, inter: int) -> None:
    """A shared MLP riding along: 16-bit with 16-bit experts, fp8 with scales of the experts' form with fp8 ones."""
    if (scales is None) != (shared is None):
        raise ValueError("small_batch_moe: an fp8 shared MLP goes with fp8 experts (and shared_scales with both)")
    if scales is None:
        return
    s13, s2 = shared
    gn, gk13, gk2 = scales.group_n, scales.group_k13, scales.group_k2
    if fp8_form(scales) == 1:  # one scale over each row (block) of K
        want13, want2 = (-(-2 * shared_inter // gn), 1), (-(-hidden // gn), 1)
    else:
        if inter % gk2:
            raise ValueError(f"small_batch_moe: a block-wise shared MLP needs the experts' intermediate size {inter} "
                             f"to be a multiple of the block {gk2}")
        want13 = (-(-2 * shared_inter // gn), -(-hidden // gk13))
        want2 = (-(-hidden // gn), shared_inter // gk2)
    for name, t, want in (("gate_up", s13, want13), ("down", s2, want2)):
        if tuple(t.shape) != want or t.dtype != torch.float32 or t.stride(-1) != 1:
            raise ValueError(f"small_batch_moe: shared {name} scales {tuple(t.shape)} {t.dtype}; expected float32 "
                             f"{want}, contiguous in the last dimension")


def fp8_form(scales: ExpertScales | None) -> int:
    """The kernels' QUANT for these scales: 0 = 16/32-bit weights, 1 = a scale per row (or per row block, with one
    group over the whole K: on the CUDA cores, applied after the loop), 2 = per block through `tl.dot` (each K step's
    products scaled), 3 = per block on the CUDA cores (`FP8_BLOCKS_FORM` "rows", where the groups allow runs of 8)."""
    if scales is None:
        return 0
    if scales.w13.shape[2] == 1 and scales.w2.shape[2] == 1:
        return 1
    rows_fit = all(g % 8 == 0 and g & (g - 1) == 0 for g in (scales.group_k13, scales.group_k2))
    return 3 if FP8_BLOCKS_FORM == "rows" and rows_fit else 2


_TILES = (DEFAULT, DEFAULT_FP8_ROWS, DEFAULT_FP8_BLOCKS, DEFAULT_FP8_ROWS)  # by `fp8_form`


def default_config(scales: ExpertScales | None) -> SmallMoEConfig:
    """The GPU tile for these experts (before a block-wise form's K step is cut to its scale group)."""
    return _TILES[fp8_form(scales)]


COUNTER_TOKENS = 64  # the largest SMALL_BATCH_TOKENS a layer's counter buffer serves


def counters_needed(hidden: int, config: SmallMoEConfig | None = None) -> int:
    """int32 counters `small_batch_moe` needs for up to COUNTER_TOKENS tokens (one per token and output block)."""
    cfg = config or DEFAULT
    return COUNTER_TOKENS * triton.cdiv(hidden, min(cfg.block_n_down, INTERPRETED.block_n_down))
