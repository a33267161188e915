"""What the two Triton one-shot all-reduces share: the pull kernels (`triton_all_reduce.py`: flags, remote reads)
and the push kernels (`push_all_reduce.py`: remote stores, data that marks its own arrival).

- Slots: each program (one chunk of the message, or one row in the fused kernels) keeps a call counter in device
  memory (so CUDA-graph replays advance it) and works in slot `calls % n_slots` of the buffers: the pull kernels
  alternate two halves of their own buffer, the push kernels cycle three slots of each receiver's buffer. A slot
  holds one region per source rank; `slot_offset` is where (slot, source) starts.
- Chunks: a plain one-shot program sums BLOCK elements of the flat message (`chunk`), a fused program one row.
- The fused tail: sum + residual, rounded (the new residual), then RMSNorm as layers/triton_ops/norm.py rounds it.
- The buffers (`SymmBuffers`): per dtype, this rank's buffer, every rank's buffer address as seen from this process,
  and the elements of one slot region; from PyTorch's symmetric memory, or handed in (the CPU tests map shared-memory
  tensors into two processes and run the kernels under TRITON_INTERPRET=1).
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK = 1024  # elements per program of the plain one-shot kernels
MAX_PROGRAMS = 2048  # call counters per buffer: programs (chunks or rows) of one call at most


@triton.jit
def next_slot(counters, program, N_SLOTS: tl.constexpr):
    """This program's next call: its count (int32, wrapping) and the slot it uses, `count mod N_SLOTS` (a power
    of two keeps the cycle across the wrap: the bits, not C's signed remainder)."""
    count = tl.load(counters + program) + 1
    tl.store(counters + program, count)
    return count, count & (N_SLOTS - 1)


@triton.jit
def next_slot_cycle(slots, program, N_SLOTS: tl.constexpr):
    """The slot of this program's next call when N_SLOTS is no power of two: the counter holds the slot itself."""
    cur = (tl.load(slots + program) + 1) % N_SLOTS
    tl.store(slots + program, cur)
    return cur


@triton.jit
def slot_offset(slot, src, WORLD: tl.constexpr, region):
    """First element of source `src`'s region in `slot` of a buffer holding WORLD regions of `region` elements a
    slot (64-bit: buffers may pass 2^31 elements)."""
    return (slot * WORLD + src).to(tl.int64) * region


@triton.jit
def chunk(program, numel, BLOCK: tl.constexpr):
    """The flat elements this program of a plain one-shot sums, and which of them exist."""
    offs = program * BLOCK + tl.arange(0, BLOCK)
    return offs, offs < numel


@triton.jit
def buffer_of(buf_ptrs, rank, elem):
    """Rank `rank`'s buffer, addressed from this process, typed as `elem` (a pointer whose element type it takes)."""
    return tl.load(buf_ptrs + rank).to(tl.pointer_type(elem.dtype.element_ty))


@triton.jit
def add_rmsnorm_store(acc, row, cols, mask, n_cols, res_ptr, w_ptr, out_ptr, res_out_ptr, eps):
    """Row `row` of the fused kernels' output from its float32 sum over the ranks: the sum rounded to the activation
    dtype (as an all-reduce returns it), + residual, rounded (stored: the new residual), RMSNorm times the weight."""
    dt = out_ptr.dtype.element_ty
    res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
    s = (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(res_out_ptr + row * n_cols + cols, s, mask=mask)
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / n_cols
    normed = (sf * tl.rsqrt(var + eps)).to(dt)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(dt), mask=mask)


def elements(nbytes: int, dtype: torch.dtype) -> int:
    """How many `dtype` elements fit in `nbytes`."""
    return nbytes * 8 // torch.finfo(dtype).bits


class SymmBuffers:
    """Per dtype: (this rank's buffer, every rank's buffer address as an int64 tensor on the buffer's device, the
    elements of one slot region), and per dtype `MAX_PROGRAMS` call counters (zero) on `device`."""

    def __init__(self, rank: int, world: int, bufs: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, int]],
                 device: torch.device | str) -> None:
        self.rank, self.world, self.bufs = rank, world, bufs
        self.counters = {d: torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device) for d in bufs}

    @classmethod
    def from_symm_mem(cls, group: dist.ProcessGroup, device: torch.device | str, region: dict[torch.dtype, int],
                      regions: int, storage: torch.dtype | None = None,
                      init: Callable[[torch.Tensor], object] | None = None) -> SymmBuffers:
        """Per dtype a buffer of `regions x region[dtype]` elements of that dtype (or of `storage`: the pull kernels'
        int32 flags, one set per message dtype), set by `init` before any rank may write into a peer's (a
        barrier)."""
        import torch.distributed._symmetric_memory as symm_mem

        rank, world, bufs = dist.get_rank(group), dist.get_world_size(group), {}
        for dtype, n in region.items():
            buf = symm_mem.empty(regions * n, dtype=storage or dtype, device=device)
            if init is not None:
                init(buf)
            handle = symm_mem.rendezvous(buf, group.group_name)
            rank = handle.rank
            bufs[dtype] = (buf, torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device), n)
        out = cls(rank, world, bufs, device)
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's buffers are set before anyone writes into them
        return out


def can_fuse_rows(x: torch.Tensor, residual: torch.Tensor, dtypes: dict, max_rows: int, max_cols: int) -> bool:
    """Whether the fused kernels take this message: 2-D, contiguous, the residual's shape, rows and columns within
    the buffers."""
    return (x.dtype in dtypes and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()
            and residual.shape == x.shape and x.shape[0] <= min(max_rows, MAX_PROGRAMS) and 0 < x.shape[1] <= max_cols)
