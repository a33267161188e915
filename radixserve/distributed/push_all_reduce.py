"""A one-shot all-reduce with no barrier and no flags: each rank pushes its message into its peers' buffers, and the
data itself says when it has arrived.

The pull one-shot (`triton_all_reduce.py`) copies the message into its own buffer, fences, raises a flag in every
peer, waits for the peers' flags and then reads their buffers over NVLink: a fence, a flag round trip and a remote
read per call. Here a rank stores its message straight into a slot of every peer's buffer (remote stores, posted:
nothing waits for them) and then polls its own buffer, which the peers fill the same way. A buffer slot holds a
sentinel bit pattern (negative zero) wherever nothing has arrived; a sender turns any negative zero of its message
into positive zero (the sum does not change), so an element that is not the sentinel is the peer's value. The cost
is one one-way NVLink latency plus local polling.

Reuse: each program (one chunk of the message, or one row in the fused kernel) keeps a slot counter that cycles
through three slots. After summing slot `s` a program clears the slot of its previous call, `s - 1`. That slot is
written again only at this program's call after next, which a peer can only reach after it received this rank's
data of the next call, sent by a later kernel than the one that cleared it: so the clear always lands first. The
counters live in device memory, so CUDA-graph replays advance them; every rank makes the same sequence of calls,
so the programs' slots agree across ranks.

`PushAddRMSNorm` fuses the residual add and RMSNorm after the sum (one program per row), as the pull kernel does.
The buffers come from PyTorch's symmetric memory (`from_symm_mem`), or from the caller: the CPU tests hand in
shared-memory tensors mapped by two processes and run the kernels under TRITON_INTERPRET=1. The slot and chunk
arithmetic, the buffers and the fused add + RMSNorm tail are shared with the pull kernels (`one_shot_common.py`).
"""

from __future__ import annotations

import os

import torch
import torch.distributed as dist
import triton
import triton.language as tl

from radixserve.distributed.one_shot_common import (
    BLOCK,
    MAX_PROGRAMS,
    SymmBuffers,
    add_rmsnorm_store,
    buffer_of,
    can_fuse_rows,
    chunk,
    next_slot_cycle,
    slot_offset,
)
from radixserve.layers.triton_ops.pdl import l2_prefetch

ROW_STRIDE = 8192  # elements reserved per row in the fused kernel's slots: rows up to this width are fused
PF_LINES = 1024  # 128-byte lines each prefetching program asks the L2 for
PF_MAX_ROWS = 8  # prefetch only at decode-sized batches (bandwidth-bound GEMMs after the norm)
N_SLOTS = 3
_BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}
_SENTINEL = {torch.int16: -(1 << 15), torch.int32: -(1 << 31)}  # the bits of -0.0


@triton.jit
def _push_poll_sum(b, mask, buf_ptrs, slot, at, region, x_ptr, out_ptr, SENT: tl.constexpr, RANK: tl.constexpr,
                   WORLD: tl.constexpr):
    """Store this rank's bits `b` (no sentinel among them) at `at` of this rank's region of `slot` in every peer's
    buffer, then wait for the peers' data in this rank's buffer and return the float32 sum over the ranks in rank
    order (every rank gets the same bits). x_ptr / out_ptr: the message's bits / the output (for their types)."""
    dt = out_ptr.dtype.element_ty
    for r in tl.static_range(WORLD):
        if r != RANK:
            tl.store(buffer_of(buf_ptrs, r, x_ptr) + slot_offset(slot, RANK, WORLD, region) + at, b, mask=mask)
    mine = buffer_of(buf_ptrs, RANK, x_ptr)
    acc = tl.zeros(b.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += b.to(dt, bitcast=True).to(tl.float32)
        else:
            src = mine + slot_offset(slot, r, WORLD, region) + at
            v = tl.load(src, mask=mask, other=0, volatile=True)
            while tl.max((v == SENT).to(tl.int32), axis=0) > 0:
                v = tl.load(src, mask=mask, other=0, volatile=True)
            acc += v.to(dt, bitcast=True).to(tl.float32)
    return acc


@triton.jit
def _clear(buf_ptrs, slot, at, mask, region, b, x_ptr, SENT: tl.constexpr, RANK: tl.constexpr,
           WORLD: tl.constexpr):
    """The sentinel back into the peers' regions of `slot` at `at` in this rank's buffer (`b`, x_ptr: the bits'
    type)."""
    mine = buffer_of(buf_ptrs, RANK, x_ptr)
    clear = (b * 0 + SENT).to(b.dtype)
    for r in tl.static_range(WORLD):
        if r != RANK:
            tl.store(mine + slot_offset(slot, r, WORLD, region) + at, clear, mask=mask)


@triton.jit
def _outgoing(x_ptr, offs, mask, SENT: tl.constexpr):
    """This rank's message as bits (x comes as its integer view), -0.0 sent as +0.0: the sentinel is never sent."""
    b = tl.load(x_ptr + offs, mask=mask, other=0)
    return tl.where(b == SENT, 0, b).to(x_ptr.dtype.element_ty)


@triton.jit
def _push_one_shot_kernel(x_ptr, out_ptr, buf_ptrs, slots, numel, slot_numel, SENT: tl.constexpr,
                          RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    cur = next_slot_cycle(slots, pid, 3)
    offs, mask = chunk(pid, numel, BLOCK)
    b = _outgoing(x_ptr, offs, mask, SENT)
    acc = _push_poll_sum(b, mask, buf_ptrs, cur, offs, slot_numel, x_ptr, out_ptr, SENT, RANK, WORLD)
    tl.store(out_ptr + offs, acc.to(out_ptr.dtype.element_ty), mask=mask)
    _clear(buf_ptrs, (cur + 2) % 3, offs, offs >= 0, slot_numel, b, x_ptr, SENT, RANK, WORLD)  # the whole chunk


@triton.jit
def _push_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_ptrs, slots, widths, n_rows, n_cols,
                             slot_numel, eps, pf_addr, pf_bytes, SENT: tl.constexpr, RANK: tl.constexpr,
                             WORLD: tl.constexpr, STRIDE: tl.constexpr, BLOCK: tl.constexpr,
                             PF_LINES: tl.constexpr):
    """One row per program: the row's sum over the ranks, then `add_rmsnorm_store`. Programs past the rows
    (PF_LINES > 0) ask the L2 for the first `pf_bytes` of the weight the next layer reads, PF_LINES 128-byte lines
    each: the memory works while the all-reduce waits on the link."""
    row = tl.program_id(0)
    if row < n_rows:
        cur = next_slot_cycle(slots, row, 3)
        prev_width = tl.load(widths + row)
        tl.store(widths + row, n_cols)
        cols = tl.arange(0, BLOCK)
        mask = cols < n_cols
        b = _outgoing(x_ptr, row * n_cols + cols, mask, SENT)
        acc = _push_poll_sum(b, mask, buf_ptrs, cur, row * STRIDE + cols, slot_numel, x_ptr, out_ptr, SENT, RANK,
                             WORLD)
        add_rmsnorm_store(acc, row, cols, mask, n_cols, res_ptr, w_ptr, out_ptr, res_out_ptr, eps)
        for start in range(0, prev_width, BLOCK):  # what this row's previous call received, whatever its width
            _clear(buf_ptrs, (cur + 2) % 3, row * STRIDE + start + cols, start + cols < prev_width, slot_numel, b,
                   x_ptr, SENT, RANK, WORLD)
    elif PF_LINES > 0:
        lines = (row - n_rows) * PF_LINES + tl.arange(0, PF_LINES)
        offs = tl.minimum(lines.to(tl.int64) * 128, pf_bytes - 1)
        l2_prefetch(pf_addr + offs)


class PushBuffers(SymmBuffers):
    """`SymmBuffers` of 3 slots x world source regions per dtype, every element the sentinel at first; `counters`
    hold each program's current slot, `widths` each fused row's width at its last call."""

    def __init__(self, rank: int, world: int, bufs: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, int]],
                 device: torch.device | str) -> None:
        super().__init__(rank, world, bufs, device)
        self.widths = {d: torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device) for d in bufs}

    @staticmethod
    def fill(buf: torch.Tensor) -> None:
        """Every element the sentinel (call before any rank pushes)."""
        bits = _BITS[buf.dtype]
        buf.view(bits).fill_(_SENTINEL[bits])

    @classmethod
    def from_symm_mem(cls, group: dist.ProcessGroup, device: torch.device | str,
                      slot_numel: dict[torch.dtype, int]) -> PushBuffers:
        return super().from_symm_mem(group, device, slot_numel, regions=N_SLOTS * dist.get_world_size(group),
                                     init=cls.fill)


class PushOneShot:
    """`self(x)`: the sum of x over the ranks (a new tensor), x of at most `max_bytes`."""

    def __init__(self, buffers: PushBuffers, max_bytes: int) -> None:
        self.b = buffers
        self.max_bytes = min(max_bytes, MAX_PROGRAMS * BLOCK * 2)

    @classmethod
    def from_symm_mem(cls, group: dist.ProcessGroup, device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                      max_bytes: int) -> PushOneShot:
        numel = {d: triton.cdiv(max_bytes * 8 // torch.finfo(d).bits, BLOCK) * BLOCK for d in dtypes}
        return cls(PushBuffers.from_symm_mem(group, device, numel), max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _, ptrs, slot_numel = self.b.bufs[x.dtype]
        out = torch.empty_like(x)
        n = x.numel()
        if n > slot_numel:
            raise ValueError(f"a message of {n} elements is larger than the one-shot buffer ({slot_numel})")
        bits = _BITS[x.dtype]
        if n:
            _push_one_shot_kernel[(triton.cdiv(n, BLOCK),)](x.view(bits), out, ptrs, self.b.counters[x.dtype], n,
                                                            slot_numel, SENT=_SENTINEL[bits], RANK=self.b.rank,
                                                            WORLD=self.b.world, BLOCK=BLOCK, num_warps=4)
        return out


class PushAddRMSNorm:
    """all-reduce(x) + residual, then RMSNorm, in one kernel: rows of x up to `ROW_STRIDE` wide, one program each."""

    def __init__(self, buffers: PushBuffers, max_rows: int, prefetch_bytes: int | None = None) -> None:
        self.b = buffers
        self.max_rows = min(max_rows, MAX_PROGRAMS)
        self.prefetch_bytes = int(float(os.environ.get("RADIXSERVE_AR_PREFETCH_MB", "0")) * 2**20) \
            if prefetch_bytes is None else prefetch_bytes

    @classmethod
    def from_symm_mem(cls, group: dist.ProcessGroup, device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                      max_rows: int) -> PushAddRMSNorm:
        bufs = PushBuffers.from_symm_mem(group, device, {d: max_rows * ROW_STRIDE for d in dtypes})
        return cls(bufs, max_rows)

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (can_fuse_rows(x, residual, self.b.bufs, self.max_rows, ROW_STRIDE)
                and x.shape[0] * ROW_STRIDE <= self.b.bufs[x.dtype][2])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                 prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """`prefetch`: a CUDA tensor (the next layer's weight) whose first `prefetch_bytes` the idle SMs pull into
        the L2 while the all-reduce waits."""
        _, ptrs, slot_numel = self.b.bufs[x.dtype]
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        rows = x.shape[0]
        if rows:
            bits = _BITS[x.dtype]
            pf_bytes = 0
            if prefetch is not None and self.prefetch_bytes > 0 and prefetch.is_cuda and rows <= PF_MAX_ROWS:
                pf_bytes = min(self.prefetch_bytes, prefetch.numel() * prefetch.element_size())
            pf_programs = triton.cdiv(pf_bytes, PF_LINES * 128)
            _push_add_rmsnorm_kernel[(rows + pf_programs,)](
                x.view(bits), residual, weight, out, new_residual, ptrs, self.b.counters[x.dtype],
                self.b.widths[x.dtype], rows, x.shape[1], slot_numel, eps,
                prefetch.data_ptr() if pf_bytes else 0, max(pf_bytes, 1), SENT=_SENTINEL[bits], RANK=self.b.rank,
                WORLD=self.b.world, STRIDE=ROW_STRIDE, BLOCK=triton.next_power_of_2(x.shape[1]),
                PF_LINES=PF_LINES if pf_bytes else 0, num_warps=8)
        return out, new_residual
