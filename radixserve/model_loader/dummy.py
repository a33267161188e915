"""Random weights for any model shape, generated on the parameters' device (no CPU round trip).

The weights do not depend on the tensor parallel size: every *full* (unsharded) tensor gets its own generator,
seeded by the seed and the tensor's name, and a sharded parameter takes its rank's part of that full tensor
through its `weight_loader`, as it would from a checkpoint. So a TP=2 model built with --load-format dummy is the
same model as the TP=1 one, and their outputs can be compared. Each rank generates one full tensor at a time and
drops it at once (the largest, a 70B shape's embedding, is 2 GiB in bf16)."""

from __future__ import annotations

import hashlib
from collections.abc import Iterator

import torch
from torch import nn

from radixserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.moe.layer import FusedMoE
from radixserve.layers.vocab_parallel_embedding import VocabParallelEmbedding

_MATRIX_STD = 0.02
_NORM_NOISE_STD = 0.02


def _is_norm(name: str) -> bool:
    leaf = name.rsplit(".", 2)
    owner = leaf[-2] if len(leaf) >= 2 else name
    return "norm" in owner


def tensor_seed(seed: int, name: str, shard_id: str | int | None = None) -> int:
    """The generator seed of one full tensor: a stable hash of (seed, parameter name, shard id)."""
    key = f"{seed}/{name}/{'' if shard_id is None else shard_id}".encode()
    return int.from_bytes(hashlib.blake2b(key, digest_size=8).digest(), "little") & ((1 << 63) - 1)


def full_shards(module: nn.Module, leaf: str, param: torch.Tensor) -> list[tuple[str | int | None, tuple[int, ...]]]:
    """(shard id, full unsharded shape) of each checkpoint tensor that `module.<leaf>` is loaded from through its
    weight_loader; [(None, param.shape)] for a parameter that every rank holds whole."""
    rest = tuple(param.shape[1:])
    if isinstance(module, FusedMoE):  # all experts, the whole intermediate dim, in the layer's stacked layout
        return [(None, module.full_shape(leaf))]
    own = getattr(module, "checkpoint_shape", None)  # a module sharded its own way (models/olmo2.py's q/k norms)
    if callable(own):
        return [(None, own(leaf))]
    if isinstance(module, QKVParallelLinear):
        tp, hd = module.tp_size, module.head_dim
        kv_heads = module.num_kv_heads * tp if module.kv_replicas == 1 else tp // module.kv_replicas
        return [("q", (module.num_heads * tp * hd, *rest)), ("k", (kv_heads * hd, *rest)),
                ("v", (kv_heads * hd, *rest))]
    if isinstance(module, MergedColumnParallelLinear):
        return [(i, (n * module.tp_size, *rest)) for i, n in enumerate(module.shard_sizes)]
    if isinstance(module, ColumnParallelLinear):
        return [(None, (param.shape[0] * module.tp_size, *rest))]
    if isinstance(module, RowParallelLinear):
        if param.dim() == 1:  # the bias: whole on rank 0, zeros elsewhere (the loader decides)
            return [(None, tuple(param.shape))]
        return [(None, (param.shape[0], param.shape[1] * module.tp_size))]
    if isinstance(module, VocabParallelEmbedding):
        return [(None, (module.num_embeddings, param.shape[1]))]
    return [(None, tuple(param.shape))]


def _rank0_bias(module: nn.Module, leaf: str) -> bool:
    """Whether `module.<leaf>` may be a bias that every rank holds at its full shape but only tensor-parallel rank 0
    fills (the others hold zeros, their partial sums join it): its loader must decide, even where the shapes match.
    Row-parallel layers' (all their parameters go through the loader) and the experts' down bias."""
    return isinstance(module, RowParallelLinear) or isinstance(module, FusedMoE) and leaf == "w2_bias"


def _parameters(model: nn.Module) -> Iterator[tuple[str, nn.Module, str, nn.Parameter]]:
    """(full name, owning module, leaf name, parameter), each parameter once (tied ones under their first name)."""
    seen: set[int] = set()
    for mod_name, module in model.named_modules():
        for leaf, param in module.named_parameters(recurse=False):
            if id(param) in seen:
                continue
            seen.add(id(param))
            yield (f"{mod_name}.{leaf}" if mod_name else leaf), module, leaf, param


@torch.no_grad()
def initialize_dummy_weights(model: nn.Module, seed: int = 42) -> None:
    """Fill every parameter of `model` in place with random values that depend only on `seed`, the parameter's
    name and the full model shape (not on the TP rank or size, nor on the order of parameters).

    Norm weights get 1 plus small noise (a model whose norms are all zero would output constants), biases and
    matrices a normal distribution with std 0.02; a parameter with a `dummy_dtype` (one a model holds in float32
    while its checkpoints store it in the model's dtype: MoEGate's weight) is rounded to that dtype. The same seed
    gives the same weights on the same device type.
    """
    for name, module, leaf, param in _parameters(model):
        device = param.device
        if device.type == "meta":
            raise ValueError(f"parameter {name} is on the meta device; build the model on a real device first")
        data = param.data
        if not data.is_floating_point():
            data.zero_()
            continue
        mean, std = (1.0, _NORM_NOISE_STD) if _is_norm(name) and name.endswith(".weight") else (0.0, _MATRIX_STD)
        shards = full_shards(module, leaf, param)
        loader = getattr(param, "weight_loader", None)
        rounded = getattr(param, "dummy_dtype", data.dtype)  # a checkpoint's dtype (MoEGate's weight)
        for shard_id, shape in shards:
            gen = torch.Generator(device=device)
            gen.manual_seed(tensor_seed(seed, name, shard_id))
            if loader is None or (len(shards) == 1 and shape == tuple(data.shape) and shard_id is None
                                  and not _rank0_bias(module, leaf)):
                data.normal_(mean, std, generator=gen)  # held whole: generate in place
                if rounded != data.dtype:
                    data.copy_(data.to(rounded))
                continue
            full = torch.empty(shape, dtype=data.dtype, device=device)
            full.normal_(mean, std, generator=gen)
            if rounded != data.dtype:
                full.copy_(full.to(rounded))
            loader(param, full, shard_id)
            del full
