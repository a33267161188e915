"""Top-k positions of long score rows by histogram thresholds: three small launches instead of a sort.

Every float32 score maps to an int32 key of the same order (`_order_key`). The k best of a row are the keys above
a threshold, found from the key's bits in two rounds:

1. `_hist_kernel` (round 1): every program histograms the top 11 bits of its piece of a row (2,048 bins) and adds
   its counts to the row's histogram (one atomic per non-empty bin). The boundary bin B1 is the highest bin whose
   count from the top reaches k (`_boundary`).
2. `_hist_kernel` (round 2): the keys of bin B1 only, histogrammed on their next 11 bits; boundary sub-bin B2.
3. `_select_kernel`: every key above (B1, B2) is kept, plus as many keys of (B1, B2) itself as k still needs (in
   arrival order: they agree on their first 22 bits, i.e. they tie to about 1e-4 relative). Each program claims
   its output slots with one atomic add per row.

Exactly k positions per row, in no particular order, with no host work (the launches are captured by CUDA graphs).
Rows hold at least k scores (the caller takes min(k, row length)). `torch.topk` is the reference.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch

NBINS = 2048  # 11 bits per round
_SHIFT1, _SHIFT2 = 21, 10


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


@triton.jit(do_not_specialize=["n_cols", "k"])
def _hist_kernel(Scores, Hist, n_cols, k, stride_s, stride_h,
                 ROUND: tl.constexpr, NB: tl.constexpr, SHIFT1: tl.constexpr, SHIFT2: tl.constexpr,
                 BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_cols
    key = _order_key(tl.load(Scores + r.to(tl.int64) * stride_s + offs, mask=m, other=float("-inf")))
    bin1 = (key >> SHIFT1) + NB // 2
    hist = Hist + r.to(tl.int64) * stride_h
    if ROUND == 1:
        h = _masked_hist(bin1, m, NB)
        tl.atomic_add(hist + tl.arange(0, NB), h, mask=h > 0, sem="relaxed")
    else:
        b1, _ = _boundary(hist, k, NB)
        h = _masked_hist((key >> SHIFT2) & (NB - 1), m & (bin1 == b1), NB)
        tl.atomic_add(hist + NB + tl.arange(0, NB), h, mask=h > 0, sem="relaxed")


@triton.jit(do_not_specialize=["n_cols", "k"])
def _select_kernel(Scores, Hist, Out, n_cols, k, stride_s, stride_h, stride_o,
                   NB: tl.constexpr, SHIFT1: tl.constexpr, SHIFT2: tl.constexpr, BLOCK: tl.constexpr):
    r = tl.program_id(0)
    offs = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = offs < n_cols
    key = _order_key(tl.load(Scores + r.to(tl.int64) * stride_s + offs, mask=m, other=float("-inf")))
    hist = Hist + r.to(tl.int64) * stride_h
    b1, above1 = _boundary(hist, k, NB)
    b2, above2 = _boundary(hist + NB, k - above1, NB)
    above = above1 + above2  # keys strictly above (b1, b2): all kept
    bin1 = (key >> SHIFT1) + NB // 2
    bin2 = (key >> SHIFT2) & (NB - 1)
    sel = m & ((bin1 > b1) | ((bin1 == b1) & (bin2 > b2)))
    tie = m & (bin1 == b1) & (bin2 == b2)
    sel_i = sel.to(tl.int32)
    tie_i = tie.to(tl.int32)
    out = Out + r.to(tl.int64) * stride_o
    counters = hist + 2 * NB
    base = tl.atomic_add(counters, tl.sum(sel_i, 0), sem="relaxed")
    tl.store(out + base + tl.cumsum(sel_i, 0) - 1, offs.to(Out.dtype.element_ty), mask=sel)
    tie_base = tl.atomic_add(counters + 1, tl.sum(tie_i, 0), sem="relaxed")
    at = tie_base + tl.cumsum(tie_i, 0) - 1  # this tie's rank among the row's ties
    tl.store(out + above + at, offs.to(Out.dtype.element_ty), mask=tie & (at < k - above))


SCRATCH_WIDTH = 2 * NBINS + 2  # per row: two histograms, then the counters of kept keys and of ties taken


def new_scratch(rows: int, device: torch.device | str) -> torch.Tensor:
    """Zeroed histograms and counters for `rows` score rows (int32 [rows, SCRATCH_WIDTH])."""
    return torch.zeros((rows, SCRATCH_WIDTH), dtype=torch.int32, device=device)


def threshold_topk(scores: torch.Tensor, k: int, out: torch.Tensor | None = None,
                   scratch: torch.Tensor | None = None, block: int | None = None,
                   hist_ready: bool = False) -> torch.Tensor:
    """Positions [..., k] (int32, no particular order) of the k largest of each row of float32 scores [..., L]
    (unit last stride), L >= k. Ties at the threshold are broken arbitrarily. `scratch` (int32, at least
    rows x SCRATCH_WIDTH) and `out` may be passed to avoid allocations. hist_ready: `scratch` already holds the
    first round's histograms and zeroed the rest (the scoring kernel made them: `ds_score_fwd(hist=...)`)."""
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
    if hist_ready and (scratch is None or scratch.numel() < n_rows * width):
        raise ValueError("threshold_topk: hist_ready needs the scratch the histograms were made in")
    if scratch is None or scratch.numel() < n_rows * width:
        scratch = torch.empty(n_rows * width, dtype=torch.int32, device=scores.device)
    hist = scratch.view(-1)[:n_rows * width].view(n_rows, width)
    if not hist_ready:
        hist.zero_()
    if n_rows == 0:
        return out
    if block is None:
        block = 2048
    grid = (n_rows, triton.cdiv(n_cols, block))
    for rnd in ((2,) if hist_ready else (1, 2)):
        launch(_hist_kernel, grid, rows2d, hist, n_cols, k, rows2d.stride(0), hist.stride(0),
               ROUND=rnd, NB=NBINS, SHIFT1=_SHIFT1, SHIFT2=_SHIFT2, BLOCK=block, num_warps=8)
    launch(_select_kernel, grid, rows2d, hist, out2d, n_cols, k, rows2d.stride(0), hist.stride(0), out2d.stride(0),
           NB=NBINS, SHIFT1=_SHIFT1, SHIFT2=_SHIFT2, BLOCK=block, num_warps=8)
    return out
