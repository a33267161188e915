"""A one-shot all-reduce in one Triton kernel over symmetric-memory buffers, with one barrier per call.

PyTorch's one-shot kernel synchronises the ranks twice (before reading the peers' buffers and again before
returning, so a buffer is never overwritten while a peer still reads it). Here the buffer has two halves used on
alternate calls, so the second barrier is not needed: a rank writes half `p` again two calls later, and by then
every peer has signalled the call in between, which it could only do after finishing its reads of half `p`.

Per program (one BLOCK-sized chunk of the message): bump this program's call counter (device memory: the count
survives CUDA-graph replays), copy the local chunk into this rank's buffer half, fence, write the counter into
every peer's flag slot for (program, this rank), spin until every peer's flag for (program, peer) reaches the
counter, then sum the chunk over the ranks in rank order (so every rank gets the same bits) into the output.
Flags are compared with wrap-around arithmetic, so the int32 counters may overflow.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import triton
import triton.language as tl

BLOCK = 1024  # elements per program
MAX_PROGRAMS = 2048


@triton.jit
def _fence_sys(x):
    # every thread's earlier stores become visible to the other GPUs before the flag that announces them
    return tl.inline_asm_elementwise("fence.acq_rel.sys;\n mov.u32 $0, $1;", "=r,r", [x], dtype=tl.int32,
                                     is_pure=False, pack=1)


@triton.jit
def _one_shot_kernel(x_ptr, out_ptr, buf_ptrs, flag_ptrs, counters, numel, half_numel,
                     RANK: tl.constexpr, WORLD: tl.constexpr, BLOCK: tl.constexpr):
    pid = tl.program_id(0)
    epoch = tl.load(counters + pid) + 1
    tl.store(counters + pid, epoch)
    base = (epoch % 2) * half_numel
    offs = pid * BLOCK + tl.arange(0, BLOCK)
    mask = offs < numel
    x = tl.load(x_ptr + offs, mask=mask, other=0.0)
    mine = tl.load(buf_ptrs + RANK).to(tl.pointer_type(x_ptr.dtype.element_ty))
    tl.store(mine + base + offs, x, mask=mask)
    _fence_sys(pid)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + pid * WORLD + RANK, epoch, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen = tl.atomic_add(my_flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
            while seen - epoch < 0:
                seen = tl.atomic_add(my_flags + pid * WORLD + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            peer = tl.load(buf_ptrs + r).to(tl.pointer_type(x_ptr.dtype.element_ty))
            acc += tl.load(peer + base + offs, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    tl.store(out_ptr + offs, acc.to(x_ptr.dtype.element_ty), mask=mask)


class TritonOneShot:
    """Buffers (two halves of `max_bytes` per dtype), flags and counters for `_one_shot_kernel`."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                 max_bytes: int) -> None:
        import torch.distributed._symmetric_memory as symm_mem

        group_name = self.group_name = group.group_name
        self.max_bytes = min(max_bytes, MAX_PROGRAMS * BLOCK * 2)
        self.bufs: dict[torch.dtype, tuple[torch.Tensor, torch.Tensor, int]] = {}
        rank = world = 0
        for dtype in dtypes:
            half = self.max_bytes * 8 // torch.finfo(dtype).bits
            buf = symm_mem.empty(2 * half, dtype=dtype, device=device)
            handle = symm_mem.rendezvous(buf, group_name)
            rank, world = handle.rank, handle.world_size
            ptrs = torch.tensor(handle.buffer_ptrs, dtype=torch.int64, device=device)
            self.bufs[dtype] = (buf, ptrs, half)
        self.flags = symm_mem.empty(MAX_PROGRAMS * world, dtype=torch.int32, device=device)
        self.flags.zero_()
        fh = symm_mem.rendezvous(self.flags, group_name)
        self.flag_ptrs = torch.tensor(fh.buffer_ptrs, dtype=torch.int64, device=device)
        self.counters = torch.zeros(MAX_PROGRAMS, dtype=torch.int32, device=device)
        self.rank, self.world = rank, world
        torch.cuda.synchronize(device)
        dist.barrier(group=group)  # every rank's flags are zero before anyone signals

    def __call__(self, x: torch.Tensor) -> torch.Tensor:
        _, ptrs, half = self.bufs[x.dtype]
        out = torch.empty_like(x)
        n = x.numel()
        _one_shot_kernel[(triton.cdiv(n, BLOCK),)](x, out, ptrs, self.flag_ptrs, self.counters, n, half,
                                                   RANK=self.rank, WORLD=self.world, BLOCK=BLOCK, num_warps=4)
        return out


@triton.jit
def _one_shot_add_rmsnorm_kernel(x_ptr, res_ptr, w_ptr, out_ptr, res_out_ptr, buf_ptrs, flag_ptrs, counters,
                                 n_cols, half_numel, eps, RANK: tl.constexpr, WORLD: tl.constexpr,
                                 BLOCK: tl.constexpr):
    """One row per program: the row's sum over the ranks (rounded to the activation dtype, as an all-reduce
    returns it), + residual (rounded: the new residual), RMSNorm as layers/triton_ops/norm.py rounds it."""
    row = tl.program_id(0)
    epoch = tl.load(counters + row) + 1
    tl.store(counters + row, epoch)
    base = (epoch % 2) * half_numel + row * n_cols
    cols = tl.arange(0, BLOCK)
    mask = cols < n_cols
    dt = x_ptr.dtype.element_ty
    x = tl.load(x_ptr + row * n_cols + cols, mask=mask, other=0.0)
    mine = tl.load(buf_ptrs + RANK).to(tl.pointer_type(dt))
    tl.store(mine + base + cols, x, mask=mask)
    _fence_sys(row)
    tl.debug_barrier()
    for r in tl.static_range(WORLD):
        if r != RANK:
            peer_flags = tl.load(flag_ptrs + r).to(tl.pointer_type(tl.int32))
            tl.atomic_xchg(peer_flags + row * WORLD + RANK, epoch, sem="release", scope="sys")
    my_flags = tl.load(flag_ptrs + RANK).to(tl.pointer_type(tl.int32))
    for r in tl.static_range(WORLD):
        if r != RANK:
            seen = tl.atomic_add(my_flags + row * WORLD + r, 0, sem="acquire", scope="sys")
            while seen - epoch < 0:
                seen = tl.atomic_add(my_flags + row * WORLD + r, 0, sem="acquire", scope="sys")
    tl.debug_barrier()
    acc = tl.zeros([BLOCK], dtype=tl.float32)
    for r in tl.static_range(WORLD):
        if r == RANK:
            acc += x.to(tl.float32)
        else:
            peer = tl.load(buf_ptrs + r).to(tl.pointer_type(dt))
            acc += tl.load(peer + base + cols, mask=mask, other=0.0, cache_modifier=".cv").to(tl.float32)
    res = tl.load(res_ptr + row * n_cols + cols, mask=mask, other=0.0)
    s = (acc.to(dt).to(tl.float32) + res.to(tl.float32)).to(dt)
    tl.store(res_out_ptr + row * n_cols + cols, s, mask=mask)
    sf = s.to(tl.float32)
    var = tl.sum(sf * sf, axis=0) / n_cols
    normed = (sf * tl.rsqrt(var + eps)).to(dt)
    w = tl.load(w_ptr + cols, mask=mask, other=0.0)
    tl.store(out_ptr + row * n_cols + cols, (normed.to(tl.float32) * w.to(tl.float32)).to(dt), mask=mask)


class TritonAllReduceAddNorm:
    """all-reduce(x) + residual, then RMSNorm, in one kernel (rows of x: one program each). Buffers, flags and
    counters of its own: a buffer region must always be written by the same program slot (see the module doc)."""

    def __init__(self, group: dist.ProcessGroup, device: torch.device | str, dtypes: tuple[torch.dtype, ...],
                 max_bytes: int) -> None:
        self.inner = TritonOneShot(group, device, dtypes, max_bytes)

    def can_fuse(self, x: torch.Tensor, residual: torch.Tensor) -> bool:
        return (x.dtype in self.inner.bufs and x.dim() == 2 and x.is_contiguous() and residual.is_contiguous()
                and residual.shape == x.shape and x.shape[0] <= MAX_PROGRAMS
                and x.numel() * x.element_size() <= self.inner.max_bytes)

    def __call__(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor,
                 eps: float) -> tuple[torch.Tensor, torch.Tensor]:
        _, ptrs, half = self.inner.bufs[x.dtype]
        out, new_residual = torch.empty_like(x), torch.empty_like(x)
        if x.shape[0]:
            inner = self.inner
            _one_shot_add_rmsnorm_kernel[(x.shape[0],)](x, residual, weight, out, new_residual, ptrs,
                                                         inner.flag_ptrs, inner.counters, x.shape[1], half, eps,
                                                         RANK=inner.rank, WORLD=inner.world,
                                                         BLOCK=triton.next_power_of_2(x.shape[1]), num_warps=8)
        return out, new_residual
