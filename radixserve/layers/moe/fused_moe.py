"""The experts as two grouped GEMMs in Triton.

1. Align (`moe_align_block_size`: a parallel count whose last program lays out the buckets, a parallel scatter;
   no host sync): the token→expert assignments (T·k of them, numbered t·k + j) are bucketed by expert and each
   bucket padded to a multiple of BLOCK_M, so every block of BLOCK_M rows belongs to one expert. `sorted_ids` lists
   assignment numbers (padding = T·k), `expert_ids` the expert of each block, `total` the padded length. The grid
   is sized from shapes alone (an upper bound on the blocks; programs past `total` return at once), so it can be
   captured in a CUDA graph.
2. Gate/up: per block, rows x[assignment // k] times the expert's gate and up columns, the activation (SiLU(gate)·up,
   or GPT-OSS's, with its biases; or, for non-gated experts (Nemotron 3), relu(up)² of the up columns alone:
   `activation.py`) in registers, one store of the activated [T·k, I] intermediate: the [T·k, 2I] gate/up product
   never reaches memory.
3. Down: per block, intermediate rows times the expert's W_down, times the routing weight, stored per assignment;
   then one sum over each token's k rows (`moe_sum`).

Experts not held on this rank (expert parallelism) are left out in the align step; their assignments' rows stay
zero. Block sizes come from `moe_config(...)` per shape.

fp8 experts (`ExpertScales`: a float32 scale per block of each expert's matrix, per row or 128 x 128): with 16-bit
activations x and the intermediate are quantised per row and 128 columns and both GEMMs run on the fp8 tensor
cores, each K step's product times its two scales (W8A8, `_a8dot`, tiles `TUNED_FP8`); float32 models, and scale
groups too short for the fp8 product's 32-column K step, widen the weight tile instead (W8A16, `_wdot`).
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

import torch
import triton
import triton.language as tl

from radixserve.layers.moe.activation import SILU, ExpertActivation, ExpertBias
from radixserve.layers.triton_ops.device_buffers import kept_buffer
from radixserve.layers.triton_ops.launch import launch

if TYPE_CHECKING:
    from radixserve.layers.moe.methods import ExpertScales


@triton.jit(do_not_specialize=["n", "num_programs"])
def _align_count_kernel(Ids, State, Bounds, Total, n, offset, num_local, num_programs, BLOCK_M: tl.constexpr,
                        E_PAD: tl.constexpr, CHUNK: tl.constexpr):
    """Per-expert counts of one chunk of assignments, added into State[:E_PAD] (the last bin collects the padding
    lanes and experts held by other ranks); the program that draws the last ticket (State[E_PAD]) lays the buckets
    out in Bounds: [0, E_PAD) each bucket's first row (the scatter's cursors), [E_PAD, 2 E_PAD) the end of its
    assignments, [2 E_PAD, 3 E_PAD) its padded end; and the padded total. It reads the counts back by exchanging
    them for zeros and puts the ticket back to 0, so State is zero again between launches and CUDA-graph
    replays."""
    offs = tl.program_id(0) * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(Ids + offs, mask=offs < n, other=-1).to(tl.int32) - offset
    held = (offs < n) & (e >= 0) & (e < num_local)
    offs_e = tl.arange(0, E_PAD)
    tl.atomic_add(State + offs_e, tl.histogram(tl.where(held, e, E_PAD - 1), E_PAD), sem="relaxed", scope="gpu")
    tl.debug_barrier()  # every thread's counts are added before the ticket is drawn
    if tl.atomic_add(State + E_PAD, 1, sem="acq_rel", scope="gpu") == num_programs - 1:
        counts = tl.atomic_xchg(State + offs_e, tl.zeros([E_PAD], dtype=tl.int32), sem="relaxed", scope="gpu")
        counts = tl.where(offs_e < num_local, counts, 0)
        padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
        pad_end = tl.cumsum(padded, 0)
        tl.store(Bounds + offs_e, pad_end - padded)
        tl.store(Bounds + E_PAD + offs_e, pad_end - padded + counts)
        tl.store(Bounds + 2 * E_PAD + offs_e, pad_end)
        tl.store(Total, tl.sum(padded, 0))
        tl.atomic_xchg(State + E_PAD, 0, sem="relaxed", scope="gpu")


@triton.jit(do_not_specialize=["n", "max_blocks"])
def _align_scatter_kernel(Ids, Sorted, ExpertIds, Bounds, n, offset, num_local, max_blocks, BLOCK_M: tl.constexpr,
                          E_PAD: tl.constexpr, CHUNK: tl.constexpr, BLOCKS: tl.constexpr, PAD_E: tl.constexpr):
    """Each held assignment of this program's chunk takes the next free row of its expert's bucket (the order within
    a bucket does not change any result: every row of a GEMM tile is computed on its own). The programs also share
    out the rest of the layout: the expert of BLOCKS blocks each, and the padding rows (assignment number n) at the
    end of PAD_E buckets each. Rows past the total are left unwritten: no GEMM program reads them."""
    pid = tl.program_id(0)
    offs = pid * CHUNK + tl.arange(0, CHUNK)
    e = tl.load(Ids + offs, mask=offs < n, other=-1).to(tl.int32) - offset
    held = (offs < n) & (e >= 0) & (e < num_local)
    slot = tl.atomic_add(Bounds + tl.where(held, e, 0), 1, mask=held)
    tl.store(Sorted + slot, offs.to(tl.int32), mask=held)
    offs_e = tl.arange(0, E_PAD)
    pad_end = tl.load(Bounds + 2 * E_PAD + offs_e, mask=offs_e < num_local, other=2147483647)
    offs_b = pid * BLOCKS + tl.arange(0, BLOCKS)
    # a block's expert: how many experts end at or before its first row (blocks past the total get the last)
    eid = tl.sum((pad_end[None, :] <= (offs_b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
    tl.store(ExpertIds + offs_b, tl.minimum(eid, num_local - 1), mask=offs_b < max_blocks)
    ex = pid * PAD_E + tl.arange(0, PAD_E)
    ok = ex < num_local
    first = tl.load(Bounds + E_PAD + ex, mask=ok, other=0)
    last = tl.load(Bounds + 2 * E_PAD + ex, mask=ok, other=0)
    j = tl.arange(0, BLOCK_M)
    tl.store(Sorted + first[:, None] + j[None, :], tl.zeros([PAD_E, BLOCK_M], dtype=tl.int32) + n,
             mask=ok[:, None] & (first[:, None] + j[None, :] < last[:, None]))


@triton.jit(do_not_specialize=["n", "max_blocks"])
def _align_small_kernel(Ids, Sorted, ExpertIds, Total, Cursor, n, offset, num_local, max_blocks,
                        BLOCK_M: tl.constexpr, E_PAD: tl.constexpr, N_PAD: tl.constexpr, BLOCKS: tl.constexpr,
                        FILL: tl.constexpr):
    """All of the align in one program, for batches of at most N_PAD assignments (decode): one launch instead of
    five. The same buckets as the parallel path (the order inside a bucket aside)."""
    offs = tl.arange(0, N_PAD)
    e = tl.load(Ids + offs, mask=offs < n, other=-1).to(tl.int32) - offset
    held = (offs < n) & (e >= 0) & (e < num_local)
    counts = tl.histogram(tl.where(held, e, E_PAD - 1), E_PAD)
    offs_e = tl.arange(0, E_PAD)
    counts = tl.where(offs_e < num_local, counts, 0)
    padded = (counts + BLOCK_M - 1) // BLOCK_M * BLOCK_M
    pad_end = tl.cumsum(padded, 0)
    tl.store(Cursor + offs_e, pad_end - padded)  # each bucket's next free row starts at its first
    tl.store(Total, tl.sum(padded, 0))
    for b0 in range(0, max_blocks, BLOCKS):
        offs_b = b0 + tl.arange(0, BLOCKS)
        eid = tl.sum((pad_end[None, :] <= (offs_b * BLOCK_M)[:, None]).to(tl.int32), axis=1)
        tl.store(ExpertIds + offs_b, tl.minimum(eid, num_local - 1), mask=offs_b < max_blocks)
    rows = max_blocks * BLOCK_M
    for r0 in range(0, rows, FILL):
        offs_r = r0 + tl.arange(0, FILL)
        tl.store(Sorted + offs_r, tl.full([FILL], 0, tl.int32) + n, mask=offs_r < rows)
    tl.debug_barrier()  # the padding is written (and the cursors) before any thread places its assignment
    slot = tl.atomic_add(Cursor + tl.where(held, e, 0), 1, mask=held)
    tl.store(Sorted + slot, offs.to(tl.int32), mask=held)


SMALL_ALIGN = 1024  # assignments (tokens x top-k) up to which the one-program align runs
ALIGN_CHUNK = 1024  # assignments a program of the parallel align's count
ALIGN_SCATTER_CHUNK = 256  # assignments a program of its scatter
_ALIGN_PAD_E = 8  # buckets a scatter program pads
def _align_state(device: torch.device, e_pad: int) -> torch.Tensor:
    """The parallel align's e_pad counts and its ticket on a device (zero between launches). Layers run one after
    another on a device's stream, so one state serves them all."""
    return kept_buffer(f"moe align state {e_pad}", device, lambda d: torch.zeros(e_pad + 1, dtype=torch.int32,
                                                                                   device=d))


@dataclass
class AlignedAssignments:
    sorted_ids: torch.Tensor  # int32 [max_blocks * block_m]: assignment numbers, padding = T·k
    expert_ids: torch.Tensor  # int32 [max_blocks]: local expert of each block
    total: torch.Tensor  # int32 [1]: padded rows in use
    max_blocks: int
    block_m: int


def moe_align_block_size(topk_ids: torch.Tensor, block_m: int, num_local: int,
                         expert_offset: int = 0) -> AlignedAssignments:
    """Bucket the assignments by (local) expert, each bucket padded to a multiple of block_m, without waiting for
    the host: one program for a decode-sized batch, else two launches (a parallel count whose last program lays out
    the buckets, then a parallel scatter). Rows past `total` are left unwritten: no GEMM program reads them."""
    n = topk_ids.numel()
    max_blocks = triton.cdiv(n + min(num_local, n) * (block_m - 1), block_m)
    dev = topk_ids.device
    e_pad = triton.next_power_of_2(num_local + 1)
    if n <= SMALL_ALIGN:
        sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
        expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
        total = torch.empty(1, dtype=torch.int32, device=dev)
        cursor = torch.empty(e_pad, dtype=torch.int32, device=dev)
        launch(_align_small_kernel, (1,), topk_ids.reshape(-1), sorted_ids, expert_ids, total, cursor, n,
               expert_offset, num_local, max_blocks, BLOCK_M=block_m, E_PAD=e_pad,
               N_PAD=max(16, triton.next_power_of_2(n)), BLOCKS=64, FILL=256, num_warps=4)
        return AlignedAssignments(sorted_ids, expert_ids, total, max_blocks, block_m)
    sorted_ids = torch.empty(max_blocks * block_m, dtype=torch.int32, device=dev)
    expert_ids = torch.empty(max_blocks, dtype=torch.int32, device=dev)
    total = torch.empty(1, dtype=torch.int32, device=dev)
    bounds = torch.empty(3 * e_pad, dtype=torch.int32, device=dev)
    ids = topk_ids.reshape(-1)
    counting = triton.cdiv(n, ALIGN_CHUNK)
    launch(_align_count_kernel, (counting,), ids, _align_state(dev, e_pad), bounds, total, n, expert_offset, num_local,
           counting, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=ALIGN_CHUNK, num_warps=4)
    # the scatter's programs: one a chunk of assignments, and enough for the blocks' experts (a [blocks, e_pad]
    # comparison each) and the buckets' padding. Its constexprs depend on the model and block_m alone, so that no
    # batch size compiles a variant of its own while serving (`precompile` builds each block_m's).
    blocks = max(16, min(64, 8192 // e_pad))
    programs = max(triton.cdiv(n, ALIGN_SCATTER_CHUNK), triton.cdiv(max_blocks, blocks),
                   triton.cdiv(num_local, _ALIGN_PAD_E))
    launch(_align_scatter_kernel, (programs,), ids, sorted_ids, expert_ids, bounds, n, expert_offset, num_local,
           max_blocks, BLOCK_M=block_m, E_PAD=e_pad, CHUNK=ALIGN_SCATTER_CHUNK, BLOCKS=blocks, PAD_E=_ALIGN_PAD_E,
           num_warps=4)
    return AlignedAssignments(sorted_ids, expert_ids, total, max_blocks, block_m)


@triton.jit
def _mma(a, b, FP32: tl.constexpr):
    if FP32:
        return tl.dot(a, b, input_precision="ieee")
    else:
        return tl.dot(a, b)


@triton.jit
def _wdot(a, w, S, s_cols, s_ok, k0, group_k, QUANT: tl.constexpr, FP32: tl.constexpr):
    """a [M, BLOCK_K] @ w [BLOCK_K, BLOCK_N]. QUANT: w is fp8, widened to a's dtype (exact), and the step's product
    scaled by each column's scale for the K group the step lies in (S + s_cols: the columns' scale rows, float32;
    a step never spans two groups: the wrapper keeps BLOCK_K a divisor of group_k)."""
    if QUANT:
        part = _mma(a, w.to(a.dtype), FP32)
        part = part * tl.load(S + s_cols + k0 // group_k, mask=s_ok, other=0.0)[None, :]
    else:
        part = _mma(a, w, FP32)
    return part


@triton.jit
def _block_ids(N_FIRST: tl.constexpr):
    """(row block, column block) of this program. N_FIRST: the grid's first (fastest) axis is the column block, so
    the programs running at once share a few row blocks (their gathered rows of x stay in the L2 across the column
    blocks) and an expert's weight tiles are reused by its row blocks while still cached; else the row block."""
    if N_FIRST:  # one return after the branch: a return inside a constexpr branch followed by another is not
        pid_m = tl.program_id(1)  # compiled as it is interpreted (perf-log.md, "A check that needs no GPU")
        pid_n = tl.program_id(0)
    else:
        pid_m = tl.program_id(0)
        pid_n = tl.program_id(1)
    return pid_m, pid_n


@triton.jit
def _a8dot(a, w, a_scales, a_ok, S, s_cols, s_ok, k0, group_k, act_group):
    """a [M, BLOCK_K] fp8 (per row and act_group columns scaled: a_scales, each row's scale row) @ w [BLOCK_K,
    BLOCK_N] fp8 on the fp8 tensor cores, the step's product times both operands' scales (W8A8)."""
    part = tl.dot(a, w)
    sa = tl.load(a_scales + k0 // act_group, mask=a_ok, other=0.0)
    sw = tl.load(S + s_cols + k0 // group_k, mask=s_ok, other=0.0)
    return part * sa[:, None] * sw[None, :]


# Sizes that change with the batch are not specialised on (a value of 1 or a multiple of 16 would otherwise compile
# a variant of its own mid-serving, the first time some batch produced it).
@triton.jit(do_not_specialize=["num_valid"])
def _gate_up_kernel(X, W13, Inter, Sorted, ExpertIds, Total, num_valid, top_k, inter_size, hidden,
                    stride_x, stride_we, stride_wn, stride_i, Scale, stride_se, stride_sn, group_n, group_k,
                    XScale, stride_xs, act_group, Bias, stride_be, alpha, limit,
                    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr,
                    N_FIRST: tl.constexpr, QUANT: tl.constexpr = False, A8: tl.constexpr = False,
                    HAS_BIAS: tl.constexpr = False, ACT: tl.constexpr = 0):
    """QUANT: W13 is fp8 with float32 scales [E, rows / group_n, hidden / group_k] (`_wdot`). A8: X is fp8 too,
    scaled per row and act_group columns (XScale), and the product runs on the fp8 tensor cores (`_a8dot`).
    HAS_BIAS: Bias [E, 2I] (gate then up) is added to the products; ACT (`ExpertActivation.code`): 0 SiLU(gate)·up,
    1 GPT-OSS's clamped gate·sigmoid(alpha·gate)·(up + 1), 2 relu(up)² with W13 [E, I, H] holding the up rows alone
    (not gated: no gate column is read; Bias [E, I])."""
    pid_m, pid_n = _block_ids(N_FIRST)
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(Sorted + offs_m)
    row_ok = rows < num_valid
    tok = (rows // top_k).to(tl.int64)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < inter_size
    offs_k = tl.arange(0, BLOCK_K)
    x_ptrs = X + tok[:, None] * stride_x + offs_k[None, :]
    if ACT == 2:  # not gated: the up rows come first (and alone)
        up_rows = 0
    else:
        up_rows = inter_size
    wg_ptrs = W13 + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    wu_ptrs = wg_ptrs + up_rows * stride_wn
    sg_cols = expert * stride_se + (offs_n // group_n) * stride_sn  # the gate and up columns' scale rows
    su_cols = expert * stride_se + ((up_rows + offs_n) // group_n) * stride_sn
    acc_g = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, hidden, BLOCK_K):
        k_ok = offs_k < hidden - k0
        x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        if ACT != 2:  # (non-gated: no gate column is read)
            wg = tl.load(wg_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        wu = tl.load(wu_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if A8:
            if ACT != 2:
                acc_g += _a8dot(x, wg, XScale + tok * stride_xs, row_ok, Scale, sg_cols, n_ok, k0, group_k,
                                act_group)
            acc_u += _a8dot(x, wu, XScale + tok * stride_xs, row_ok, Scale, su_cols, n_ok, k0, group_k, act_group)
        else:
            if ACT != 2:
                acc_g += _wdot(x, wg, Scale, sg_cols, n_ok, k0, group_k, QUANT, FP32)
            acc_u += _wdot(x, wu, Scale, su_cols, n_ok, k0, group_k, QUANT, FP32)
        x_ptrs += BLOCK_K
        wg_ptrs += BLOCK_K
        wu_ptrs += BLOCK_K
    if HAS_BIAS:
        b_ptrs = Bias + expert * stride_be + offs_n
        if ACT != 2:
            acc_g += tl.load(b_ptrs, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        acc_u += tl.load(b_ptrs + up_rows, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    if ACT == 0:
        act = acc_g / (1.0 + tl.exp(-acc_g)) * acc_u
    elif ACT == 1:
        g = tl.minimum(acc_g, limit)
        u = tl.minimum(tl.maximum(acc_u, -limit), limit)
        act = g / (1.0 + tl.exp(-alpha * g)) * (u + 1.0)
    else:
        r = tl.maximum(acc_u, 0.0)
        act = r * r
    out_ptrs = Inter + rows[:, None].to(tl.int64) * stride_i + offs_n[None, :]
    tl.store(out_ptrs, act.to(Inter.dtype.element_ty), mask=row_ok[:, None] & n_ok[None, :])


@triton.jit(do_not_specialize=["num_valid"])
def _down_kernel(Inter, W2, Out, Weights, Sorted, ExpertIds, Total, num_valid, hidden, inter_size,
                 stride_i, stride_we, stride_wn, stride_o, Scale, stride_se, stride_sn, group_n, group_k,
                 XScale, stride_xs, act_group, Bias, stride_be,
                 BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FP32: tl.constexpr,
                 N_FIRST: tl.constexpr, QUANT: tl.constexpr = False, A8: tl.constexpr = False,
                 HAS_BIAS: tl.constexpr = False):
    """HAS_BIAS: Bias [E, H] is added to the product before the routing weight."""
    pid_m, pid_n = _block_ids(N_FIRST)
    if pid_m * BLOCK_M >= tl.load(Total):
        return
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rows = tl.load(Sorted + offs_m)
    row_ok = rows < num_valid
    rows64 = rows.to(tl.int64)
    expert = tl.load(ExpertIds + pid_m).to(tl.int64)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = offs_n < hidden
    offs_k = tl.arange(0, BLOCK_K)
    a_ptrs = Inter + rows64[:, None] * stride_i + offs_k[None, :]
    w_ptrs = W2 + expert * stride_we + offs_n[None, :].to(tl.int64) * stride_wn + offs_k[:, None]
    s_cols = expert * stride_se + (offs_n // group_n) * stride_sn
    acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for k0 in range(0, inter_size, BLOCK_K):
        k_ok = offs_k < inter_size - k0
        a = tl.load(a_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
        w = tl.load(w_ptrs, mask=k_ok[:, None] & n_ok[None, :], other=0.0)
        if A8:
            acc += _a8dot(a, w, XScale + rows64 * stride_xs, row_ok, Scale, s_cols, n_ok, k0, group_k, act_group)
        else:
            acc += _wdot(a, w, Scale, s_cols, n_ok, k0, group_k, QUANT, FP32)
        a_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    if HAS_BIAS:
        acc += tl.load(Bias + expert * stride_be + offs_n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
    weight = tl.load(Weights + rows64, mask=row_ok, other=0.0)
    acc = acc * weight[:, None]
    tl.store(Out + rows64[:, None] * stride_o + offs_n[None, :], acc.to(Out.dtype.element_ty),
             mask=row_ok[:, None] & n_ok[None, :])


@triton.jit
def _moe_sum_kernel(Rows, Out, hidden, K: tl.constexpr, BLOCK_H: tl.constexpr):
    """Out[t] = the sum of token t's K down-projection rows (already weighted), in float32, one rounding."""
    t = tl.program_id(0).to(tl.int64)
    offs = tl.program_id(1) * BLOCK_H + tl.arange(0, BLOCK_H)
    ok = offs < hidden
    acc = tl.zeros([BLOCK_H], dtype=tl.float32)
    for j in tl.static_range(K):
        acc += tl.load(Rows + (t * K + j) * hidden + offs, mask=ok, other=0.0).to(tl.float32)
    tl.store(Out + t * hidden + offs, acc.to(Out.dtype.element_ty), mask=ok)


def moe_sum(rows: torch.Tensor, num_tokens: int, top_k: int, interpreted: bool = False) -> torch.Tensor:
    """rows [T·k, H] contiguous -> [T, H]: `rows.view(T, k, H).sum(dim=1)` in one pass at the copy bandwidth
    (torch's reduction over the middle dim ran at a third of it)."""
    hidden = rows.shape[1]
    if rows.shape[0] != num_tokens * top_k or not rows.is_contiguous():
        raise ValueError(f"moe_sum: rows {tuple(rows.shape)} are not {num_tokens} x {top_k} contiguous rows")
    out = torch.empty((num_tokens, hidden), dtype=rows.dtype, device=rows.device)
    block_h = 64 if interpreted else min(1024, triton.next_power_of_2(hidden))
    if num_tokens:
        launch(_moe_sum_kernel, (num_tokens, triton.cdiv(hidden, block_h)), rows, out, hidden, K=top_k,
               BLOCK_H=block_h, **({} if interpreted else {"num_warps": 4}))
    return out


@dataclass(frozen=True)
class MoEConfig:
    block_m: int
    block_n_gate_up: int
    block_n_down: int
    block_k: int
    num_warps: int
    num_stages: int
    n_first: bool = True  # the grid's order (`_block_ids`)


MIN_FP8_K = 32  # the fp8 tensor-core product's shortest K step
ACT_GROUP = 128  # columns an fp8 activation scale covers in the W8A8 grouped GEMMs (as the block-wise checkpoints)
MAX_GRID_Y = 65535  # CUDA's limit on a grid's second axis: more row blocks than this launch row-block-first

# Per-shape overrides: (experts held, intermediate per rank, hidden) -> {max tokens: config}; the first entry whose
# bound covers the batch wins. Shapes not listed use the heuristic below.
TUNED: dict[tuple[int, int, int], dict[int, MoEConfig]] = {
    # Qwen3-30B-A3B (128 experts, 768, 2048), H200, benchmarks/bench_moe_kernels.py --sweep-large: at 128 tokens
    # 305 us a layer (92.5% of the copy bandwidth; the heuristic's pick), at 512 tokens 338 us (83.6%) against
    # the heuristic's 366 us (77.1%)
    # H100, --tokens 1024 2048 4096 --sweep-large --one-order: 2048 tokens as the heuristic's 64-row tile (598 us);
    # at 4096 (256 an expert) 128-row blocks 256 wide, 905 us against the heuristic's 1,015 us
    (128, 768, 2048): {128: MoEConfig(16, 32, 64, 128, 4, 4), 1024: MoEConfig(64, 64, 128, 64, 4, 3),
                       4096: MoEConfig(128, 128, 256, 64, 8, 3)},
    # DeepSeek-V2-Lite (64 experts, 1408, 2048), H200, the same sweep: at 128 tokens the heuristic's pick (311 us,
    # 85.8%); at 256 tokens 328 us (81.4%) against the heuristic's 339 us; at 512 tokens (48 an expert) 365 us
    # (73.1%) against the heuristic's 32-row blocks at 443 us (60.3%). H100, --tokens 1024 2048 4096: 128-row
    # blocks at 1,024 tokens (96 an expert; a decode batch of 1,024 requests) 520 us against 548, at 2,048 781 us
    # against the heuristic's 64-row 840 us (above 2,730 tokens the heuristic takes 128 rows)
    (64, 1408, 2048): {128: MoEConfig(16, 32, 64, 128, 4, 4), 256: MoEConfig(32, 64, 128, 128, 4, 3),
                       512: MoEConfig(64, 64, 128, 64, 4, 3), 1024: MoEConfig(128, 64, 256, 64, 8, 3),
                       2048: MoEConfig(128, 128, 128, 64, 8, 4)},
}

# The same for fp8 experts with fp8 activations (W8A8). Qwen3-30B-A3B, H200, benchmarks/bench_moe_kernels.py
# --tokens 256 512 --sweep-large --one-order --fp8 channel, µs a layer: 256 tokens 212.0 (bf16's tile for the size:
# 295.4; bf16 weights 306.7), 512 tokens 246.6 (313.6; 315.3). Up to 128 tokens bf16's tile (212.5 at 256).
TUNED_FP8: dict[tuple[int, int, int], dict[int, MoEConfig]] = {
    (128, 768, 2048): {128: MoEConfig(16, 32, 64, 128, 4, 4), 256: MoEConfig(32, 64, 128, 128, 4, 3),
                       1024: MoEConfig(64, 64, 64, 128, 4, 4)},
}


def fp8_activations(scales: ExpertScales | None, dtype: torch.dtype, hidden: int, inter: int,
                    act_group: int = ACT_GROUP) -> bool:
    """Whether `fused_moe` quantises the activations by default (W8A8): fp8 weights with 16-bit activations whose
    widths are multiples of `act_group`, every K step at least MIN_FP8_K columns."""
    return _a8_possible(scales, hidden, inter, act_group) and dtype in (torch.bfloat16, torch.float16)


def _a8_possible(scales: ExpertScales | None, hidden: int, inter: int, act_group: int) -> bool:
    return scales is not None and not hidden % act_group and not inter % act_group \
        and min(act_group, scales.group_k13, scales.group_k2) >= MIN_FP8_K


def moe_config(num_tokens: int, top_k: int, num_experts: int, inter_size: int, hidden: int,
               interpreted: bool = False, fp8: bool = False) -> MoEConfig:
    """Block sizes for a batch: small row blocks when few tokens reach each expert (decode: the kernel reads the
    weights, and a 16-row block wastes the least), larger ones when experts see many tokens (prefill: reuse).
    `fp8`: the W8A8 products (fp8 weights and activations), which take `TUNED_FP8` where it has the shape."""
    key = (num_experts, inter_size, hidden)
    tuned = TUNED_FP8[key] if fp8 and key in TUNED_FP8 else TUNED.get(key, {})
    for bound, cfg in sorted(tuned.items()):
        if num_tokens <= bound:
            return cfg
    if interpreted:  # the CPU interpreter: small tiles keep the tests quick
        return MoEConfig(16, 16, 16, 16, 1, 1)
    per_expert = num_tokens * top_k / max(1, num_experts)
    if per_expert <= 16:
        return MoEConfig(16, 32, 64, 128, 4, 4)
    if per_expert <= 64:
        return MoEConfig(32, 64, 64, 64, 4, 4)
    if per_expert <= 256:
        return MoEConfig(64, 64, 128, 64, 4, 3)
    return MoEConfig(128, 128, 128, 64, 8, 3)


def scale_args(scales: ExpertScales | None, w13: torch.Tensor, w2: torch.Tensor) -> tuple[tuple, tuple]:
    """The kernels' (Scale, stride_se, stride_sn, group_n, group_k) for w13 and w2; placeholders (the weight
    itself, never read) when the weights are not fp8."""
    if scales is None:
        return (w13, 0, 0, 1, 1), (w2, 0, 0, 1, 1)
    s13, s2 = scales.w13, scales.w2
    return ((s13, s13.stride(0), s13.stride(1), scales.group_n, scales.group_k13),
            (s2, s2.stride(0), s2.stride(1), scales.group_n, scales.group_k2))


def fused_moe(x: torch.Tensor, w13: torch.Tensor, w2: torch.Tensor, topk_weights: torch.Tensor,
              topk_ids: torch.Tensor, expert_offset: int = 0, num_global_experts: int | None = None,
              config: MoEConfig | None = None, scales: ExpertScales | None = None, act_fp8: bool | None = None,
              act_group: int = ACT_GROUP, act: ExpertActivation = SILU, bias: ExpertBias | None = None
              ) -> torch.Tensor:
    """The same result as `moe_forward_torch` (x [T, H], w13 [E, 2I, H] ([E, I, H] for a non-gated `act`),
    w2 [E, H, I], topk_* [T, k] with global expert ids; this rank holds experts expert_offset .. expert_offset + E - 1
    of `num_global_experts`). With `scales` the weights are fp8: with `act_fp8` the activations (x, then the
    intermediate) are quantised per row and `act_group` columns and both products run on the fp8 tensor cores (W8A8,
    as the dense fp8 layers do above 16 rows); else the weights are widened in the kernels (W8A16). `act_fp8` None:
    W8A8 for 16-bit activations whose widths are multiples of act_group. `act` / `bias`: the experts' activation
    (GPT-OSS's, Nemotron 3's) and biases (GPT-OSS's)."""
    num_tokens, hidden = x.shape
    num_local, inter = w13.shape[0], w2.shape[2]
    top_k = topk_ids.shape[1]
    rows13 = act.w13_rows(inter)
    if w13.shape != (num_local, rows13, hidden) or w2.shape != (num_local, hidden, inter):
        raise ValueError(f"fused_moe: w13 {tuple(w13.shape)} / w2 {tuple(w2.shape)} do not match hidden {hidden}")
    if num_tokens == 0:
        return torch.zeros_like(x)
    from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted

    interp = is_interpreted()
    if act_fp8 is None:
        act_fp8 = fp8_activations(scales, x.dtype, hidden, inter, act_group)
    if act_fp8 and not _a8_possible(scales, hidden, inter, act_group):
        raise ValueError(f"fused_moe: fp8 activations need fp8 weights, widths ({hidden}, {inter}) that are "
                         f"multiples of the activation group {act_group}, and scale groups of at least "
                         f"{MIN_FP8_K} columns (the fp8 product's shortest K step)")
    cfg = config or moe_config(num_tokens, top_k, num_local, inter, hidden, interp, fp8=act_fp8)
    if scales is not None:  # a K step within one scale group (and one activation group)
        cfg = replace(cfg, block_k=min(cfg.block_k, scales.group_k13, scales.group_k2,
                                       act_group if act_fp8 else cfg.block_k))
    q13, q2 = scale_args(scales, w13, w2)
    b13 = bias.w13 if bias is not None else None
    b2 = bias.w2 if bias is not None else None
    if b13 is not None and b13.shape != (num_local, rows13) or b2 is not None and b2.shape != (num_local, hidden):
        raise ValueError(f"fused_moe: expert biases {tuple(b13.shape) if b13 is not None else None} / "
                         f"{tuple(b2.shape) if b2 is not None else None} do not match the weights")
    dtype = x.dtype
    x = x.contiguous()
    xs = x  # placeholders when the activations stay 16-bit
    if act_fp8:
        from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

        x, xs = per_token_group_quant_fp8(x, act_group)
    n = num_tokens * top_k
    aligned = moe_align_block_size(topk_ids, cfg.block_m, num_local, expert_offset)
    inter_cache = torch.empty((n, inter), dtype=dtype, device=x.device)
    partial_held = num_global_experts is not None and num_global_experts != num_local
    out = (torch.zeros if partial_held else torch.empty)((n, hidden), dtype=dtype, device=x.device)
    fp32 = dtype == torch.float32
    opts = {} if interp else dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages)
    n_first = cfg.n_first and aligned.max_blocks <= MAX_GRID_Y

    def grid(n_blocks: int) -> tuple[int, int]:
        return (n_blocks, aligned.max_blocks) if n_first else (aligned.max_blocks, n_blocks)

    launch(_gate_up_kernel, grid(triton.cdiv(inter, cfg.block_n_gate_up)), x, w13, inter_cache,
           aligned.sorted_ids, aligned.expert_ids, aligned.total, n, top_k, inter, hidden, x.stride(0),
           w13.stride(0), w13.stride(1), inter_cache.stride(0), *q13, xs, xs.stride(0), act_group,
           w13 if b13 is None else b13, 0 if b13 is None else b13.stride(0), act.alpha, act.limit,
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_gate_up, BLOCK_K=cfg.block_k, FP32=fp32, N_FIRST=n_first,
           QUANT=scales is not None, A8=act_fp8, HAS_BIAS=b13 is not None, ACT=act.code, **opts)
    weights = topk_weights.reshape(-1).float().contiguous()
    inter_in, inter_s = inter_cache, inter_cache
    if act_fp8:
        inter_in, inter_s = per_token_group_quant_fp8(inter_cache, act_group)
    launch(_down_kernel, grid(triton.cdiv(hidden, cfg.block_n_down)), inter_in, w2, out,
           weights, aligned.sorted_ids, aligned.expert_ids, aligned.total, n, hidden, inter, inter_in.stride(0),
           w2.stride(0), w2.stride(1), out.stride(0), *q2, inter_s, inter_s.stride(0), act_group,
           w2 if b2 is None else b2, 0 if b2 is None else b2.stride(0),
           BLOCK_M=cfg.block_m, BLOCK_N=cfg.block_n_down, BLOCK_K=cfg.block_k, FP32=fp32, N_FIRST=n_first,
           QUANT=scales is not None, A8=act_fp8, HAS_BIAS=b2 is not None, **opts)
    return moe_sum(out, num_tokens, top_k, interp)



def precompile(model: torch.nn.Module, max_tokens: int, force: bool = False) -> int:
    """Compile the grouped-GEMM kernels for every block config that a batch of up to `max_tokens` tokens may pick
    (`moe_config`), by running each once on 16 tokens of the model's first MoE layer (in its weights' form: fp8
    experts compile their own variants) and the parallel align, which batches of more than SMALL_ALIGN assignments
    take, at each config's block_m, so that no large prefill in service pays Triton's compilation (seconds each;
    the start-up warm-up's short request reaches only the small-batch path). CUDA only, unless `force` (tests,
    under the interpreter). Returns how many configs ran."""
    from radixserve.layers.moe.layer import FusedMoE

    layer = next((m for m in model.modules() if isinstance(m, FusedMoE)), None)
    if layer is None or not (layer.w13_weight.is_cuda or force):
        return 0
    w13, w2 = layer.w13_weight, layer.w2_weight
    scales = layer.quant_method.expert_scales(layer)
    num_local, inter, hidden = w13.shape[0], w2.shape[2], w2.shape[1]
    top_k = layer.router.top_k
    first = layer.quant_method.small_batch_tokens(layer) + 1  # the fewest tokens the grouped path sees
    sizes, t = [], first
    while t < max_tokens:
        sizes.append(t)
        t *= 2
    sizes.append(max(max_tokens, first))
    dtype = layer.act_dtype if scales is not None else w13.dtype
    act_fp8 = layer.quant_method.activations_fp8(layer)
    fp8 = fp8_activations(scales, dtype, hidden, inter) if act_fp8 is None else act_fp8
    configs = list(dict.fromkeys(moe_config(n, top_k, num_local, inter, hidden, fp8=fp8) for n in sizes))
    rows = 16
    x = torch.zeros(rows, hidden, dtype=dtype, device=w13.device)
    ids = (torch.arange(rows * top_k, device=w13.device) % num_local).view(rows, top_k).to(torch.int32) \
        + layer.expert_offset
    weights = torch.full((rows, top_k), 1.0 / top_k, dtype=torch.float32, device=w13.device)
    many = torch.arange(SMALL_ALIGN + 1, device=w13.device, dtype=torch.int32) % num_local + layer.expert_offset
    for cfg in configs:
        fused_moe(x, w13, w2, weights, ids, layer.expert_offset, layer.num_experts, config=cfg, scales=scales,
                  act_fp8=act_fp8, act=layer.activation, bias=layer.expert_bias())
        moe_align_block_size(many, cfg.block_m, num_local, layer.expert_offset)  # the parallel align's kernels
    if w13.is_cuda:
        torch.cuda.synchronize(w13.device)
    return len(configs)
