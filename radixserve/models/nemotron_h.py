"""NVIDIA Nemotron-H's hybrid models (`NemotronHForCausalLM`, model_type `nemotron_h`: Nemotron-H 8B / 47B,
NVIDIA-Nemotron-Nano-9B-v2 / 12B-v2, Nemotron 3 Nano 30B-A3B and later Nemotron 3 releases).

Each layer is one block, h + mixer(RMSNorm(h)), whose mixer is one of (the config's `hybrid_override_pattern`, or
`layers_block_type` as transformers 5 keeps it, `configs/hybrid.py` layer_kinds):
- "M": Mamba2 (`layers/mamba2.py`, NEMOTRON_H's config names: inner width `mamba_num_heads` x `mamba_head_dim`,
  the gated RMSNorm in `n_groups` groups after the SiLU gate): a recurrent state per request;
- "*": attention without any rotation (no position embedding at all), no biases;
- "-": a non-gated MLP, up_proj -> `mlp_hidden_act` (relu2: relu(x) ** 2) -> down_proj;
- "E" (Nemotron 3): a MoE (`NemotronHMoE`): DeepSeek-V3's router (float32 logits, sigmoid scores, the choice on
  scores + `e_score_correction_bias` within the `topk_group` best of `n_group` groups, weights the uncorrected
  scores, renormalised when `norm_topk_prob`, times `routed_scaling_factor`); `n_routed_experts` non-gated relu2
  experts (up [I, H] -> relu2 -> down [H, I], `moe_intermediate_size`), optionally between a latent projection
  down (`fc1_latent_proj`, hidden -> `moe_latent_size`) and back up (`fc2_latent_proj`); plus one shared non-gated
  MLP (`moe_shared_expert_intermediate_size`) on the block's input.
Only the "*" layers hold KV: they take attention layer ids 0, 1, .. (`ModelConfig.kv_layer_count`). The checkpoint's
names are `backbone.embeddings`, `backbone.layers.N.norm` / `.mixer.*` (a MoE's experts one by one,
`mixer.experts.J.{up,down}_proj.weight`, or stacked as transformers 5 holds them, `mixer.experts.{up,down}_proj`),
`backbone.norm_f`, `lm_head` (untied by default). Serving constraints are the hybrid models' (`configs/hybrid.py`).
Tensor parallelism splits the Mamba2 layers' heads and groups (`layers/mamba2.py`), the attention heads, the MLPs'
and the experts' intermediate width (or, with --ep-size, the experts); the router and the latent projections are
replicated, and each MoE layer ends in one all-reduce.

FP8: NVIDIA's FP8 release (NVIDIA-Nemotron-3-Nano-30B-A3B-FP8, ModelOpt, `quantization/modelopt.py`) stores the
routed experts' and the shared MLP's up / down projections and most Mamba2 layers' in_proj / out_proj as fp8 with a
per-tensor `weight_scale` and static `input_scale`, each expert's `mixer.experts.J.up_proj` on its own (no gate; the
fp8 experts hold its rows alone, `fp8_moe.py`); its ignore list (the attention projections, the Mamba2 layers next to
them, lm_head) names layers `backbone.` as the checkpoint does (`checkpoint_prefix`); the attention layers' KV-cache
scales are `mixer.k_proj.k_scale` / `mixer.v_proj.v_scale`. `--quantization fp8` quantises the experts online."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.configs.hybrid import layer_kinds
from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.linear import ReplicatedLinear
from radixserve.layers.mamba2 import NEMOTRON_H, Mamba2Mixer
from radixserve.layers.moe import FusedMoE, MoEGate, RouterConfig, load_expert_weight, select_experts
from radixserve.layers.moe.activation import RELU2
from radixserve.layers.quantization.kv_cache import set_kv_scale
from radixserve.models.llama import LlamaAttention, LlamaForCausalLM, input_embedding, load_plain
from radixserve.models.recurrent_state import RecurrentStates
from radixserve.models.ungated import QKV_STACKED, UngatedMLP

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

# a layer kind as the configs spell it -> its pattern letter
_LETTERS = {"mamba": "M", "linear_attention": "M", "attention": "*", "full_attention": "*", "mlp": "-", "moe": "E"}
_MAMBA_NAMES = {"conv1d.weight": "conv_weight", "conv1d.bias": "conv_bias", "norm.weight": "norm_weight"}
# transformers 5's in-memory names of a MoE's stacked experts (up [E, I, H_in], down [E, H_in, I]) -> FusedMoE's
_STACKED_EXPERTS = {"experts.up_proj": "experts.w13_weight", "experts.down_proj": "experts.w2_weight"}
# an attention layer's KV-cache scales as checkpoints name them (ModelOpt: on k_proj / v_proj) -> "k" / "v"
_KV_SCALES = {leaf: w for w in "kv" for leaf in (f"{w}_scale", f"attn.{w}_scale", f"{w}_proj.{w}_scale",
                                                 f"{w}_proj.output_scale")}


def layer_pattern(config: PretrainedConfig) -> str:
    """The config's layers as pattern letters (M, *, -, E); ValueError for a kind this model does not serve."""
    kinds = layer_kinds(config)
    if not kinds:
        raise ValueError("NemotronH: the config must list its layers (hybrid_override_pattern or layers_block_type)")
    letters = []
    for kind in kinds:
        letter = _LETTERS.get(kind)
        if letter is None:
            raise ValueError(f"NemotronH: layer kind {kind!r} is not supported (M, *, -, E)")
        letters.append(letter)
    return "".join(letters)


class NemotronHAttention(LlamaAttention):
    """Attention of q, k, v as projected: no rotation, no bias (transformers' NemotronHAttention has none)."""

    def __init__(self, config: PretrainedConfig, kv_layer_id: int, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, kv_layer_id, tp_rank, tp_size, None, qkv_bias=False, o_bias=False)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.q_size, self.kv_size, self.kv_size], dim=-1)
        return self._out(self.attn(q, k, v, forward_batch))


class NemotronHMoE(nn.Module):
    """An "E" layer's mixer: routed relu2 experts (through a latent projection where the config has one) plus the
    shared MLP, as transformers' NemotronHMoE. Under tensor (or expert) parallelism each rank computes its partial
    sums of both, and one all-reduce adds them."""

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        hidden = config.hidden_size
        num_experts = getattr(config, "n_routed_experts", None)
        if not num_experts:
            raise ValueError("NemotronH: a MoE layer needs n_routed_experts > 0 in the config")
        act = getattr(config, "mlp_hidden_act", None) or "relu2"
        if act != "relu2":
            raise ValueError(f"NemotronH: the MoE experts' mlp_hidden_act {act!r} is not supported (relu2 only)")
        groups = int(getattr(config, "n_group", None) or 1)
        router = RouterConfig(int(num_experts), config.num_experts_per_tok, "sigmoid",
                              bool(getattr(config, "norm_topk_prob", True)), groups if groups > 1 else None,
                              config.topk_group if groups > 1 else None, "top2_sum",
                              float(getattr(config, "routed_scaling_factor", 1.0)))
        bias = bool(getattr(config, "mlp_bias", False))
        latent = getattr(config, "moe_latent_size", None)
        self.tp_size = tp_size
        self.gate = MoEGate(hidden, router.num_experts, correction_bias=True)
        self.experts = FusedMoE(router, latent or hidden, config.moe_intermediate_size, tp_rank, tp_size,
                                reduce_results=False, activation=RELU2)
        self.shared_experts = UngatedMLP(hidden, config.moe_shared_expert_intermediate_size, bias, act, tp_rank,
                                         tp_size, reduce_results=False)
        if latent:  # replicated: the experts' partial sums go through fc2 before the one all-reduce
            self.fc1_latent_proj = ReplicatedLinear(hidden, latent, bias)
            self.fc2_latent_proj = ReplicatedLinear(latent, hidden, bias)
        else:
            self.fc1_latent_proj = self.fc2_latent_proj = None

    def route(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(topk weights, topk ids) of x: the gate and the top-k in one launch where `MoEGate.route` can."""
        routed = self.gate.route(x, self.experts.router)
        if routed is not None:
            return routed[0], routed[1]
        return select_experts(self.gate(x), self.experts.router, self.gate.e_score_correction_bias)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        weights, ids = self.route(x)
        latent = x if self.fc1_latent_proj is None else self.fc1_latent_proj(x)
        routed = self.experts.run_experts(latent, weights, ids)  # this rank's partial sums
        shared = self.shared_experts(x)
        if self.fc2_latent_proj is None:
            out = routed + shared
        elif self.tp_size > 1 and self.fc2_latent_proj.bias is not None:
            # fc2's bias must be added once: the routed sums are reduced before it, the shared MLP's on their own
            return self.fc2_latent_proj(tensor_model_parallel_all_reduce(routed)) + \
                tensor_model_parallel_all_reduce(shared)
        else:  # linear: fc2 of each rank's partial sums adds up to fc2 of the whole
            out = self.fc2_latent_proj(routed) + shared
        return tensor_model_parallel_all_reduce(out) if self.tp_size > 1 else out


class NemotronHBlock(nn.Module):
    """One layer: its norm, then its mixer (Mamba2, attention, MLP or MoE by `letter`), added to the residual
    stream."""

    def __init__(self, config: PretrainedConfig, letter: str, kv_layer_id: int | None, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        self.letter = letter
        self.norm = RMSNorm(config.hidden_size, float(config.layer_norm_epsilon))
        if letter == "M":
            self.mixer: nn.Module = Mamba2Mixer(config, NEMOTRON_H, tp_rank, tp_size)
        elif letter == "*":
            if kv_layer_id is None:
                raise ValueError("NemotronH: an attention layer needs a KV layer id")
            self.mixer = NemotronHAttention(config, kv_layer_id, tp_rank, tp_size)
        elif letter == "E":
            self.mixer = NemotronHMoE(config, tp_rank, tp_size)
        else:
            self.mixer = UngatedMLP(config.hidden_size, config.intermediate_size,
                                    bool(getattr(config, "mlp_bias", False)),
                                    getattr(config, "mlp_hidden_act", None) or "relu2", tp_rank, tp_size)

    def forward(self, positions: torch.Tensor, hidden: torch.Tensor, residual: torch.Tensor | None,
                forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        """(this layer's mixer output, the residual stream before it): the next layer's norm adds the two."""
        if residual is None:
            residual, hidden = hidden, self.norm(hidden)
        else:
            hidden, residual = self.norm(hidden, residual)
        if self.letter == "M":
            return self.mixer(hidden, forward_batch), residual
        if self.letter == "*":
            return self.mixer(positions, hidden, forward_batch), residual
        return self.mixer(hidden), residual


class NemotronHModel(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        pattern = layer_pattern(config)
        if len(pattern) != config.num_hidden_layers:
            raise ValueError(f"NemotronH: the layer pattern {pattern!r} has {len(pattern)} layers, "
                             f"num_hidden_layers {config.num_hidden_layers}")
        if getattr(config, "sliding_window", None):
            raise ValueError("NemotronH: sliding_window is not supported (its attention layers see every token)")
        self.embed_tokens = input_embedding(config, tp_rank, tp_size)
        kv_ids = {layer: i for i, layer in enumerate(i for i, letter in enumerate(pattern) if letter == "*")}
        self.layers = nn.ModuleList(NemotronHBlock(config, letter, kv_ids.get(i), tp_rank, tp_size)
                                    for i, letter in enumerate(pattern))
        self.norm = RMSNorm(config.hidden_size, float(config.layer_norm_epsilon))

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        hidden, residual = self.embed_tokens(input_ids), None
        for layer in self.layers:
            hidden, residual = layer(positions, hidden, residual, forward_batch)
        hidden, _ = self.norm(hidden, residual)
        return hidden

    def mixers(self) -> list[Mamba2Mixer]:
        return [layer.mixer for layer in self.layers if layer.letter == "M"]


class NemotronHForCausalLM(RecurrentStates, LlamaForCausalLM):
    stacked_params = QKV_STACKED  # (the MLP's up_proj is its own weight, not half of a gate_up)

    def build_model(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> nn.Module:
        return NemotronHModel(config, tp_rank, tp_size)

    def state_layers(self) -> list:  # (RecurrentStates: what ModelRunner sizes and allocates)
        return self.model.mixers()

    def checkpoint_prefix(self, prefix: str) -> str:
        """The checkpoint's name of our layer `prefix` (`backbone.layers.N...` for `model.layers.N...`): what a
        quantized checkpoint's ignore list names (`quantization.apply_quantization`)."""
        if prefix.startswith("model."):
            prefix = "backbone." + prefix[len("model."):]
        return prefix.replace("backbone.embed_tokens", "backbone.embeddings")

    # ------------------------------------------------------------------ weights
    def load_weight(self, params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
        if name.startswith("mtp."):  # multi-token prediction layers (Nemotron 3): not served
            return None
        if name.startswith("backbone."):
            name = "model." + name[len("backbone."):]
        name = name.replace("model.embeddings.", "model.embed_tokens.").replace("model.norm_f.", "model.norm.")
        parts = name.split(".")
        if len(parts) > 4 and parts[:2] == ["model", "layers"] and parts[3] == "mixer" and parts[2].isdigit():
            layer = self.model.layers[int(parts[2])]
            leaf = ".".join(parts[4:])
            if layer.letter == "M":
                target = ".".join(parts[:4] + [_MAMBA_NAMES.get(leaf, leaf)])
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
                if leaf == "conv1d.weight":  # [C, 1, K] -> [C, K]
                    tensor = tensor.reshape(tensor.shape[0], -1)
                load_plain(params[target], name, tensor)
                return target
            if layer.letter == "E":
                return self._load_moe(params, name, ".".join(parts[:4]), leaf, tensor)
            if layer.letter == "*" and leaf in _KV_SCALES:  # (used with --kv-cache-dtype fp8_e4m3)
                set_kv_scale(layer.mixer.attn, _KV_SCALES[leaf], tensor)
                return None
        return super().load_weight(params, name, tensor)

    def _load_moe(self, params: dict[str, nn.Parameter], name: str, prefix: str, leaf: str, tensor: torch.Tensor
                  ) -> str | None:
        """A MoE layer's tensor: an expert's (one by one, or all of them stacked) into FusedMoE's stacked
        parameters; the router's, the shared MLP's and the latent projections' as they are named."""
        target = load_expert_weight(params, name, tensor)
        if target is not None:
            return target
        ours = _STACKED_EXPERTS.get(leaf)
        if ours is not None:
            target = f"{prefix}.{ours}"
            try:
                params[target].weight_loader(params[target], tensor, None)
            except ValueError as e:
                raise ValueError(f"{name}: {e}") from e
            return target
        return super().load_weight(params, name, tensor)
