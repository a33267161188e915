"""The flex backend's decode block lists, built on the GPU in one launch (so a CUDA graph captures it and a replay
does no host work).

One program per decode row of the graph (rows past the batch are padding). A row reads its request and length,
records which position its new token's slot holds (`slot_pos`), and lists the KV blocks (runs of KB physical slots)
its visible positions live in, in ascending order and each once:

- PAGED (the page size a multiple of KB): a row's blocks are the blocks of its positions first, first + KB, ...
  (every page is whole blocks, so one table read per block);
- otherwise the slots of one block may belong to any requests in any order: the row marks the blocks of its
  visible slots in a bitmap of its own (zeroed again as it is read), then compacts the marked blocks in order.

The loops run to each row's own length, read from device memory: no shape depends on the batch's lengths.
`fill_decode_blocks_ref` in flex_attention_backend.py is the torch reference it is tested against.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.common import first_visible
from radixserve.layers.triton_ops.launch import launch


@triton.jit(do_not_specialize=["bs", "window", "table_w", "n_blocks", "dump"])
def _flex_decode_blocks_kernel(
    Rows, Seq_lens, Table, Slot_pos, Row_out, Pos_out, Num, Idx, Bitmap,
    bs, window, table_w, n_blocks, dump,
    stride_t, stride_idx, stride_bm,
    KB: tl.constexpr,
    PAGED: tl.constexpr,
    WRITE_POS: tl.constexpr,
    BLOCK: tl.constexpr,
):
    r = tl.program_id(0)
    in_batch = r < bs
    row = tl.load(Rows + r, mask=in_batch, other=0).to(tl.int64)
    seq = tl.load(Seq_lens + r, mask=in_batch, other=0).to(tl.int64)
    real = seq >= 2  # a decode row holds at least its prompt token and the new one; less is padding
    pos = tl.where(real, seq - 1, -1)
    if WRITE_POS:
        tl.store(Row_out + r, tl.where(in_batch, row, 0))
        tl.store(Pos_out + r, pos)
        new_slot = tl.load(Table + row * stride_t + tl.maximum(seq - 1, 0), mask=real, other=0).to(tl.int64)
        tl.store(Slot_pos + tl.where(real, new_slot, dump), pos)
    first = tl.maximum(first_visible(seq - 1, window), 0).to(tl.int64)  # (window: as the attention kernels')
    offs = tl.arange(0, BLOCK)
    if PAGED:
        b0 = first // KB
        nb = tl.where(real, (seq + KB - 1) // KB - b0, 0)
        for j in range(0, nb, BLOCK):
            o = j + offs
            m = o < nb
            col = tl.minimum((b0 + o) * KB, table_w - 1)
            slot = tl.load(Table + row * stride_t + col, mask=m, other=0)
            tl.store(Idx + r * stride_idx + o, (slot // KB).to(tl.int32), mask=m)
        tl.store(Num + r, nb.to(tl.int32))
    else:
        end = tl.where(real, seq, 0)
        for p in range(first, end, BLOCK):
            o = p + offs
            m = o < end
            slot = tl.load(Table + row * stride_t + o, mask=m, other=0)
            tl.store(Bitmap + r * stride_bm + slot // KB, tl.full([BLOCK], 1, tl.int8), mask=m)
        tl.debug_barrier()  # every mark of this program is visible to all its threads
        count = tl.zeros([], dtype=tl.int32)
        for b in range(0, n_blocks, BLOCK):
            o = b + offs
            m = o < n_blocks
            flag = tl.load(Bitmap + r * stride_bm + o, mask=m, other=0).to(tl.int32)
            at = count + tl.cumsum(flag, 0) - 1
            tl.store(Idx + r * stride_idx + at, o.to(tl.int32), mask=m & (flag != 0) & (at < stride_idx))
            tl.store(Bitmap + r * stride_bm + o, tl.zeros([BLOCK], tl.int8), mask=m & (flag != 0))
            count += tl.sum(flag, 0)
        tl.store(Num + r, count)


def fill_decode_blocks(rows: torch.Tensor, seq_lens: torch.Tensor, table: torch.Tensor, slot_pos: torch.Tensor,
                       row_out: torch.Tensor, pos_out: torch.Tensor, num: torch.Tensor, idx: torch.Tensor,
                       bitmap: torch.Tensor | None, window: int, kb: int, paged: bool, write_pos: bool) -> None:
    """Refresh one window's decode block lists in place for the batch's `rows.numel()` rows; the rows of
    `num.shape[0]` past them are padding (they list nothing). `slot_pos[-1]` takes padding rows' writes; `bitmap`
    ([rows, slots // kb] int8, zero) is needed when not `paged` and is zero again afterwards."""
    n_rows = num.shape[0]
    if not paged and (bitmap is None or bitmap.shape[0] < n_rows):
        raise ValueError("fill_decode_blocks: a bitmap of one row per decode row is needed when pages are not blocks")
    bm = bitmap if bitmap is not None else num
    n_blocks = bitmap.shape[1] if bitmap is not None else 0
    launch(_flex_decode_blocks_kernel, (n_rows,), rows, seq_lens, table, slot_pos, row_out, pos_out, num, idx, bm,
           rows.numel(), window, table.shape[1], n_blocks, slot_pos.numel() - 1,
           table.stride(0), idx.stride(0), bm.stride(0),
           KB=kb, PAGED=paged, WRITE_POS=write_pos, BLOCK=1024 if not paged else 256, num_warps=4)
