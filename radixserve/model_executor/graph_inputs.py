"""Load a decode batch into a CUDA graph's static input buffers in one kernel launch.

Replaying a captured decode graph first copies the batch's input ids, request rows, sequence lengths, KV slots and
positions into the buffers the graph reads, and fills the padding rows up to the captured batch size. As torch ops
that is five copies and, for a padded batch, five fills: up to ten tiny kernels and their launches per step, on the
GPU between two graph replays. This kernel does all of it at once. The row counts are runtime values (not
specialised), so no batch size compiles a variant of its own while serving.

A decode batch the scheduler built in one host array (`ScheduleBatch.decode_pack`: a header row with the batch size
and the row stride, then ids, request rows, lengths, KV slots, positions) arrives in the graph runner's static
device copy of that array, and its kernel does two more things a step would otherwise spend launches on: it
resolves input ids still in flight (-(slot) in the overlap worker's future map) and it writes each request's new KV
slot into the device request table. The kernel reads the batch size from the header, so it can be captured in the
graph itself (`CudaGraphRunner`): a step then makes one host-to-device copy and one graph launch. A header batch
size of -1 makes it do nothing (the replays whose buffers `load_graph_inputs` filled)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch

_BLOCK = 256


@triton.jit
def _store_graph_inputs(Ids, Rows, Lens, Locs, Pos, offs, live, out, ids, rows, lens, locs, pos, fill):
    """The graph's five buffers at rows `offs` (< bs: `out`): the batch's values where `live` (< raw), else padding
    (zeros, and `fill` as the length)."""
    tl.store(Ids + offs, ids, mask=out)
    tl.store(Rows + offs, rows, mask=out)
    tl.store(Lens + offs, tl.where(live, lens, fill), mask=out)
    tl.store(Locs + offs, locs, mask=out)
    tl.store(Pos + offs, pos, mask=out)


@triton.jit(do_not_specialize=["raw", "bs", "fill"])
def _load_graph_inputs_kernel(Ids, Rows, Lens, Locs, Pos, SrcIds, SrcRows, SrcLens, SrcLocs, SrcPos, Header, raw, bs,
                              fill, HAS_HEADER: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    if HAS_HEADER:  # a pack kernel captured in the graph must leave these buffers alone: its batch size -1
        tl.store(Header, -1, mask=pid == 0)
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    live = offs < raw
    out = offs < bs
    ids = tl.load(SrcIds + offs, mask=live, other=0).to(tl.int64)
    rows = tl.load(SrcRows + offs, mask=live, other=0).to(tl.int64)
    lens = tl.load(SrcLens + offs, mask=live, other=0).to(tl.int64)
    locs = tl.load(SrcLocs + offs, mask=live, other=0).to(tl.int64)
    pos = tl.load(SrcPos + offs, mask=live, other=0).to(tl.int64)
    _store_graph_inputs(Ids, Rows, Lens, Locs, Pos, offs, live, out, ids, rows, lens, locs, pos, fill)


def check_graph_buffers(dst: tuple[torch.Tensor, ...], bs: int) -> None:
    """Raise unless `dst` is five contiguous 1-D int64 buffers of at least `bs` rows (a graph's inputs)."""
    if len(dst) != 5:
        raise ValueError(f"a decode graph has five input buffers; got {len(dst)}")
    if any(t.dim() != 1 or t.shape[0] < bs or t.dtype != torch.int64 or t.stride(0) != 1 for t in dst):
        raise ValueError(f"destination buffers must be contiguous 1-D int64 of at least {bs} rows")


def load_graph_inputs(dst: tuple[torch.Tensor, ...], src: tuple[torch.Tensor, ...], bs: int, fill: int,
                      header: torch.Tensor | None = None) -> None:
    """dst: the graph's (input_ids, req_pool_indices, seq_lens, out_cache_loc, positions) int64 buffers of at least
    `bs` rows; src: the batch's same five 1-D tensors of `raw` <= bs rows. Rows raw..bs-1 become padding: zeros,
    and `fill` as their sequence length. `header`: the device pack whose batch size is set to -1 (a graph that
    loads its inputs from that pack itself then leaves these alone)."""
    if len(src) != 5:
        raise ValueError(f"load_graph_inputs takes five source tensors; got {len(src)}")
    check_graph_buffers(dst, bs)
    raw = src[0].shape[0]
    if any(t.dim() != 1 or t.shape[0] != raw or t.stride(0) != 1 for t in src):
        raise ValueError(f"source tensors must be contiguous 1-D of one length; got {[tuple(t.shape) for t in src]}")
    if not 1 <= raw <= bs:
        raise ValueError(f"a batch of {raw} rows does not fit a graph of {bs}")
    if header is not None and (header.dtype != torch.int64 or header.numel() < 1):
        raise ValueError("the pack header must be an int64 tensor")
    launch(_load_graph_inputs_kernel, (triton.cdiv(bs, _BLOCK),), *dst, *src,
           header if header is not None else src[0], raw, bs, fill, HAS_HEADER=header is not None, BLOCK=_BLOCK)


@triton.jit(do_not_specialize=["table_stride", "bs", "fill"])
def _load_decode_pack_kernel(Ids, Rows, Lens, Locs, Pos, Src, Future, Table, table_stride, bs, fill,
                             HAS_FUTURE: tl.constexpr, BLOCK: tl.constexpr):
    raw = tl.load(Src)  # the header: batch size (-1: nothing to load) and row stride
    stride = tl.load(Src + 1)
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    lim = tl.where(raw >= 0, bs, 0)
    out = offs < lim
    live = offs < tl.minimum(raw, lim)
    ids = tl.load(Src + stride + offs, mask=live, other=0)
    rows = tl.load(Src + 2 * stride + offs, mask=live, other=0)
    lens = tl.load(Src + 3 * stride + offs, mask=live, other=0)
    locs = tl.load(Src + 4 * stride + offs, mask=live, other=0)
    pos = tl.load(Src + 5 * stride + offs, mask=live, other=0)
    if HAS_FUTURE:
        pending = live & (ids < 0)
        ids = tl.where(pending, tl.load(Future + tl.where(pending, -ids, 0), mask=pending, other=0), ids)
    tl.store(Table + rows * table_stride + pos, locs.to(tl.int32), mask=live)
    _store_graph_inputs(Ids, Rows, Lens, Locs, Pos, offs, live, out, ids, rows, lens, locs, pos, fill)


def load_decode_pack(dst: tuple[torch.Tensor, ...], pack: torch.Tensor, bs: int, fill: int,
                     req_to_token: torch.Tensor, future_map: torch.Tensor | None = None) -> None:
    """dst: the graph's five int64 input buffers (as for `load_graph_inputs`); pack: the batch's contiguous int64
    [6, m] device array: row 0 the header (batch size `raw` <= m, -1 for none, then m), rows 1-5 the input ids,
    request rows, sequence lengths, KV slots and positions. Besides loading the buffers (rows raw..bs-1 padding; a
    batch larger than `bs` is cut at bs), it sets req_to_token[row, position] = KV slot for each live request and,
    given `future_map`, replaces each input id -s by future_map[s]. The header is read on the device."""
    check_graph_buffers(dst, bs)
    if pack.dim() != 2 or pack.shape[0] != 6 or pack.shape[1] < 2 or not pack.is_contiguous() \
            or pack.dtype != torch.int64:
        raise ValueError(f"the decode pack must be a contiguous int64 [6, >= 2] array; got {tuple(pack.shape)} "
                         f"{pack.dtype}")
    if req_to_token.dim() != 2 or req_to_token.dtype != torch.int32 or req_to_token.stride(1) != 1:
        raise ValueError("req_to_token must be a 2-D int32 table with contiguous rows")
    if bs < 1:
        raise ValueError(f"a graph has at least one row; got {bs}")
    launch_decode_pack(dst, pack, bs, fill, req_to_token, future_map)


def launch_decode_pack(dst: tuple[torch.Tensor, ...], pack: torch.Tensor, bs: int, fill: int,
                       req_to_token: torch.Tensor, future_map: torch.Tensor | None = None) -> None:
    """`load_decode_pack` without its checks, for the graph runner (which checked its buffers when it made them;
    the request table is the pool's int32 one; the pack is its static device copy)."""
    has_future = future_map is not None
    launch(_load_decode_pack_kernel, (triton.cdiv(bs, _BLOCK),), *dst, pack,
           future_map if has_future else pack, req_to_token, req_to_token.stride(0), bs, fill,
           HAS_FUTURE=has_future, BLOCK=_BLOCK)
