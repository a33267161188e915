"""Top-k positions of long score rows by histogram thresholds (a radix select in a few small launches, no sort).

Every float32 score maps to an int32 key of the same order (`_order_key`). The k best of a row are the keys above
a threshold, found from the key's bits, NBITS at a time, in ROUNDS rounds (`_hist_kernel`): every program
histograms the round's bits (NBINS bins) of its piece of a row, over the keys whose higher bits equal the boundary
found so far, and adds its counts to the row's histogram (one atomic per non-empty bin). A round's boundary bin is
the highest whose count from the top reaches what k still needs (`_boundary`). `_select_kernel` then keeps every key
whose top ROUNDS * NBITS bits are above the boundary prefix, plus as many keys equal to it as k still needs (they
agree on those bits: ties to about 3e-5 relative); each program claims its output slots with one atomic per row.

Exactly k positions per row, in no particular order, with no host work (the launches are captured by CUDA graphs).
Rows hold at least k scores (the caller takes min(k, row length)). `torch.topk` is the reference.

The scratch (histograms and counters) starts all zeros and is left all zeros: the last select program of a row to
finish clears the row's scratch, so a caller that keeps one scratch buffer launches no memset per call.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

NBITS = 8  # key bits per round
NBINS = 1 << NBITS
ROUNDS = 3  # 24 of the key's 32 bits: keys left tied agree to about 3e-5 relative


@triton.jit
def _order_key(s):
    """float32 -> int32 with the same order (-inf lowest, +inf highest)."""
    b = s.to(tl.int32, bitcast=True)
    return b ^ ((b >> 31) & 0x7FFFFFFF)


@triton.jit
def _masked_hist(bins, mask, NB: tl.constexpr):
    """tl.histogram of bins where mask (without its mask argument, which older Triton releases lack)."""
    h = tl.histogram(tl.where(mask, bins, 0), NB)
    masked_out = tl.sum((mask == 0).to(tl.int32), 0)
    return h - tl.where(tl.arange(0, NB) == 0, masked_out, 0)


@triton.jit
def _boundary(Hist, k, NB: tl.constexpr):
    """(bin, count above it): the highest bin whose count from the top reaches k, and the count of higher bins."""
    offs = tl.arange(0, NB)
    h = tl.load(Hist + offs)
    suffix = tl.sum(h, 0) - tl.cumsum(h, 0) + h  # count of this bin and every higher one
    b = tl.max(tl.where(suffix >= k, offs, -1), 0)
    above = tl.sum(tl.where(offs > b, h, 0), 0)
    return b, above


@triton.jit
def _prefix(Hist, k, LEVELS: tl.constexpr, NB: tl.constexpr, NBITS: tl.constexpr):
    """The boundary's top LEVELS * NBITS key bits (as the arithmetic shift of a key gives them) from the first LEVELS
    rounds' histograms, and the count of keys above that prefix."""
    b, above = _boundary(Hist, k, NB)
    p = b - NB // 2
    for lvl in tl.static_range(1, LEVELS):
        b, a = _boundary(Hist + lvl * NB, k - above, NB)
        above += a
        p = p * NB + b
    return p, above


@triton.jit(do_not_specialize=["n_cols", "k"])
def _hist_kernel(Scores, Hist, n_cols, k, stride_s, stride_h,
                 ROUND: tl.constexpr, NB: tl.constexpr, NBITS: tl.constexpr, BLOCK: tl.constexpr,
                 PDL: tl.constexpr = 0):
    """Round ROUND (1-based): histogram of the keys' bits of that round, over the keys whose higher bits equal the
    boundary prefix of the rounds before."""
    pdl_prologue(PDL)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_cols
    key = _order_key(tl.load(Scores + r.to(tl.int64) * stride_s + offs, mask=m, other=float("-inf")))
    hist = Hist + r.to(tl.int64) * stride_h
    if ROUND == 1:
        bins = (key >> (32 - NBITS)) + NB // 2
    else:
        p, _ = _prefix(hist, k, ROUND - 1, NB, NBITS)
        m = m & ((key >> (32 - NBITS * (ROUND - 1))) == p)
        bins = (key >> (32 - NBITS * ROUND)) & (NB - 1)
    h = _masked_hist(bins, m, NB)
    tl.atomic_add(hist + (ROUND - 1) * NB + tl.arange(0, NB), h, mask=h > 0, sem="relaxed")


@triton.jit(do_not_specialize=["n_cols", "k"])
def _select_kernel(Scores, Hist, Out, n_cols, k, stride_s, stride_h, stride_o,
                   ROUNDS: tl.constexpr, NB: tl.constexpr, NBITS: tl.constexpr, BLOCK: tl.constexpr,
                   PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_cols
    key = _order_key(tl.load(Scores + r.to(tl.int64) * stride_s + offs, mask=m, other=float("-inf")))
    hist = Hist + r.to(tl.int64) * stride_h
    p, above = _prefix(hist, k, ROUNDS, NB, NBITS)  # keys with a higher prefix: all kept
    q = key >> (32 - NBITS * ROUNDS)
    sel = m & (q > p)
    tie = m & (q == p)
    sel_i = sel.to(tl.int32)
    tie_i = tie.to(tl.int32)
    out = Out + r.to(tl.int64) * stride_o
    counters = hist + ROUNDS * NB
    base = tl.atomic_add(counters, tl.sum(sel_i, 0), sem="relaxed")
    tl.store(out + base + tl.cumsum(sel_i, 0) - 1, offs.to(Out.dtype.element_ty), mask=sel)
    tie_base = tl.atomic_add(counters + 1, tl.sum(tie_i, 0), sem="relaxed")
    at = tie_base + tl.cumsum(tie_i, 0) - 1  # this tie's rank among the row's ties
    tl.store(out + above + at, offs.to(Out.dtype.element_ty), mask=tie & (at < k - above))
    # the row's last program to get here clears its scratch for the next call (every other program of the row has
    # read the histograms and taken its slots before its increment: acq_rel orders them)
    done = tl.atomic_add(counters + 2, 1, sem="acq_rel")
    if done == tl.num_programs(1) - 1:
        for rnd in tl.static_range(ROUNDS):
            tl.store(hist + rnd * NB + tl.arange(0, NB), tl.zeros([NB], dtype=tl.int32))
        tl.store(counters + tl.arange(0, 4), tl.zeros([4], dtype=tl.int32), mask=tl.arange(0, 4) < 3)


# per row: a histogram per round, then the counters of kept keys, of ties taken and of select programs done
SCRATCH_WIDTH = ROUNDS * NBINS + 3


def new_scratch(rows: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed histograms and counters for `rows` score rows (int32 [rows, SCRATCH_WIDTH])."""
    return torch.zeros((rows, SCRATCH_WIDTH), dtype=torch.int32, device=device)


def threshold_topk(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
                   scratch: torch.Tensor | None = None, block: int | None = None,
                   pdl_level: int | None = None) -> torch.Tensor:
    """Positions [..., k] (int32, no particular order) of the k largest of each row of float32 scores [..., L]
    (unit last stride), L >= k. Ties at the threshold are broken arbitrarily. `out` may be passed to avoid an
    allocation, and `scratch` (int32, at least rows x SCRATCH_WIDTH, all zeros; `new_scratch`), which the call
    leaves all zeros. `pdl_level`: programmatic dependent launch of the kernels (triton_ops/pdl.py; None:
    RADIXSERVE_PDL)."""
    if scores.dtype != torch.float32 or scores.stride(-1) != 1:
        raise ValueError("threshold_topk needs float32 scores with a unit last stride")
    n_cols = scores.shape[-1]
    if not 1 <= k <= n_cols:
        raise ValueError(f"threshold_topk: k must be in 1..{n_cols} (the row length); got {k}")
    rows2d = scores.reshape(-1, n_cols)
    n_rows = rows2d.shape[0]
    if out is None:
        out = torch.empty(*scores.shape[:-1], k, dtype=torch.int32, device=scores.device)
    out2d = out.view(n_rows, k)
    width = SCRATCH_WIDTH
    if scratch is None:
        scratch = new_scratch(n_rows, scores.device)
    elif scratch.dtype != torch.int32 or scratch.numel() < n_rows * width or not scratch.is_contiguous():
        raise ValueError(f"threshold_topk: the scratch must be contiguous int32 of at least {n_rows} x {width}")
    hist = scratch.view(-1)[:n_rows * width].view(n_rows, width)
    if n_rows == 0:
        return out
    block = block or 2048
    grid = (n_rows, triton.cdiv(n_cols, block))
    for rnd in range(1, ROUNDS + 1):
        launch(_hist_kernel, grid, rows2d, hist, n_cols, k, rows2d.stride(0), hist.stride(0),
               ROUND=rnd, NB=NBINS, NBITS=NBITS, BLOCK=block, num_warps=8, **pdl.launch_opts(scores, pdl_level))
    launch(_select_kernel, grid, rows2d, hist, out2d, n_cols, k, rows2d.stride(0), hist.stride(0), out2d.stride(0),
           ROUNDS=ROUNDS, NB=NBINS, NBITS=NBITS, BLOCK=block, num_warps=8, **pdl.launch_opts(scores, pdl_level))
    return out
