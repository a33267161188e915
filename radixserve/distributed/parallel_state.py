"""Process groups for tensor parallelism (torch.distributed: NCCL on CUDA, gloo on the CPU).

Each data-parallel replica is its own torch.distributed world whose ranks are that replica's TP ranks, so the TP
group is the whole world. Next to it every rank joins a gloo group on the CPU (even on CUDA): the scheduler
broadcasts the requests rank 0 received as pickled Python objects over it, off the device stream.

Every group carries a timeout: a rank that died makes the next collective of the others raise at once (the
socket closes), and a rank that is alive but stuck makes it raise after the timeout — never a silent hang.
"""

from __future__ import annotations

import datetime
from typing import Any

import torch
import torch.distributed as dist

DEFAULT_TIMEOUT_S = 600.0

_TP_GROUP: dist.ProcessGroup | None = None
_TP_CPU_GROUP: dist.ProcessGroup | None = None
_TP_RANK = 0
_TP_SIZE = 1
_EP_SIZE = 1
_DP_ATTENTION = False
_CUSTOM_AR = None  # CustomAllReduce on CUDA TP groups of one machine, unless --disable-custom-all-reduce


def set_expert_parallel_size(ep_size: int) -> None:
    """How many of the TP ranks the MoE layers split their experts over (1: experts are sharded by TP instead).
    Set by ModelRunner before the model is built; read by `FusedMoE`."""
    global _EP_SIZE
    if ep_size < 1:
        raise ValueError(f"ep_size must be positive, got {ep_size}")
    _EP_SIZE = ep_size


def get_expert_parallel_size() -> int:
    return _EP_SIZE


def set_dp_attention(enabled: bool) -> None:
    """--enable-dp-attention: each TP rank runs attention on its own requests (replicated attention weights and
    its own KV cache) and the MoE/MLP layers, sharded over the ranks, work on every rank's tokens together. Set by
    ModelRunner before the model is built; read by the models that support it."""
    global _DP_ATTENTION
    _DP_ATTENTION = enabled


def is_dp_attention_enabled() -> bool:
    return _DP_ATTENTION


def initialize_model_parallel(tp_rank: int, tp_size: int, init_method: str, backend: str,
                              world_rank: int | None = None, world_size: int | None = None,
                              timeout_s: float | None = None) -> None:
    """Join the world and make the TP group (the whole world: DP replicas run in their own worlds) and its CPU
    twin for object broadcasts. `init_method` is "tcp://host:port" of rank 0 (its TCP store)."""
    global _TP_GROUP, _TP_CPU_GROUP, _TP_RANK, _TP_SIZE
    if tp_size < 1 or not 0 <= tp_rank < tp_size:
        raise ValueError(f"tp_rank {tp_rank} is out of range for tp_size {tp_size}")
    if backend not in ("gloo", "nccl"):
        raise ValueError(f"backend must be 'gloo' or 'nccl', got {backend!r}")
    _TP_RANK, _TP_SIZE = tp_rank, tp_size
    if tp_size == 1:
        return
    timeout = datetime.timedelta(seconds=timeout_s or DEFAULT_TIMEOUT_S)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method,
                                rank=tp_rank if world_rank is None else world_rank,
                                world_size=tp_size if world_size is None else world_size, timeout=timeout)
    _TP_GROUP = dist.group.WORLD
    _TP_CPU_GROUP = dist.new_group(backend="gloo", timeout=timeout)


def init_custom_all_reduce(device: torch.device | str) -> bool:
    """Set up the symmetric-memory all-reduce for this TP group (a collective: every rank calls it). Returns
    whether it is on; when it is not, every all-reduce goes to NCCL."""
    global _CUSTOM_AR
    if _TP_SIZE == 1 or _TP_GROUP is None:
        return False
    from radixserve.distributed.custom_all_reduce import CustomAllReduce

    _CUSTOM_AR = CustomAllReduce(_TP_GROUP, _TP_CPU_GROUP, device)
    if not _CUSTOM_AR.enabled:
        _CUSTOM_AR = None
    return _CUSTOM_AR is not None


def get_custom_all_reduce() -> Any:
    return _CUSTOM_AR


def custom_all_reduce_fuses_norm() -> bool:
    """Whether the all-reduce can be fused with the residual add + RMSNorm after it (layers then leave their
    row-parallel outputs unreduced and hand them to the norm: `RMSNorm(x, residual, reduce=True)`)."""
    return _CUSTOM_AR is not None and getattr(_CUSTOM_AR, "add_norm", None) is not None


def all_reduce_add_rmsnorm(x: torch.Tensor, residual: torch.Tensor, weight: torch.Tensor, eps: float,
                           prefetch: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """The fused all-reduce + residual add + RMSNorm, or None when it cannot run on this message. `prefetch`: the
    weight the next layer reads (the push kernel can start pulling it into the L2)."""
    if _TP_SIZE == 1 or _CUSTOM_AR is None:
        return None
    return _CUSTOM_AR.fused_add_rmsnorm(x, residual, weight, eps, prefetch)


def model_parallel_is_initialized() -> bool:
    return _TP_GROUP is not None


def get_tp_cpu_group() -> dist.ProcessGroup | None:
    return _TP_CPU_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    """The sum of `x` over the TP ranks. Use the returned tensor: it is `x` (reduced in place, NCCL/gloo) or a new
    one (the custom all-reduce of decode-sized messages)."""
    if _TP_SIZE == 1:
        return x
    if _CUSTOM_AR is not None and _CUSTOM_AR.should_use(x):
        return _CUSTOM_AR.all_reduce(x)
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """The TP ranks' `x` concatenated along `dim` in rank order (decode-sized ones, e.g. the logits of a few rows,
    through the custom all-reduce: `CustomAllReduce.all_gather`)."""
    if _TP_SIZE == 1:
        return x
    if _CUSTOM_AR is not None:
        out = _CUSTOM_AR.all_gather(x, dim)
        if out is not None:
            return out
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def dp_attention_gather(x: torch.Tensor, rows: int) -> torch.Tensor:
    """DP attention: every rank's `x` ([n_r, hidden], n_r <= rows) as one [tp_size * rows, hidden] tensor, rank r's
    rows at r * rows (the rest zero)."""
    padded = x.new_zeros(rows, x.shape[1]) if x.shape[0] < rows else x
    if x.shape[0] < rows:
        padded[: x.shape[0]] = x
    if _TP_SIZE == 1:
        return padded
    if padded.is_cuda:
        out = x.new_empty(_TP_SIZE * rows, x.shape[1])
        dist.all_gather_into_tensor(out, padded.contiguous(), group=_TP_GROUP)
        return out
    parts = [torch.empty_like(padded) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, padded.contiguous(), group=_TP_GROUP)
    return torch.cat(parts)


def dp_attention_scatter(x: torch.Tensor, n: int) -> torch.Tensor:
    """DP attention: the inverse of `dp_attention_gather` for partial sums: sum `x` ([tp_size * rows, hidden], the
    MoE/MLP output of this rank's weight shard) over the ranks and keep this rank's first `n` rows."""
    if _TP_SIZE == 1:
        return x[:n]
    rows = x.shape[0] // _TP_SIZE
    if x.is_cuda:
        out = x.new_empty(rows, x.shape[1])
        dist.reduce_scatter_tensor(out, x.contiguous(), group=_TP_GROUP)
        return out[:n]
    dist.all_reduce(x, group=_TP_GROUP)  # gloo has no reduce-scatter
    return x[_TP_RANK * rows: _TP_RANK * rows + n]


def all_gather_pyobj(obj: Any) -> list[Any]:
    """Every TP rank's `obj` (picklable), in rank order, over the CPU group."""
    if _TP_SIZE == 1:
        return [obj]
    out: list[Any] = [None] * _TP_SIZE
    dist.all_gather_object(out, obj, group=_TP_CPU_GROUP)
    return out


def all_gather_ints(values: list[int]) -> list[list[int]]:
    """Every TP rank's `values` (the same number of ints on every rank), in rank order, over the CPU group: one
    small tensor collective, no pickling (the per-step sync of DP attention)."""
    if _TP_SIZE == 1:
        return [list(values)]
    mine = torch.tensor(values, dtype=torch.int64)
    parts = [torch.empty_like(mine) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, mine, group=_TP_CPU_GROUP)
    return [p.tolist() for p in parts]


def broadcast_tensor_from_first_rank(x: torch.Tensor) -> torch.Tensor:
    """Overwrite `x` on every TP rank with TP rank 0's `x` (in place; same shape and dtype on all ranks)."""
    if _TP_SIZE == 1:
        return x
    dist.broadcast(x, src=dist.get_global_rank(_TP_GROUP, 0), group=_TP_GROUP)
    return x


def broadcast_pyobj(obj: Any) -> Any:
    """TP rank 0's `obj` (any picklable value) on every TP rank, over the CPU group; other ranks pass None."""
    if _TP_SIZE == 1:
        return obj
    box = [obj if _TP_RANK == 0 else None]
    dist.broadcast_object_list(box, src=dist.get_global_rank(_TP_CPU_GROUP, 0), group=_TP_CPU_GROUP)
    return box[0]
