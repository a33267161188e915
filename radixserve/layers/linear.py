"""Linear layers shaped for tensor parallelism. Each parameter carries a `weight_loader` that narrows the full
(HF-named) tensor to this rank's shard, so TP is a sharding decision made at load time."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce


def _divide(a: int, b: int, what: str) -> int:
    if a % b != 0:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor parallel size ({b})")
    return a // b


class _LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.weight.weight_loader = self.weight_loader
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            self.bias.weight_loader = self.weight_loader
        else:
            self.register_parameter("bias", None)
        # LoRA: a callable (x, base output) -> output set by radixserve.lora on the layers that carry adapters
        self.lora = None

    @staticmethod
    def _copy(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape mismatch{(' for ' + name) if name else ''}: expected {tuple(param.shape)},"
                             f" got {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        self._copy(param, loaded)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora is not None:
            out = self.lora(x, out)
        return out


class ReplicatedLinear(_LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(in_features, out_features, bias, tp_rank, tp_size)


class ColumnParallelLinear(_LinearBase):
    """Output dimension split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(in_features, _divide(out_features, tp_size, "output size"), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        n = param.shape[0]
        self._copy(param, loaded.narrow(0, self.tp_rank * n, n))


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate_proj and up_proj); shard_id is the index in `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        self.shard_sizes = [_divide(s, tp_size, "output size") for s in sizes]
        super().__init__(in_features, sum(sizes), bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if not isinstance(shard_id, int):
            raise ValueError(f"MergedColumnParallelLinear needs an integer shard id, got {shard_id!r}")
        n = self.shard_sizes[shard_id]
        offset = sum(self.shard_sizes[:shard_id])
        self._copy(param.data.narrow(0, offset, n), loaded.narrow(0, self.tp_rank * n, n))


class QKVParallelLinear(ColumnParallelLinear):
    """q, k, v projections in one matrix. KV heads are split across ranks, or replicated when fewer than ranks."""

    def __init__(self, hidden_size: int, head_dim: int, num_heads: int, num_kv_heads: int, bias: bool = False,
                 tp_rank: int = 0, tp_size: int = 1) -> None:
        self.head_dim = head_dim
        self.num_heads = _divide(num_heads, tp_size, "number of attention heads")
        if num_kv_heads >= tp_size:
            self.num_kv_heads = _divide(num_kv_heads, tp_size, "number of KV heads")
            self.kv_replicas = 1
        else:
            self.num_kv_heads = 1
            self.kv_replicas = _divide(tp_size, num_kv_heads, "TP size over KV heads")
        out = (self.num_heads + 2 * self.num_kv_heads) * head_dim * tp_size
        super().__init__(hidden_size, out, bias, tp_rank, tp_size)

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if shard_id == "q":
            dst, src = param.data.narrow(0, 0, q), loaded.narrow(0, self.tp_rank * q, q)
        elif shard_id in ("k", "v"):
            off = q if shard_id == "k" else q + kv
            kv_rank = self.tp_rank // self.kv_replicas
            dst, src = param.data.narrow(0, off, kv), loaded.narrow(0, kv_rank * kv, kv)
        else:
            raise ValueError(f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        self._copy(dst, src)


class RowParallelLinear(_LinearBase):
    """Input dimension split across ranks; the partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, reduce_results: bool = True) -> None:
        super().__init__(_divide(in_features, tp_size, "input size"), out_features, bias, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param.dim() == 1:  # bias: added once, on rank 0
            self._copy(param, loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        n = param.shape[1]
        self._copy(param, loaded.narrow(1, self.tp_rank * n, n))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        out = F.linear(x, self.weight, self.bias)
        if self.lora is not None:  # a partial sum on each rank, like the base output: reduced with it
            out = self.lora(x, out)
        if self.tp_size > 1 and self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out
