"""Server settings a hybrid model (recurrent-state layers beside full-attention ones: Qwen3-Next, Qwen3.5 with Gated
DeltaNet, Granite 4.0 and Nemotron-H with Mamba2) needs.

Its recurrent layers (`layers/linear_attention.py`, `layers/mamba2.py`) keep one state per request: a cached prefix is
only usable with the state at its end, which `HybridRadixCache` keeps in snapshot rows beside the request rows
(`--state-snapshots 0`: no radix cache, every prompt computed whole). Extend runs those layers outside the prefill
and piecewise CUDA graphs, which are off; decode graphs and the overlap scheduler stay. What cannot work is
refused."""

from __future__ import annotations

import logging
from typing import Any

logger = logging.getLogger(__name__)


# layer kinds that keep a recurrent state per request instead of KV: Qwen3-Next / Qwen3.5's Gated DeltaNet,
# Granite 4.0's and Nemotron-H's Mamba2 ("mamba" in Granite's released configs, "linear_attention" as transformers
# 5 renames it)
RECURRENT_LAYER_KINDS = ("linear_attention", "mamba")
# layer kinds that hold neither KV nor a state: Nemotron-H's feed-forward-only layers (a dense MLP, a MoE)
FEED_FORWARD_LAYER_KINDS = ("mlp", "moe")
# Nemotron-H's `hybrid_override_pattern`, a letter a layer: Mamba2, attention, MLP, MoE
PATTERN_KINDS = {"M": "mamba", "*": "attention", "-": "mlp", "E": "moe"}


def layer_kinds(config: Any) -> list[str]:
    """Each layer's kind as a (text) config lists it: `layer_types`, else `layers_block_type` (Granite 4.0,
    Nemotron-H), else Nemotron-H's `hybrid_override_pattern` read through PATTERN_KINDS (an unknown letter kept as
    it is); [] where the config says none."""
    kinds = getattr(config, "layer_types", None) or getattr(config, "layers_block_type", None)
    if not kinds:
        pattern = getattr(config, "hybrid_override_pattern", None)
        kinds = [PATTERN_KINDS.get(c, c) for c in pattern] if isinstance(pattern, str) else []
    return list(kinds)


def linear_attention_layers(config: Any) -> list[int]:
    """The layers of a (text) config that keep a recurrent state (linear attention or Mamba2, by `layer_kinds`),
    [] for other models."""
    return [i for i, kind in enumerate(layer_kinds(config)) if kind in RECURRENT_LAYER_KINDS]


def kv_layer_count(config: Any, num_hidden_layers: int) -> int:
    """How many of the `num_hidden_layers` layers hold KV: all but the recurrent ones and the feed-forward-only
    ones (Nemotron-H's "-" and "E" layers)."""
    skipped = RECURRENT_LAYER_KINDS + FEED_FORWARD_LAYER_KINDS
    return num_hidden_layers - sum(kind in skipped for kind in layer_kinds(config))


def apply_hybrid_args(server_args: Any, model_config: Any) -> None:
    """Set what a hybrid model needs on `server_args` (in place; a no-op for other models), a log line for what
    changed; ValueError for a setting it cannot serve with (or, for other models, one that means nothing to them)."""
    if not getattr(model_config, "linear_attention_layers", None):
        if getattr(server_args, "state_snapshots", None) is not None:
            raise ValueError(f"--state-snapshots applies to hybrid models (linear-attention or Mamba2 layers); "
                             f"{model_config.architectures[0]} has none")
        return
    arch = model_config.architectures[0]
    refused = [(server_args.speculative_algorithm is not None, "--speculative-algorithm (a rejected draft token "
                "would have to be taken back out of the recurrent state)"),
               (server_args.enable_lora, "--enable-lora (no adapters for the linear-attention layers)"),
               (server_args.enable_torch_compile, "--enable-torch-compile"),
               (server_args.attention_backend == "double_sparsity", "--attention-backend double_sparsity"),
               (server_args.enable_dp_attention, "--enable-dp-attention")]
    for bad, what in refused:
        if bad:
            raise ValueError(f"{arch} has linear-attention layers: {what} is not supported")
    changes = []
    if server_args.state_snapshots == 0 and not server_args.disable_radix_cache:
        server_args.disable_radix_cache = True
        changes.append("radix cache off (--state-snapshots 0)")
    if server_args.prefill_cuda_graph_max_tokens:
        server_args.prefill_cuda_graph_max_tokens = 0
        changes.append("prefill CUDA graphs off")
    if server_args.piecewise_cuda_graph_max_tokens:
        server_args.piecewise_cuda_graph_max_tokens = 0
        changes.append("piecewise CUDA graphs off")
    if changes:
        logger.info("%s has %d linear-attention layers: %s", arch, len(model_config.linear_attention_layers),
                    "; ".join(changes))
