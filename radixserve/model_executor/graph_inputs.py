"""Load a decode batch into a CUDA graph's static input buffers in one kernel launch.

Replaying a captured decode graph first copies the batch's input ids, request rows, sequence lengths, KV slots and
positions into the buffers the graph reads, and fills the padding rows up to the captured batch size. As torch ops
that is five copies and, for a padded batch, five fills: up to ten tiny kernels and their launches per step, on the
GPU between two graph replays. This kernel does all of it at once. The row counts are runtime values (not
specialised), so no batch size compiles a variant of its own while serving."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch

_BLOCK = 256


@triton.jit(do_not_specialize=["raw", "bs", "fill"])
def _load_graph_inputs_kernel(Ids, Rows, Lens, Locs, Pos, SrcIds, SrcRows, SrcLens, SrcLocs, SrcPos, raw, bs, fill,
                              BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    live = offs < raw
    out = offs < bs
    ids = tl.load(SrcIds + offs, mask=live, other=0).to(tl.int64)
    rows = tl.load(SrcRows + offs, mask=live, other=0).to(tl.int64)
    lens = tl.load(SrcLens + offs, mask=live, other=0).to(tl.int64)
    locs = tl.load(SrcLocs + offs, mask=live, other=0).to(tl.int64)
    pos = tl.load(SrcPos + offs, mask=live, other=0).to(tl.int64)
    lens = tl.where(live, lens, fill)
    tl.store(Ids + offs, ids, mask=out)
    tl.store(Rows + offs, rows, mask=out)
    tl.store(Lens + offs, lens, mask=out)
    tl.store(Locs + offs, locs, mask=out)
    tl.store(Pos + offs, pos, mask=out)


def load_graph_inputs(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], bs: int, fill: int) -> None:
    """dst: the graph's (input_ids, req_pool_indices, seq_lens, out_cache_loc, positions) int64 buffers of at least
    `bs` rows; src: the batch's same five 1-D tensors of `raw` <= bs rows. Rows raw..bs-1 become padding: zeros,
    and `fill` as their sequence length."""
    if len(dst) != 5 or len(src) != 5:
        raise ValueError(f"load_graph_inputs takes five destination and five source tensors; got {len(dst)}/{len(src)}")
    raw = src[0].shape[0]
    if any(t.dim() != 1 or t.shape[0] != raw or t.stride(0) != 1 for t in src):
        raise ValueError(f"source tensors must be contiguous 1-D of one length; got {[tuple(t.shape) for t in src]}")
    if any(t.dim() != 1 or t.shape[0] < bs or t.dtype != torch.int64 or t.stride(0) != 1 for t in dst):
        raise ValueError(f"destination buffers must be contiguous 1-D int64 of at least {bs} rows")
    if not 1 <= raw <= bs:
        raise ValueError(f"a batch of {raw} rows does not fit a graph of {bs}")
    launch(_load_graph_inputs_kernel, (triton.cdiv(bs, _BLOCK),), *dst, *src, raw, bs, fill, BLOCK=_BLOCK)
