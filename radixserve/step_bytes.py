"""The bytes a decode step reads, for the benchmarks' bandwidth columns.

A dense model's step reads every weight (the issue's roofline counts the embedding table too) and the KV of each
token attended. An MoE step reads the weights every token passes through (attention, dense and shared MLPs,
router, norms, LM head; not the embedding table, of which it reads B rows), the routed experts the batch touches
(distinct experts a layer, counted from the router's choices in one eager decode step of the same batch) and the
KV."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.layers.moe import FusedMoE
from radixserve.model_executor.model_runner import ModelRunner


def expert_layers(runner: ModelRunner) -> list[FusedMoE]:
    return [m for m in runner.model.modules() if isinstance(m, FusedMoE)]


def bytes_of(tensors: Any) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def expert_tensors(layer: FusedMoE) -> list[torch.Tensor]:
    """The layer's per-expert tensors (weights, biases, scales): those whose leading dim is its local experts."""
    own = list(layer.parameters(recurse=False))
    return [t for t in own if t.dim() > 0 and t.shape[0] == layer.num_local_experts]


def distinct_experts(runner: ModelRunner, batch_size: int, input_len: int, seed: int) -> list[int]:
    """Distinct experts each MoE layer routes this batch's tokens to in one eager decode step."""
    from radixserve.bench_one_batch import StaticBatch

    layers = expert_layers(runner)
    counts: list[int] = []
    own = [layer.__dict__.get("run_experts") for layer in layers]
    for layer in layers:
        orig = layer.run_experts

        def recording(x: torch.Tensor, weights: torch.Tensor, ids: torch.Tensor, *, _orig: Any = orig
                      ) -> torch.Tensor:
            counts.append(int(ids.unique().numel()))
            return _orig(x, weights, ids)

        layer.run_experts = recording  # type: ignore[method-assign]
    g = torch.Generator().manual_seed(seed)
    prompts = torch.randint(0, runner.model_config.vocab_size, (batch_size, input_len), generator=g).tolist()
    sb = StaticBatch(runner)
    graphs, runner.cuda_graph_runner = runner.cuda_graph_runner, None
    try:
        batch, _ = sb.prefill(prompts, max_tokens=runner.server_args.max_prefill_tokens)
        counts.clear()
        sb.decode(batch)
        sb.release(batch)
    finally:
        runner.cuda_graph_runner = graphs
        for layer, before in zip(layers, own, strict=True):
            if before is None:
                del layer.run_experts  # the class's method shows again
            else:
                layer.run_experts = before  # type: ignore[method-assign]
    return counts


def moe_step_bytes(runner: ModelRunner, result: dict[str, Any], experts_hit: list[int]) -> dict[str, float]:
    """The bytes of one decode step of `result`'s batch: dense weights, the experts it touched, the KV."""
    layers = expert_layers(runner)
    expert_total = sum(bytes_of(expert_tensors(m)) for m in layers)
    per_expert = [bytes_of(expert_tensors(m)) / m.num_local_experts for m in layers]
    model = runner.model
    embed = model.model.embed_tokens.weight
    tied = model.lm_head is model.model.embed_tokens
    dense = runner.weight_bytes - expert_total - (0 if tied else embed.numel() * embed.element_size())
    routed = sum(n * b for n, b in zip(experts_hit, per_expert, strict=True))
    avg_len = result["input_len"] + result["output_len"] / 2
    kv = result["batch_size"] * avg_len * runner.token_to_kv_pool.bytes_per_token()
    return {"dense_bytes": dense, "routed_bytes": routed, "kv_bytes": kv, "step_bytes": dense + routed + kv,
            "experts_hit_per_layer": sum(experts_hit) / max(1, len(experts_hit))}
