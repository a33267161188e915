"""Process groups for tensor parallelism (torch.distributed: NCCL on CUDA, gloo on the CPU)."""

from __future__ import annotations

import torch
import torch.distributed as dist

_TP_GROUP: dist.ProcessGroup | None = None
_TP_RANK = 0
_TP_SIZE = 1


def initialize_model_parallel(tp_rank: int, tp_size: int, init_method: str, backend: str,
                              world_rank: int | None = None, world_size: int | None = None) -> None:
    """Join the world and make the TP group (the whole world: DP replicas run in their own worlds)."""
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    _TP_RANK, _TP_SIZE = tp_rank, tp_size
    if tp_size == 1:
        return
    if not dist.is_initialized():
        dist.init_process_group(backend=backend, init_method=init_method,
                                rank=tp_rank if world_rank is None else world_rank,
                                world_size=tp_size if world_size is None else world_size)
    _TP_GROUP = dist.group.WORLD


def get_tp_rank() -> int:
    return _TP_RANK


def get_tp_size() -> int:
    return _TP_SIZE


def get_tp_group() -> dist.ProcessGroup | None:
    return _TP_GROUP


def tensor_model_parallel_all_reduce(x: torch.Tensor) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    dist.all_reduce(x, group=_TP_GROUP)
    return x


def tensor_model_parallel_all_gather(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    if _TP_SIZE == 1:
        return x
    parts = [torch.empty_like(x) for _ in range(_TP_SIZE)]
    dist.all_gather(parts, x.contiguous(), group=_TP_GROUP)
    return torch.cat(parts, dim=dim)


def destroy_model_parallel() -> None:
    global _TP_GROUP, _TP_RANK, _TP_SIZE
    if dist.is_initialized():
        dist.destroy_process_group()
    _TP_GROUP, _TP_RANK, _TP_SIZE = None, 0, 1
