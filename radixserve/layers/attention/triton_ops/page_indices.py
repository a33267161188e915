"""A page table's page ids in one launch: for request i (request-table row rows[i]), the ids of its pages written at
out[indptr[i] : indptr[i + 1]], page p's id being req_to_token[rows[i], p * page_size] // page_size.

The FlashInfer backend's CUDA graphs build their `kv_indices` with it from the device's `kv_indptr` (the kernel is
captured in the graph, after the graph's input kernel wrote the step's new slots into the request table), so the
host's share of a replay is the lengths' arithmetic and one copy (`page_table` in flashinfer_backend.py, a dozen
torch operations, is the reference and serves the eager paths). Programs are (request, split); a request's page
count is read on the device and each split loops over every `splits`-th block of its pages, so the grid depends
on the batch size only and one launch serves any lengths.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch

BLOCK_PAGES = 256
PROGRAMS = 512  # about this many programs a launch: batch size x splits, splits in 1..MAX_SPLITS
MAX_SPLITS = 32


@triton.jit(do_not_specialize=["stride_row", "splits"])
def _page_indices_kernel(ReqToToken, Rows, Indptr, Out, stride_row, splits, PAGE: tl.constexpr,
                         BLOCK: tl.constexpr):
    i = tl.program_id(0)
    start = tl.load(Indptr + i)
    n = tl.load(Indptr + i + 1) - start
    row = tl.load(Rows + i).to(tl.int64)
    for first in range(tl.program_id(1) * BLOCK, n, splits * BLOCK):
        p = first + tl.arange(0, BLOCK)
        m = p < n
        slot = tl.load(ReqToToken + row * stride_row + p.to(tl.int64) * PAGE, mask=m, other=0)
        tl.store(Out + start + p, (slot // PAGE).to(tl.int32), mask=m)


def page_index_splits(batch_size: int) -> int:
    """Programs a request gets: about PROGRAMS over the batch, at least one, at most MAX_SPLITS."""
    return max(1, min(MAX_SPLITS, PROGRAMS // max(1, batch_size)))


def fill_page_indices(req_to_token: torch.Tensor, rows: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor,
                      page_size: int) -> None:
    """Write every request's page ids into `out` (int32) at the offsets of `indptr` (int32 [bs + 1], on the device;
    read there, so the launch may be captured in a CUDA graph and replayed for other lengths)."""
    bs = rows.shape[0]
    if indptr.shape[0] < bs + 1 or out.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError(f"fill_page_indices: indptr needs {bs + 1} entries (got {indptr.shape[0]}), out int32 "
                         f"(got {out.dtype}), req_to_token contiguous rows")
    if page_size < 1:
        raise ValueError(f"fill_page_indices: page_size must be positive, got {page_size}")
    if bs == 0:
        return
    splits = page_index_splits(bs)
    launch(_page_indices_kernel, (bs, splits), req_to_token, rows, indptr, out, req_to_token.stride(0), splits,
           PAGE=page_size, BLOCK=BLOCK_PAGES)
