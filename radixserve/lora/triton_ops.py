"""Batched LoRA kernels over rows grouped by adapter (see batch_info.py).

shrink: P[split, row, :] = x[row] @ A[slot]^T over one split of the input dimension (split-K: a decode row has
little work along the rank, so the input dimension is cut into up to 16 splits to fill the GPU and keep each
program's loop short; expand sums the partials in a fixed order, so results do not depend on timing).
expand: out[row, off_j : off_j + n_j] += scale[slot] * (sum over splits of P[:, row, j*R : (j+1)*R]) @ B[slot,
off_j : off_j + n_j, :]^T for each sub-projection j (q/k/v, gate/up) in one launch.

A program handles one group's block of BLOCK_M rows (one adapter: its weights are read once for the block); blocks
past a group's length exit at once, so under a CUDA graph the grid can cover every slot and the whole batch.

expand_stacked (the path for base layers whose weight the pool stacked with every slot's A, see pool.py): the base
GEMM has already computed y = x @ [W; A_0; ...; A_{S-1}]^T, i.e. the base output and every slot's shrink; one kernel
writes out[row] = y[row, :N] + scale[slot] * shrink(row, slot) @ B[slot]^T for every row (base rows copied). Its
programs walk the rows sorted by slot in blocks of BLOCK_M, so a block is mostly one adapter's rows: B's tile is
loaded once per block. A block of several adapters (a group boundary, or groups smaller than a block: 32 rows over
8 adapters) runs one dot over every slot's B tile, each row's shrink placed in its own slot's columns (while slots x
rank <= 256; past that, one slot after another).

expand_row (one row, as a batch-1 decode step has): the same sum without a dot, for the row's own slot only, and for
a [gate; up] layer optionally with SiLU(gate) * up in the same kernel (the activation the base layer's one-row GEMV
fuses into its epilogue), so an adapter adds one kernel per projection, not two.

Only `num_rows` is left unspecialised: the sizes, strides and offsets are fixed per layer, and Triton needs to know
they are multiples of 16 to move a row's elements 16 bytes at a time (without it, every load and store of a bf16
tile is one element wide). One compiled kernel per kind of layer and block configuration, all compiled at start
(manager.py)."""

from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

BLOCK_M = 16
MAX_SPLITS = 16
# Programmatic dependent launch of the one-row path's kernels (the stacked GEMV, the expand): level 1, each waits for
# the kernel before it to finish and only its launch overlaps (triton_ops/pdl.py). The adapters add a short kernel per
# projection to a batch-1 step, whose launch latency this hides: on an H200 at the 8B shape, batch-1 decode with an
# adapter at 0.85-0.96x the base model's with PDL and 0.80-0.83x without (docs/PERFORMANCE.md). None: RADIXSERVE_PDL.
ROW_PDL_LEVEL: int | None = 1
_MIXED_DOT_K = 256  # the stacked expand's one-dot path for blocks of several adapters: up to slots x rank = 256
_INTERPRET = os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


@triton.jit(do_not_specialize=["num_rows"])
def _shrink_kernel(X, A, P, GroupSlots, GroupStarts, GroupLens, Order, K, N, k_per_split, num_rows,
                   stride_x, stride_a_slot, stride_a_row,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, IEEE: tl.constexpr,
                   UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    split = tl.program_id(2)
    num_n = tl.cdiv(N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    length = tl.load(GroupLens + g)
    if pid_m * BLOCK_M >= length:
        return
    slot = tl.load(GroupSlots + g)
    start = tl.load(GroupStarts + g)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(Order + start + offs_m, mask=m_mask, other=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    offs_k = tl.arange(0, BLOCK_K)
    a_base = A + slot.to(tl.int64) * stride_a_slot
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    k_lo = split * k_per_split
    for k0 in range(0, k_per_split, BLOCK_K):
        kk = k_lo + k0 + offs_k
        k_mask = kk < K
        xt = tl.load(X + rows[:, None] * stride_x + kk[None, :], mask=m_mask[:, None] & k_mask[None, :], other=0.0)
        at = tl.load(a_base + offs_n[None, :] * stride_a_row + kk[:, None], mask=n_mask[None, :] & k_mask[:, None],
                     other=0.0)
        if UPCAST:
            xt = xt.to(tl.float32)
            at = at.to(tl.float32)
        if IEEE:
            acc += tl.dot(xt, at, input_precision="ieee")
        else:
            acc += tl.dot(xt, at)
    p_ptr = P + split.to(tl.int64) * num_rows * N + rows[:, None] * N + offs_n[None, :]
    tl.store(p_ptr, acc, mask=m_mask[:, None] & n_mask[None, :])


@triton.jit(do_not_specialize=["num_rows"])
def _expand_kernel(P, B, Out, Scalings, GroupSlots, GroupStarts, GroupLens, Order, num_splits, num_rows, N_s,
                   off0, n0, off1, n1, off2, n2, stride_b_slot, stride_b_row, stride_out,
                   R: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_R: tl.constexpr,
                   SPLITS: tl.constexpr, MAX_N: tl.constexpr, IEEE: tl.constexpr, UPCAST: tl.constexpr):
    pid = tl.program_id(0)
    g = tl.program_id(1)
    j = tl.program_id(2)
    num_n = tl.cdiv(MAX_N, BLOCK_N)
    pid_m = pid // num_n
    pid_n = pid % num_n
    off = tl.where(j == 0, off0, tl.where(j == 1, off1, off2))
    n_j = tl.where(j == 0, n0, tl.where(j == 1, n1, n2))
    length = tl.load(GroupLens + g)
    if pid_m * BLOCK_M >= length or pid_n * BLOCK_N >= n_j:
        return
    slot = tl.load(GroupSlots + g)
    start = tl.load(GroupStarts + g)
    scale = tl.load(Scalings + slot)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    m_mask = offs_m < length
    rows = tl.load(Order + start + offs_m, mask=m_mask, other=0)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    # the shrink's split-K partials of these rows, in one [splits, rows, rank] load, summed in a fixed order
    offs_sp = tl.arange(0, SPLITS)
    s_ptr = P + offs_sp[:, None, None] * num_rows * N_s + rows[None, :, None] * N_s + j * R + offs_r[None, None, :]
    s_mask = (offs_sp < num_splits)[:, None, None] & m_mask[None, :, None] & r_mask[None, None, :]
    s = tl.sum(tl.load(s_ptr, mask=s_mask, other=0.0), axis=0)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < n_j
    b_ptr = B + slot.to(tl.int64) * stride_b_slot + (off + offs_n)[None, :] * stride_b_row + offs_r[:, None]
    bt = tl.load(b_ptr, mask=n_mask[None, :] & r_mask[:, None], other=0.0)
    if UPCAST:
        bt = bt.to(tl.float32)
    else:
        s = s.to(bt.dtype)
    if IEEE:
        acc = tl.dot(s, bt, input_precision="ieee")
    else:
        acc = tl.dot(s, bt)
    o_ptr = Out + rows[:, None] * stride_out + (off + offs_n)[None, :]
    o_mask = m_mask[:, None] & n_mask[None, :]
    o = tl.load(o_ptr, mask=o_mask, other=0.0)
    tl.store(o_ptr, (o.to(tl.float32) + acc * scale).to(o.dtype), mask=o_mask)


def _pow2_at_least_16(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def lora_shrink_expand(x: torch.Tensor, out: torch.Tensor, a: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor,
                       out_slices: list[tuple[int, int]], views: tuple[torch.Tensor, ...], num_groups: int,
                       max_group_len: int) -> None:
    """out += the LoRA delta of every grouped row (in place). x [T, K]; a [S, n_sub*R, K]; b [S, out, R];
    out [T, out]; scalings [S] float32; views = (group_slots, group_starts, group_lens, token_order)."""
    if num_groups == 0 or max_group_len == 0:
        return
    T, K = x.shape
    n_sub = len(out_slices)
    N = a.shape[1]
    R = N // n_sub
    if x.stride(1) != 1 or out.stride(1) != 1 or a.stride(2) != 1 or b.stride(2) != 1:
        raise ValueError("LoRA kernels need unit stride along the last dimension")
    group_slots, group_starts, group_lens, order = views[:4]
    # Triton's CPU interpreter gets tl.dot on half types wrong: there the tiles go through float32
    upcast = _INTERPRET and x.dtype != torch.float32
    ieee = x.dtype == torch.float32 or upcast
    # Split K into up to MAX_SPLITS parts of >= 256 inputs: a decode batch has one block of rows per adapter, and
    # a program's K loop is a chain of dependent loads, so short loops over many programs finish soonest.
    num_splits = max(1, min(MAX_SPLITS, K // 256))
    k_per_split = triton.cdiv(K, num_splits)
    block_k = 64 if k_per_split <= 128 else (128 if k_per_split <= 512 else 256)
    k_per_split = triton.cdiv(k_per_split, block_k) * block_k
    num_splits = triton.cdiv(K, k_per_split)
    p = torch.empty((num_splits, T, N), dtype=torch.float32, device=x.device)
    block_n = 16 if N <= 16 else 32
    m_blocks = triton.cdiv(max_group_len, BLOCK_M)
    launch(_shrink_kernel, (m_blocks * triton.cdiv(N, block_n), num_groups, num_splits), x, a, p, group_slots,
           group_starts, group_lens, order, K, N, k_per_split, T, x.stride(0), a.stride(0), a.stride(1),
           BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_K=block_k, IEEE=ieee, UPCAST=upcast, num_warps=4)
    offs = [s[0] for s in out_slices] + [0] * (3 - n_sub)
    sizes = [s[1] for s in out_slices] + [0] * (3 - n_sub)
    max_n = max(sizes)
    block_n = 64
    launch(_expand_kernel, (m_blocks * triton.cdiv(max_n, block_n), num_groups, n_sub), p, b, out, scalings,
           group_slots, group_starts, group_lens, order, num_splits, T, N, offs[0], sizes[0], offs[1], sizes[1],
           offs[2], sizes[2], b.stride(0), b.stride(1), out.stride(0),
           R=R, BLOCK_M=BLOCK_M, BLOCK_N=block_n, BLOCK_R=_pow2_at_least_16(R),
           SPLITS=triton.next_power_of_2(num_splits), MAX_N=max_n, IEEE=ieee, UPCAST=upcast, num_warps=4)


@triton.jit(do_not_specialize=["num_rows"])
def _expand_stacked_kernel(Y, B, Out, Scalings, Order, SortedSlots, num_rows, N, stride_y, stride_out, shrink_col,
                           slot_cols, off1, off2, stride_b_slot, stride_b_row, num_slots,
                           R: tl.constexpr, N_SUB: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           BLOCK_R: tl.constexpr, S_PAD: tl.constexpr, MIXED_DOT: tl.constexpr, IEEE: tl.constexpr,
                           UPCAST: tl.constexpr):
    pid_m = tl.program_id(0)
    pid_n = tl.program_id(1)
    offs_p = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    p_mask = offs_p < num_rows
    rows = tl.load(Order + offs_p, mask=p_mask, other=0)
    slots = tl.load(SortedSlots + offs_p, mask=p_mask, other=-1)
    offs_n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    n_mask = offs_n < N
    io_mask = p_mask[:, None] & n_mask[None, :]
    delta = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)  # the dots accumulate here (their own layout)
    offs_r = tl.arange(0, BLOCK_R)
    r_mask = offs_r < R
    n_lo = pid_n * BLOCK_N
    big = 1 << 30
    cur = tl.min(tl.where(slots >= 0, slots, big), axis=0)  # the block's smallest adapter slot (big: none)
    if MIXED_DOT and (cur < tl.max(slots, axis=0)):
        # rows of several adapters (a group boundary, or small groups): one dot over every slot's rank columns,
        # each row's shrink kept in its own slot's columns and scaled there
        offs_k = tl.arange(0, S_PAD * BLOCK_R)
        k_slot = offs_k // BLOCK_R
        k_r = offs_k % BLOCK_R
        k_mask = (k_slot < num_slots) & (k_r < R)
        scale_k = tl.load(Scalings + k_slot, mask=k_mask, other=0.0)
        mine = p_mask[:, None] & k_mask[None, :] & (slots[:, None] == k_slot[None, :])
        for j in tl.static_range(N_SUB):
            lo = 0 if j == 0 else (off1 if j == 1 else off2)
            hi = N if j == N_SUB - 1 else (off1 if j == 0 else off2)
            if (n_lo < hi) & (n_lo + BLOCK_N > lo):
                s = tl.load(Y + rows[:, None] * stride_y + shrink_col + k_slot[None, :] * slot_cols + j * R
                            + k_r[None, :], mask=mine, other=0.0).to(tl.float32) * scale_k[None, :]
                col = n_mask & (offs_n >= lo) & (offs_n < hi)
                bt = tl.load(B + k_slot[:, None].to(tl.int64) * stride_b_slot + offs_n[None, :] * stride_b_row
                             + k_r[:, None], mask=k_mask[:, None] & col[None, :], other=0.0)
                if UPCAST:
                    bt = bt.to(tl.float32)
                else:
                    s = s.to(bt.dtype)
                if IEEE:
                    delta = tl.dot(s, bt, delta, input_precision="ieee")
                else:
                    delta = tl.dot(s, bt, delta)
        cur = cur * 0 + big  # done: skip the loop below (int64, like cur)
    while cur < big:
        sel = slots == cur
        scale = tl.load(Scalings + cur)
        s_base = Y + shrink_col + cur.to(tl.int64) * slot_cols
        b_base = B + cur.to(tl.int64) * stride_b_slot
        for j in tl.static_range(N_SUB):
            lo = 0 if j == 0 else (off1 if j == 1 else off2)
            hi = N if j == N_SUB - 1 else (off1 if j == 0 else off2)
            if (n_lo < hi) & (n_lo + BLOCK_N > lo):  # this block of columns meets sub-projection j
                s = tl.load(s_base + rows[:, None] * stride_y + j * R + offs_r[None, :],
                            mask=sel[:, None] & r_mask[None, :], other=0.0).to(tl.float32) * scale
                col = n_mask & (offs_n >= lo) & (offs_n < hi)
                bt = tl.load(b_base + offs_n[None, :] * stride_b_row + offs_r[:, None],
                             mask=col[None, :] & r_mask[:, None], other=0.0)
                if UPCAST:
                    bt = bt.to(tl.float32)
                else:
                    s = s.to(bt.dtype)
                if IEEE:
                    delta = tl.dot(s, bt, delta, input_precision="ieee")
                else:
                    delta = tl.dot(s, bt, delta)
        cur = tl.min(tl.where(slots > cur, slots, big), axis=0)
    y = tl.load(Y + rows[:, None] * stride_y + offs_n[None, :], mask=io_mask, other=0.0)
    acc = y.to(tl.float32) + delta
    tl.store(Out + rows[:, None] * stride_out + offs_n[None, :], acc.to(Out.dtype.element_ty), mask=io_mask)


# The stacked expand's (BLOCK_M, BLOCK_N, num_warps, mixed-adapter dot) by batch rows and output width, from the
# configurations timed on an H200 at the Llama-3.1-8B shapes (docs/perf-log.md, 2026-11-30, run 1): up to 16 rows
# (decode of a few requests) small tiles; up to 64 rows, blocks that hold several adapters' rows run the mixed dot
# (wide tiles for the wide gate_up); above, 32 x 128 tiles walking one adapter at a time (the fewest registers:
# the most programs resident to keep memory busy), best at every projection from 128 to 4,096 rows.
_WIDE = 16384  # outputs from which a projection counts as wide


def expand_stacked_config(num_rows: int, n: int, num_slots: int, rank: int) -> tuple[int, int, int, bool]:
    """(BLOCK_M, BLOCK_N, num_warps, mixed-adapter dot) of the stacked expand for `num_rows` rows of `n` outputs."""
    fits = triton.next_power_of_2(num_slots) * _pow2_at_least_16(rank) <= _MIXED_DOT_K
    if num_rows <= 16:
        return 16, 64, 4, fits
    if num_rows <= 64:
        return (64, 128, 4, fits) if n >= _WIDE else (32, 64, 4, fits)
    return 32, 128, 4, False


EXPAND_WARMUP_ROWS = (1, 17, 65)  # a batch of each row class of `expand_stacked_config` (compiled at start)


def lora_expand_stacked(y: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor, out_slices: list[tuple[int, int]],
                        order: torch.Tensor, sorted_slots: torch.Tensor, num_rows: int,
                        config: tuple[int, int, int, bool] | None = None) -> torch.Tensor:
    """The base output plus every row's LoRA delta, from the stacked GEMM's output y [T, N + S*n_sub*R] (columns
    N + s*n_sub*R + j*R .. + R: slot s's shrink for sub-projection j); b [S, N, R]; rows in `order` sorted by
    `sorted_slots` (-1: base). Returns a new contiguous [T, N] tensor (rows past `num_rows`: left unwritten).
    `config`: (BLOCK_M, BLOCK_N, num_warps, mixed-adapter dot) instead of `expand_stacked_config`'s (benchmarks)."""
    T = y.shape[0]
    S, N, R = b.shape
    n_sub = len(out_slices)
    if y.stride(1) != 1 or b.stride(2) != 1 or y.shape[1] != N + S * n_sub * R:
        raise ValueError(f"stacked LoRA output {tuple(y.shape)} does not fit B {tuple(b.shape)} x {n_sub} slices")
    out = torch.empty((T, N), dtype=y.dtype, device=y.device)
    if num_rows == 0:
        return out
    upcast = _INTERPRET and y.dtype != torch.float32
    ieee = y.dtype == torch.float32 or upcast
    offs = [o for o, _ in out_slices] + [N] * (3 - n_sub)
    block_m, block_n, warps, mixed = config or expand_stacked_config(num_rows, N, S, R)
    block_r = _pow2_at_least_16(R)
    s_pad = triton.next_power_of_2(S)
    launch(_expand_stacked_kernel, (triton.cdiv(num_rows, block_m), triton.cdiv(N, block_n)), y, b, out, scalings,
           order, sorted_slots, num_rows, N, y.stride(0), out.stride(0), N, n_sub * R, offs[1], offs[2],
           b.stride(0), b.stride(1), S, R=R, N_SUB=n_sub, BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_R=block_r,
           S_PAD=s_pad, MIXED_DOT=mixed and s_pad * block_r <= _MIXED_DOT_K, IEEE=ieee, UPCAST=upcast,
           num_warps=warps)
    return out


@triton.jit
def _row_with_delta(Y, B, cols, mask, slot, scale, shrink_col, slot_cols, off1, off2, stride_b_slot, stride_b_row,
                    R: tl.constexpr, N_SUB: tl.constexpr, BLOCK_R: tl.constexpr):
    """y[cols] + scale * B[slot, cols, :R] . shrink(slot, sub-projection of each column), in float32 (slot < 0: y)."""
    offs_r = tl.arange(0, BLOCK_R)
    has = (tl.zeros_like(cols) + slot) >= 0  # per column (the interpreter takes no scalar-and-block masks)
    safe = tl.maximum(slot, 0).to(tl.int64)
    j = tl.zeros_like(cols)
    if N_SUB > 1:
        j += (cols >= off1).to(cols.dtype)
    if N_SUB > 2:
        j += (cols >= off2).to(cols.dtype)
    m2 = (mask & has)[:, None] & (offs_r[None, :] < R)
    sv = tl.load(Y + shrink_col + safe * slot_cols + j[:, None] * R + offs_r[None, :], mask=m2, other=0.0)
    bt = tl.load(B + safe * stride_b_slot + cols[:, None].to(tl.int64) * stride_b_row + offs_r[None, :], mask=m2,
                 other=0.0)
    sv = (sv.to(tl.float32) * scale).to(bt.dtype).to(tl.float32)  # as the batched expand rounds it before its dot
    y = tl.load(Y + cols, mask=mask, other=0.0).to(tl.float32)
    return y + tl.sum(bt.to(tl.float32) * sv, axis=1)


@triton.jit
def _expand_row_kernel(Y, B, Out, Scalings, SortedSlots, n_out, shrink_col, slot_cols, off1, off2, stride_b_slot,
                       stride_b_row, R: tl.constexpr, N_SUB: tl.constexpr, BLOCK_N: tl.constexpr,
                       BLOCK_R: tl.constexpr, ACT: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    slot = tl.load(SortedSlots)
    scale = tl.load(Scalings + tl.maximum(slot, 0))
    cols = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    mask = cols < n_out
    dt = Out.dtype.element_ty
    out = _row_with_delta(Y, B, cols, mask, slot, scale, shrink_col, slot_cols, off1, off2, stride_b_slot,
                          stride_b_row, R, N_SUB, BLOCK_R).to(dt)
    if ACT:  # cols are the gate's; the up projection's are n_out further (torch's SiLU rounding, as silu_and_mul)
        up = _row_with_delta(Y, B, cols + n_out, mask, slot, scale, shrink_col, slot_cols, off1, off2,
                             stride_b_slot, stride_b_row, R, N_SUB, BLOCK_R).to(dt)
        g = out.to(tl.float32)
        out = ((g / (1.0 + tl.exp(-g))).to(dt).to(tl.float32) * up.to(tl.float32)).to(dt)
    tl.store(Out + cols, out, mask=mask)


def lora_expand_row(y: torch.Tensor, b: torch.Tensor, scalings: torch.Tensor, out_slices: list[tuple[int, int]],
                    sorted_slots: torch.Tensor, silu_mul: bool = False) -> torch.Tensor:
    """`lora_expand_stacked` for a batch of one row (slot sorted_slots[0], -1: base): y [1, N + S*n_sub*R] ->
    [1, N], or with silu_mul (a [gate; up] layer of two equal halves) silu(gate) * up as [1, N / 2]."""
    S, N, R = b.shape
    n_sub = len(out_slices)
    if y.dim() != 2 or y.shape[0] != 1 or not y.is_contiguous() or b.stride(2) != 1 \
            or y.shape[1] != N + S * n_sub * R:
        raise ValueError(f"one-row LoRA output {tuple(y.shape)} does not fit B {tuple(b.shape)} x {n_sub} slices")
    if silu_mul and (n_sub != 2 or out_slices[1] != (N // 2, N // 2) or N % 2):
        raise ValueError(f"silu_mul needs a [gate; up] layer of two equal halves; got slices {out_slices}")
    n_out = N // 2 if silu_mul else N
    out = torch.empty((1, n_out), dtype=y.dtype, device=y.device)
    offs = [o for o, _ in out_slices] + [N] * (3 - n_sub)
    block_n = 32 if _INTERPRET else (128 if n_out > 8192 else 64)
    launch(_expand_row_kernel, (triton.cdiv(n_out, block_n),), y, b, out, scalings, sorted_slots, n_out, N,
           n_sub * R, offs[1], offs[2], b.stride(0), b.stride(1), R=R, N_SUB=n_sub, BLOCK_N=block_n,
           BLOCK_R=_pow2_at_least_16(R), ACT=silu_mul, **pdl.launch_opts(y, ROW_PDL_LEVEL))
    return out
