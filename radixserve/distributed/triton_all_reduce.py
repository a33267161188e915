"""A one-shot all-reduce in one Triton kernel over symmetric-memory buffers, with one barrier per call.

PyTorch's one-shot kernel synchronises the ranks twice (before reading the peers' buffers and again before
returning, so a buffer is never overwritten while a peer still reads it). Here the buffer has two halves used on
alternate calls, so the second barrier is not needed: a rank writes half `p` again two calls later, and by then
every peer has signalled the call in between, which it could only do after finishing its reads of half `p`.

Per program (one BLOCK-sized chunk of the message): bump this program's call counter (device memory: the count
survives CUDA-graph replays), copy the local chunk into this rank's buffer half, fence, write the counter into
every peer's flag slot for (program, this rank), spin until every peer's flag for (program, peer) reaches the
counter, then sum the chunk over the ranks in rank order (so every rank gets the same bits) into the output.
Flags are compared with wrap-around arithmetic and the half is the counter's low bit, so the int32 counters may
overflow. Each message dtype has its own buffer, flags and counters. The slot and chunk arithmetic, the buffers and
the fused add + RMSNorm tail are shared with the push kernels (`one_shot_common.py`).
"""

from __future__ import annotations

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
    elements,
    next_slot,
    slot_offset,
)

_FLAG_REGION = MAX_PROGRAMS  # flags per source rank: one per program


@triton.jit
def _fence_sys(x):
    # every thread's earlier stores become visible to the other GPUs before the flag that announces them
    return tl.inline_asm_elementwise("fence.acq_rel.sys;\n mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _publish_and_wait(x, mask, dst, flag_ptrs, program, epoch, RANK: tl.constexpr, WORLD: tl.constexpr,
                      FENCE: tl.constexpr):
    """Store x at dst (this rank's buffer), then tell every peer that this program's data of call `epoch` is
    there and wait until every peer said the same of theirs."""
    tl.store(dst, x, mask=mask)
    if FENCE:  # (the interpreter runs no inline assembly; its stores are visible at once)
        _fence_sys(program)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + program * WORLD + RANK, epoch, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen = tl.atomic_add(my_flags + program * WORLD + r, 0, sem="acquire", scope="sys")
            while seen - epoch < 0:
                seen = tl.atomic_add(my_flags + program * WORLD + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()


@triton.jit
def _pull_sum(x, x_ptr, buf_ptrs, at, mask, RANK: tl.constexpr, WORLD: tl.constexpr):
    """The float32 sum over the ranks in rank order (every rank gets the same bits): x here, the peers' from
    their buffers at `at`."""
    acc = tl.zeros(x.shape, dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            peer = buffer_of(buf_ptrs, r, x_ptr)
            acc += tl.load(peer + at, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    return acc


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, buf_ptrs, flag_ptrs, counters, numel, half_numel,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr, FENCE: tl.constexpr):
    pid = tl.program_id(0)
    epoch, half = next_slot(counters, pid, 2)
    offs, mask = chunk(pid, numel, BLOCK)
    at = slot_offset(half, 0, 1, half_numel) + offs
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    _publish_and_wait(x, mask, buffer_of(buf_ptrs, RANK, x_ptr) + at, flag_ptrs, pid, epoch, RANK, WORLD, FENCE)
    acc = _pull_sum(x, x_ptr, buf_ptrs, at, mask, RANK, WORLD)
    tl.store(out_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)


@triton.jit
def _one_shot_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_ptrs, flag_ptrs, counters,
                                 n_cols, half_numel, eps, RANK: tl.constexpr, WORLD: tl.constexpr,
                                 BLOCK: tl.constexpr, FENCE: tl.constexpr):
    """One row per program: the row's sum over the ranks, then `add_rmsnorm_store`."""
    row = tl.program_id(0)
    epoch, half = next_slot(counters, row, 2)
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    at = slot_offset(half, 0, 1, half_numel) + row * n_cols + cols
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    _publish_and_wait(x, mask, buffer_of(buf_ptrs, RANK, x_ptr) + at, flag_ptrs, row, epoch, RANK, WORLD, FENCE)
    acc = _pull_sum(x, x_ptr, buf_ptrs, at, mask, RANK, WORLD)
    add_rmsnorm_store(acc, row, cols, mask, n_cols, res_ptr, w_ptr, out_ptr, res_out_ptr, eps)


class PullBuffers:
    """Per dtype: the data buffers (two halves of `SymmBuffers` regions, this rank's message only), the flags (one
    per program and source rank) and the call counters."""

    def __init__(self, data: SymmBuffers, flags: SymmBuffers) -> None:
        self.data, self.flags = data, flags
        self.rank, self.world = data.rank, data.world

    @classmethod
    def from_symm_mem(cls, group: dist.ProcessGroup, device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                      max_bytes: int) -> PullBuffers:
        half = {d: elements(max_bytes, d) for d in dtypes}
        data = SymmBuffers.from_symm_mem(group, device, half, regions=2)
        world = dist.get_world_size(group)
        # every rank's flags are zero before anyone signals
        flags = SymmBuffers.from_symm_mem(group, device, {d: _FLAG_REGION for d in dtypes}, regions=world,
                                          storage=torch.int32, init=torch.Tensor.zero_)
        return cls(data, flags)

    def args(self, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, int]:
        """(data buffer addresses, flag buffer addresses, counters, elements of a half) of this dtype."""
        _, ptrs, half = self.data.bufs[dtype]
        return ptrs, self.flags.bufs[dtype][1], self.data.counters[dtype], half


def _fence() -> bool:
    import os

    return os.environ.get("TRITON_INTERPRET", "0") in ("0", "")


class TritonOneShot:
    """`self(x)`: the sum of x over the ranks (a new tensor), x of at most `max_bytes`."""

    def __init__(self, buffers: PullBuffers, max_bytes: int) -> None:
        self.b = buffers
        self.max_bytes = min(max_bytes, MAX_PROGRAMS * BLOCK * 2)

    @classmethod
    def from_symm_mem(cls, group: dist.ProcessGroup, device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                      max_bytes: int) -> TritonOneShot:
        max_bytes = min(max_bytes, MAX_PROGRAMS * BLOCK * 2)
        return cls(PullBuffers.from_symm_mem(group, device, dtypes, max_bytes), max_bytes)

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        ptrs, flag_ptrs, counters, half = self.b.args(x.dtype)
        out = torch.empty_like(x)
        n = x.numel()
        if n > half:
            raise ValueError(f"a message of {n} elements is larger than the one-shot buffer ({half})")
        if n:
            _one_shot_kernel[(triton.cdiv(n, BLOCK),)](x, out, ptrs, flag_ptrs, counters, n, half, RANK=self.b.rank,
                                                       WORLD=self.b.world, BLOCK=BLOCK, FENCE=_fence(), num_warps=4)
        return out


class TritonAllReduceAddNorm:
    """all-reduce(x) + residual, then RMSNorm, in one kernel (rows of x: one program each). Buffers, flags and
    counters of its own: a buffer region must always be written by the same program slot (see the module doc)."""

    def __init__(self, buffers: PullBuffers, max_bytes: int) -> None:
        self.b = buffers
        self.max_bytes = min(max_bytes, MAX_PROGRAMS * BLOCK * 2)

    @classmethod
    def from_symm_mem(cls, group: dist.ProcessGroup, device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                      max_bytes: int) -> TritonAllReduceAddNorm:
        max_bytes = min(max_bytes, MAX_PROGRAMS * BLOCK * 2)
        return cls(PullBuffers.from_symm_mem(group, device, dtypes, max_bytes), max_bytes)

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (can_fuse_rows(x, residual, self.b.data.bufs, MAX_PROGRAMS, 1 << 16)
                and x.numel() <= self.b.data.bufs[x.dtype][2])

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        ptrs, flag_ptrs, counters, half = self.b.args(x.dtype)
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        if x.shape[0]:
            _one_shot_add_rmsnorm_kernel[(x.shape[0],)](x, residual, weight, out, new_residual, ptrs, flag_ptrs,
                                                         counters, x.shape[1], half, eps, RANK=self.b.rank,
                                                         WORLD=self.b.world, BLOCK=triton.next_power_of_2(x.shape[1]),
                                                         FENCE=_fence(), num_warps=8)
        return out, new_residual
