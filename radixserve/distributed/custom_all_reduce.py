"""A fast all-reduce for decode-sized tensors between the TP ranks of one machine (NVLink / PCIe peer access).

NCCL's ring/tree all-reduce costs tens of microseconds even for a few KiB, and a TP decode step does two per
layer. PyTorch's symmetric memory gives every rank a buffer its peers can read and write directly, with signal
pads for barriers between the ranks' blocks; over it:

- one-shot: each rank copies its input into its own buffer, then every rank reads all buffers and sums (one
  kernel, one round trip: the smallest latency; each rank reads (world - 1) x the message);
- two-shot: reduce-scatter then all-gather over the buffers (each rank moves 2 x (world - 1) / world of the message:
  better once bandwidth, not latency, dominates).

Messages above `max_bytes`, non-contiguous ones and unsupported dtypes go to NCCL. The kernels are plain launches
on the current stream with fixed buffer addresses, so decode steps capture them in CUDA graphs. NVLink multicast
(multimem operations, NVLS) is never used: TORCH_SYMM_MEM_DISABLE_MULTICAST is set before the first allocation.

One-shot messages go to the push kernel of `push_all_reduce.py`: each rank stores its message straight into its
peers' buffers and polls its own, the data marking its own arrival (no flags, no fences, no remote reads): 2.7 us
for 8 KiB inside a CUDA graph on 2 x H200, against 5.1 for the one-barrier pull kernel of `triton_all_reduce.py`,
6.6 for PyTorch's one-shot and 15.7 for NCCL. Both Triton kernels also let the Llama-family layers fuse each
all-reduce with the residual add and RMSNorm after it (`fused_add_rmsnorm`; 4.2 us push, 6.7 pull).
RADIXSERVE_ONE_SHOT=triton takes the pull kernels, RADIXSERVE_ONE_SHOT=torch PyTorch's one-shot kernel and the
unfused layers.

A rank that cannot set this up (no peer access, an old torch, a wrong self-test sum) makes every rank fall back to
NCCL: the ranks agree over the CPU group, so collectives always stay matched.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist

logger = logging.getLogger(__name__)

# one-shot up to here (latency-bound), two-shot above it. Measured on 2 x H200 inside CUDA graphs: PyTorch's
# one-shot beats its two-shot up to 256 KiB (9.5 / 10.0 us); the Triton one-shot beats the two-shot up to 1 MiB
# (10.3 / 13.2 us)
ONE_SHOT_MAX_BYTES = {"torch": 256 * 1024, "triton": 1024 * 1024, "push": 1024 * 1024}
FUSED_MAX_ROWS = 128  # the push kernel's fused add + RMSNorm: rows (tokens) per call
MAX_BYTES = 8 * 1024 * 1024  # NCCL above it (prefill-sized messages: bandwidth-bound, NCCL does well)
_ALIGN_BYTES = 16  # the kernels' vector width; other sizes go to NCCL


class CustomAllReduce:
    """One symmetric buffer per dtype; `all_reduce(x)` returns the sum over the group (a new tensor)."""

    def __init__(self, group: dist.ProcessGroup, cpu_group: dist.ProcessGroup, device: torch.device | str,
                 dtypes: tuple[torch.dtype, ...] = (torch.bfloat16, torch.float16, torch.float32),
                 max_bytes: int = MAX_BYTES, one_shot_max_bytes: int | None = None) -> None:
        self._group = group
        self.group_name = group.group_name
        self.world_size = dist.get_world_size(group)
        self.rank = dist.get_rank(group)
        self.impl = os.environ.get("RADIXSERVE_ONE_SHOT", "push")
        one_shot_max_bytes = one_shot_max_bytes or ONE_SHOT_MAX_BYTES.get(self.impl, 0)
        self.max_bytes, self.one_shot_max_bytes = max_bytes, min(one_shot_max_bytes, max_bytes)
        self.device = torch.device(device)
        self.buffers: dict[torch.dtype, torch.Tensor] = {}
        self.disabled_reason: str | None = None
        try:
            self._setup(dtypes)
            self._self_test()
        except Exception as e:  # noqa: BLE001 - any failure here means: use NCCL
            self.disabled_reason = f"{type(e).__name__}: {e}"
        # every rank must take the same path for every message, or the collectives mismatch
        ok = torch.tensor([0 if self.disabled_reason else 1], dtype=torch.int32)
        dist.all_reduce(ok, op=dist.ReduceOp.MIN, group=cpu_group)
        if int(ok.item()) == 0:
            self.disabled_reason = self.disabled_reason or "another rank could not set it up"
            self.buffers.clear()
            self.add_norm = None
            logger.warning("custom all-reduce disabled (NCCL for every message): %s", self.disabled_reason)
        else:
            logger.info("custom all-reduce on: one-shot <= %d KiB, two-shot <= %d KiB, NCCL above",
                        one_shot_max_bytes // 1024, max_bytes // 1024)

    @property
    def enabled(self) -> bool:
        return self.disabled_reason is None

    def _setup(self, dtypes: tuple[torch.dtype, ...]) -> None:
        os.environ.setdefault("TORCH_SYMM_MEM_DISABLE_MULTICAST", "1")
        if self.device.type != "cuda":
            raise RuntimeError("symmetric memory needs CUDA tensors")
        import torch.distributed._symmetric_memory as symm_mem

        ops = torch.ops.symm_mem
        for name in ("one_shot_all_reduce", "two_shot_all_reduce_"):
            if not hasattr(ops, name):
                raise RuntimeError(f"torch {torch.__version__} has no symm_mem.{name}")
        self._has_copy_op = hasattr(ops, "one_shot_all_reduce_copy")
        enable = getattr(symm_mem, "enable_symm_mem_for_group", None)
        if enable is not None:  # needed by older torch, a deprecated no-op in newer ones
            import warnings

            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                enable(self.group_name)
        self._triton = None
        self.add_norm = None
        if self.impl not in ("torch", "triton", "push"):
            raise ValueError(f"RADIXSERVE_ONE_SHOT must be 'torch', 'triton' or 'push', got {self.impl!r}")
        if self.impl == "push":
            from radixserve.distributed.push_all_reduce import PushAddRMSNorm, PushOneShot

            self._triton = PushOneShot.from_symm_mem(self._group, self.device, dtypes, self.one_shot_max_bytes)
            self.add_norm = PushAddRMSNorm.from_symm_mem(self._group, self.device, dtypes, FUSED_MAX_ROWS)
        if self.impl == "triton":
            from radixserve.distributed.triton_all_reduce import TritonAllReduceAddNorm, TritonOneShot

            self._triton = TritonOneShot.from_symm_mem(self._group, self.device, dtypes, self.one_shot_max_bytes)
            self.add_norm = TritonAllReduceAddNorm.from_symm_mem(self._group, self.device, dtypes,
                                                                 self.one_shot_max_bytes)
        for dtype in dtypes:
            buf = symm_mem.empty(self.max_bytes // torch.finfo(dtype).bits * 8, dtype=dtype, device=self.device)
            symm_mem.rendezvous(buf, self.group_name)
            self.buffers[dtype] = buf

    def _self_test(self) -> None:
        """Sum a known tensor of each path (one-shot, two-shot) and compare with the exact answer."""
        for numel, reduce in ((4096, self.one_shot), (65536, self.two_shot)):
            x = torch.full((numel,), float(self.rank + 1), dtype=torch.bfloat16, device=self.device)
            x[: self.world_size] += torch.arange(self.world_size, device=self.device, dtype=x.dtype)
            want = float(self.world_size * (self.world_size + 1) // 2)
            got = reduce(x)
            expect = torch.full_like(x, want)
            expect[: self.world_size] += self.world_size * torch.arange(self.world_size, device=self.device,
                                                                        dtype=x.dtype)
            if not torch.equal(got, expect):
                raise RuntimeError(f"self-test: the {reduce.__name__} sum of {numel} elements is wrong")
        if self.add_norm is not None:  # rows of rank + 1: the sum + 1 is the new residual, RMSNorm of a flat row 1
            x = torch.full((3, 1024), float(self.rank + 1), dtype=torch.bfloat16, device=self.device)
            ones = torch.ones_like(x)
            out, res = self.add_norm(x, ones, ones[0], 1e-6)
            if not (torch.equal(res, torch.full_like(x, want + 1)) and torch.equal(out, ones)):
                raise RuntimeError("self-test: the fused all-reduce + add + RMSNorm is wrong")
        torch.cuda.synchronize(self.device)

    def fused_add_rmsnorm(self, x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                          prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
        """(RMSNorm(all-reduce(x) + residual) * weight, all-reduce(x) + residual) in one kernel, or None when this
        message cannot take that path. `prefetch` (push kernel only): the next layer's weight, see
        push_all_reduce.py."""
        if self.add_norm is None or not self.should_use(x) or not self.add_norm.can_fuse(x, residual):
            return None
        if prefetch is not None and getattr(self.add_norm, "prefetch_bytes", 0):
            return self.add_norm(x, residual, weight, eps, prefetch)
        return self.add_norm(x, residual, weight, eps)

    def should_use(self, x: torch.Tensor) -> bool:
        nbytes = x.numel() * x.element_size()
        return (self.disabled_reason is None and x.dtype in self.buffers and x.is_cuda and x.is_contiguous()
                and 0 < nbytes <= self.max_bytes and nbytes % _ALIGN_BYTES == 0)

    def all_reduce(self, x: torch.Tensor) -> torch.Tensor:
        """The sum of `x` over the group, as a new tensor of x's shape (x is left as it was). Call only when
        `should_use(x)`."""
        if x.numel() * x.element_size() <= self.one_shot_max_bytes:
            return self.one_shot(x)
        return self.two_shot(x)

    def all_gather(self, x: torch.Tensor, dim: int = -1) -> torch.Tensor | None:
        """The ranks' `x` concatenated along `dim` in rank order, when the result fits the one-shot kernel (else
        None: use NCCL). Each rank puts its part into a zeroed tensor of the result's size and the one-shot sums
        them (x + 0 is exact): one small kernel instead of NCCL's all-gather and the concatenation after it."""
        if not x.is_cuda or x.dim() == 0:
            return None
        d = dim % x.dim()
        shape = list(x.shape)
        n = shape[d]
        shape[d] = n * self.world_size
        if x.numel() * self.world_size * x.element_size() > self.one_shot_max_bytes:
            return None
        full = x.new_zeros(shape)
        if not self.should_use(full):
            return None
        full.narrow(d, self.rank * n, n).copy_(x)
        return self.one_shot(full)

    def one_shot(self, x: torch.Tensor) -> torch.Tensor:
        if self._triton is not None:
            return self._triton(x)
        n = x.numel()
        buf = self.buffers[x.dtype][:n]
        if self._has_copy_op:  # the copy into the buffer is fused into the kernel
            out = torch.ops.symm_mem.one_shot_all_reduce_copy(buf, x.view(-1), "sum", self.group_name)
        else:
            buf.copy_(x.view(-1))
            out = torch.ops.symm_mem.one_shot_all_reduce(buf, "sum", self.group_name)
        return out.view(x.shape)

    def two_shot(self, x: torch.Tensor) -> torch.Tensor:
        n = x.numel()
        buf = self.buffers[x.dtype][:n]
        buf.copy_(x.view(-1))
        torch.ops.symm_mem.two_shot_all_reduce_(buf, "sum", self.group_name)
        return buf.clone().view(x.shape)
