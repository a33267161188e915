"""Vocabulary-parallel embedding and LM head: each rank holds a contiguous slice of the vocabulary."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce


class VocabParallelEmbedding(nn.Module):
    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.num_embeddings = num_embeddings
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.shard_size = -(-num_embeddings // tp_size)  # ceil: the last shard is zero-padded
        self.start = tp_rank * self.shard_size
        self.end = min(self.start + self.shard_size, num_embeddings)
        self.weight = nn.Parameter(torch.empty(self.shard_size, embedding_dim), requires_grad=False)
        self.weight.weight_loader = self.weight_loader

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if loaded.shape[0] != self.num_embeddings or loaded.shape[1] != param.shape[1]:
            raise ValueError(f"embedding shape mismatch: expected ({self.num_embeddings}, {param.shape[1]}), "
                             f"got {tuple(loaded.shape)}")
        param.data.zero_()
        param.data[: self.end - self.start].copy_(loaded[self.start:self.end])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:
        if self.tp_size == 1:
            return F.embedding(input_ids, self.weight)
        mask = (input_ids >= self.start) & (input_ids < self.end)
        local = torch.where(mask, input_ids - self.start, 0)
        out = F.embedding(local, self.weight) * mask.unsqueeze(-1).to(self.weight.dtype)
        return tensor_model_parallel_all_reduce(out)


class ParallelLMHead(VocabParallelEmbedding):
    """Holds the output projection; the LogitsProcessor multiplies by it (adding `bias`, this rank's slice of a
    biased head's: Phi-3.5-MoE's lm_head_bias) and gathers the vocabulary shards."""

    def __init__(self, num_embeddings: int, embedding_dim: int, tp_rank: int = 0, tp_size: int = 1,
                 bias: bool = False) -> None:
        super().__init__(num_embeddings, embedding_dim, tp_rank, tp_size)
        if bias:
            self.bias = nn.Parameter(torch.zeros(self.shard_size), requires_grad=False)
            self.bias.weight_loader = self._bias_loader
        else:
            self.register_parameter("bias", None)

    def _bias_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if tuple(loaded.shape) != (self.num_embeddings,):
            raise ValueError(f"lm_head.bias shape mismatch: expected ({self.num_embeddings},), got "
                             f"{tuple(loaded.shape)}")
        param.data.zero_()
        param.data[: self.end - self.start].copy_(loaded[self.start:self.end])

    def checkpoint_shape(self, leaf: str) -> tuple[int, ...]:
        """The full (unsharded) shape of `leaf` (dummy weights)."""
        return (self.num_embeddings,) if leaf == "bias" else (self.num_embeddings, self.weight.shape[1])

    def forward(self, input_ids: torch.Tensor) -> torch.Tensor:  # pragma: no cover - never used as an embedding
        raise RuntimeError("ParallelLMHead is applied by LogitsProcessor")
