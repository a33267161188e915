"""A page table's page ids in one launch: for request i (request-table row rows[i]), the ids of its pages written at
out[indptr[i] : indptr[i + 1]], page p's id being req_to_token[rows[i], p * page_size] // page_size.

The FlashInfer backend's CUDA-graph replay builds its `kv_indices` with it from a device copy of `kv_indptr`, so the
host's share of a replay is the lengths' arithmetic and one copy (`page_table` in flashinfer_backend.py, a dozen
torch operations, is the reference and serves the eager paths). Programs are (request, block of pages); a request's
blocks past its last page do nothing.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch

BLOCK_PAGES = 256


@triton.jit(do_not_specialize=["stride_row"])
def _page_indices_kernel(ReqToToken, Rows, Indptr, Out, stride_row, PAGE: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0)
    start = tl.load(Indptr + i)
    n = tl.load(Indptr + i + 1) - start
    p = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    m = p < n
    row = tl.load(Rows + i).to(tl.int64)
    slot = tl.load(ReqToToken + row * stride_row + p.to(tl.int64) * PAGE, mask=m, other=0)
    tl.store(Out + start + p, (slot // PAGE).to(tl.int32), mask=m)


def fill_page_indices(req_to_token: torch.Tensor, rows: torch.Tensor, indptr: torch.Tensor, out: torch.Tensor,
                      page_size: int, max_pages: int) -> None:
    """Write every request's page ids into `out` (int32) at the offsets of `indptr` (int32 [bs + 1], on the device);
    `max_pages` bounds any request's page count (it sizes the grid)."""
    bs = rows.shape[0]
    if indptr.shape[0] < bs + 1 or out.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError(f"fill_page_indices: indptr needs {bs + 1} entries (got {indptr.shape[0]}), out int32 "
                         f"(got {out.dtype}), req_to_token contiguous rows")
    if page_size < 1:
        raise ValueError(f"fill_page_indices: page_size must be positive, got {page_size}")
    if bs == 0 or max_pages <= 0:
        return
    launch(_page_indices_kernel, (bs, triton.cdiv(max_pages, BLOCK_PAGES)), req_to_token, rows, indptr, out,
           req_to_token.stride(0), PAGE=page_size, BLOCK=BLOCK_PAGES)
