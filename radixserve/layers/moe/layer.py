"""FusedMoE: the routed experts of one layer as stacked tensors, sharded for tensor or expert parallelism.

- Tensor parallelism (`ep_size` 1): every rank holds every expert and 1/tp of each expert's intermediate dimension
  (gate/up rows, down columns); the ranks' partial outputs are summed by an all-reduce.
- Expert parallelism (`ep_size` = tp size): rank r holds experts [r·E/ep, (r+1)·E/ep) whole. Every rank has every
  token (the attention before is tensor-parallel and ends in an all-reduce), so dispatch is local: each rank runs
  its tokens through the experts it holds and leaves the others out; the combine is the same all-reduce.
The caller may skip the all-reduce (`reduce_results=False`) to fold it with the shared experts' one.

Checkpoint tensors arrive one expert at a time (`weight_loader(param, w, shard_id in {"w1", "w2", "w3"},
expert_id)`, w1 = gate, w3 = up, w2 = down, as in Mixtral's names) or, from the dummy loader, as one full stacked
tensor in this layer's layout (`shard_id=None`). Nothing builds an nn.Module per expert. Non-gated experts (the
relu2 activation, Nemotron 3) hold up rows alone in w13 ([E, I, H]) and take no w1.
"""

from __future__ import annotations

import contextlib
import re
from collections.abc import Iterator
from typing import NamedTuple

import torch
from torch import nn

from radixserve.distributed.parallel_state import get_expert_parallel_size, tensor_model_parallel_all_reduce
from radixserve.layers.moe.activation import SILU, ExpertActivation, ExpertBias
from radixserve.layers.moe.methods import MoEMethod, UnquantizedMoEMethod
from radixserve.layers.moe.router import MoEGate, RouterConfig, select_experts
from radixserve.model_executor.torch_compile import compiled_experts, register_op_layer


class SharedWeights(NamedTuple):
    """A shared MLP computed in the experts' small-batch launch (`FusedMoE.folded_shared_weights`)."""

    w13: torch.Tensor  # gate_up [2S, H]
    w2: torch.Tensor  # down [H, S]
    s13: torch.Tensor | None = None  # fp8: their scales in the experts' form (`small_batch.small_batch_moe`)
    s2: torch.Tensor | None = None


class FusedMoE(nn.Module):
    def __init__(self, router: RouterConfig, hidden_size: int, intermediate_size: int, tp_rank: int = 0,
                 tp_size: int = 1, ep_size: int | None = None, reduce_results: bool = True,
                 quant_method: MoEMethod | None = None, activation: ExpertActivation = SILU,
                 bias: bool = False) -> None:
        super().__init__()
        ep_size = get_expert_parallel_size() if ep_size is None else ep_size
        if ep_size not in (1, tp_size):
            raise ValueError(f"--ep-size must be 1 or the tensor parallel size {tp_size}; got {ep_size}")
        num_experts = router.num_experts
        self.router = router
        self.compile_key = register_op_layer(self)  # how a compiled graph's experts op finds this layer
        self.num_experts = num_experts
        self.hidden_size = hidden_size
        self.tp_rank, self.tp_size, self.ep_size = tp_rank, tp_size, ep_size
        if ep_size > 1:
            if num_experts % ep_size:
                raise ValueError(f"{num_experts} experts cannot be split evenly over --ep-size {ep_size}")
            self.num_local_experts = num_experts // ep_size
            self.expert_offset = tp_rank * self.num_local_experts
            self.moe_tp_rank, self.moe_tp_size = 0, 1
        else:
            self.num_local_experts, self.expert_offset = num_experts, 0
            self.moe_tp_rank, self.moe_tp_size = tp_rank, tp_size
        if intermediate_size % self.moe_tp_size:
            raise ValueError(f"moe_intermediate_size {intermediate_size} is not divisible by the tensor parallel "
                             f"size {self.moe_tp_size}")
        self.intermediate_size = intermediate_size
        self.inter_per_rank = intermediate_size // self.moe_tp_size
        self.reduce_results = reduce_results
        self.act_dtype = torch.get_default_dtype()  # the model dtype it is built under: its activations'
        self.activation = activation  # (first: it decides w13's rows)
        self.quant_method = quant_method or UnquantizedMoEMethod()
        self.quant_method.create_weights(self, self.num_local_experts, hidden_size, self.inter_per_rank)
        if bias:  # GPT-OSS: gate/up [E, 2I] (gate then up, sharded as the rows) and down [E, H] (rank 0's whole)
            self.w13_bias = nn.Parameter(torch.empty(self.num_local_experts,
                                                     activation.w13_rows(self.inter_per_rank)), requires_grad=False)
            self.w2_bias = nn.Parameter(torch.empty(self.num_local_experts, hidden_size), requires_grad=False)
            self.w13_bias.weight_loader = self.w2_bias.weight_loader = self.weight_loader
        else:
            self.w13_bias = self.w2_bias = None
        self._check_method(self.quant_method)
        from radixserve.layers.moe.small_batch import counters_needed

        # the small-batch path's per-block counters (each put back to 0 by the launch that uses it)
        self.register_buffer("small_counters", torch.zeros(counters_needed(hidden_size), dtype=torch.int32),
                             persistent=False)

    def set_quant_method(self, method: MoEMethod) -> None:
        """Hold the experts as `method` does (`quantization.apply_quantization`, before the weights load): the
        current method's parameters go, the new one's are created."""
        self._check_method(method)
        for name, _ in list(self.named_parameters(recurse=False)):
            delattr(self, name)
        self.quant_method = method
        method.create_weights(self, self.num_local_experts, self.hidden_size, self.inter_per_rank)

    def _check_method(self, method: MoEMethod) -> None:
        """ValueError unless `method` holds these experts (`MoEMethod.serves`: fp8 takes SiLU and Nemotron 3's
        relu2 experts; experts with biases, GPT-OSS's, stay in the model dtype)."""
        if not method.serves(self):
            what = "biases" if self.w13_bias is not None else f"the {self.activation.kind} activation"
            raise ValueError(f"{type(method).__name__}: experts with {what} are served in the model dtype only "
                             f"(this method does not hold them)")

    @property
    def plain_experts(self) -> bool:
        """SiLU experts without biases: what every quantized form serves and what a shared MLP rides along with
        (GPT-OSS's and Nemotron 3's are not; fp8 serves Nemotron 3's too, `MoEMethod.serves`)."""
        return self.w13_bias is None and self.activation == SILU

    def expert_bias(self) -> ExpertBias | None:
        return None if self.w13_bias is None else ExpertBias(self.w13_bias, self.w2_bias)

    # ---------------------------------------------------------------- loading
    def full_shape(self, param_name: str) -> tuple[int, ...]:
        """The unsharded stacked shape of `w13_weight` / `w2_weight` (all experts, the whole intermediate dim), or
        of the biases `w13_bias` [E, 2I] / `w2_bias` [E, H] (I rows in place of 2I for non-gated experts)."""
        e, h, i = self.num_experts, self.hidden_size, self.intermediate_size
        rows = self.activation.w13_rows(i)
        return {"w13_weight": (e, rows, h), "w2_weight": (e, h, i), "w13_bias": (e, rows),
                "w2_bias": (e, h)}[param_name]

    def _copy_rows(self, dst: torch.Tensor, full: torch.Tensor) -> None:
        """This rank's intermediate slice of full w13 rows ([E, 2I, ...] gate then up, or [E, I, ...] up alone)."""
        n, i = self.inter_per_rank, self.intermediate_size
        lo = self.moe_tp_rank * n
        if not self.activation.gated:
            dst.copy_(full[:, lo:lo + n])
            return
        dst[:, :n].copy_(full[:, lo:lo + n])
        dst[:, n:].copy_(full[:, i + lo:i + lo + n])

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                      expert_id: int | None = None) -> None:
        n = self.inter_per_rank
        lo = self.moe_tp_rank * n
        if param is not None and (param is self.w13_bias or param is self.w2_bias):
            self._load_bias(param, loaded, shard_id)
            return
        is_w13 = param is self.w13_weight
        if shard_id is None:  # a full stacked tensor in this layer's layout
            full = self.full_shape("w13_weight" if is_w13 else "w2_weight")
            if tuple(loaded.shape) != full:
                raise ValueError(f"stacked expert weight shape {tuple(loaded.shape)}, expected {full}")
            mine = loaded.narrow(0, self.expert_offset, self.num_local_experts)
            if is_w13:
                self._copy_rows(param.data, mine)
            else:
                param.data.copy_(mine[:, :, lo:lo + n])
            return
        if expert_id is None or not 0 <= expert_id < self.num_experts:
            raise ValueError(f"expert id {expert_id} out of range 0..{self.num_experts - 1}")
        local = expert_id - self.expert_offset
        if not 0 <= local < self.num_local_experts:
            return  # another rank's expert
        if shard_id in ("w1", "w3"):
            if is_w13 is False or loaded.shape != (self.intermediate_size, self.hidden_size):
                raise ValueError(f"expert {expert_id} {shard_id} shape {tuple(loaded.shape)}, expected "
                                 f"{(self.intermediate_size, self.hidden_size)}")
            if not self.activation.gated:
                if shard_id == "w1":
                    raise ValueError(f"expert {expert_id}: {self.activation.kind} experts are not gated (no gate "
                                     f"projection to load)")
                param.data[local].copy_(loaded[lo:lo + n])
                return
            dst = param.data[local, :n] if shard_id == "w1" else param.data[local, n:]
            dst.copy_(loaded[lo:lo + n])
        elif shard_id == "w2":
            if is_w13 or loaded.shape != (self.hidden_size, self.intermediate_size):
                raise ValueError(f"expert {expert_id} w2 shape {tuple(loaded.shape)}, expected "
                                 f"{(self.hidden_size, self.intermediate_size)}")
            param.data[local].copy_(loaded[:, lo:lo + n])
        else:
            raise ValueError(f"expert shard id must be 'w1', 'w2' or 'w3'; got {shard_id!r}")

    def _load_bias(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None) -> None:
        """A full stacked bias ([E, 2I] gate then up, or [E, H]): this rank's experts and intermediate slice; the
        down bias is added once, by tensor-parallel rank 0 (zeros on the others, whose partial sums it joins)."""
        is_w13 = param is self.w13_bias
        full = self.full_shape("w13_bias" if is_w13 else "w2_bias")
        if shard_id is not None or tuple(loaded.shape) != full:
            raise ValueError(f"stacked expert bias shape {tuple(loaded.shape)}, expected {full}")
        mine = loaded.narrow(0, self.expert_offset, self.num_local_experts)
        if is_w13:
            self._copy_rows(param.data, mine)
        elif self.moe_tp_rank == 0:
            param.data.copy_(mine)
        else:
            param.data.zero_()

    # ---------------------------------------------------------------- shared experts
    def attach_shared_experts(self, mlp: nn.Module) -> None:
        """Let the small-batch path compute `mlp` (a gate_up / down MLP of intermediate size a multiple of the
        experts', e.g. DeepSeek's shared experts) with the routed experts in the same two launches. The caller adds
        `mlp(x)` itself whenever `shared_folded(x)` is False. Held outside the module tree (its parameters keep
        their own names)."""
        self.__dict__["_shared_mlp"] = mlp

    def folded_shared_weights(self, x: torch.Tensor) -> SharedWeights | None:
        """The attached shared MLP's weights (gate_up [2S, H], down [H, S], and for fp8 experts their scales in the
        experts' form) when this call's expert launch also computes it, else None. Never for GPT-OSS's experts
        (`plain_experts` False: the launch applies their activation and biases, a shared MLP has SiLU and none)."""
        mlp = self.__dict__.get("_shared_mlp")
        if mlp is None or self.ep_size > 1 or self.__dict__.get("_fold_off") or not self.plain_experts:
            return None
        from radixserve.layers.triton_ops import use_fused

        shared_scales = getattr(self.quant_method, "shared_scales", None)  # quantized experts that carry its scales
        if shared_scales is None and type(self.quant_method) is not UnquantizedMoEMethod:
            return None
        if x.shape[0] > self.quant_method.small_batch_tokens(self) or not use_fused(x):
            return None
        w13 = getattr(mlp.gate_up_proj, "weight", None)
        w2 = getattr(mlp.down_proj, "weight", None)
        plain = all(getattr(lin, "bias", None) is None and getattr(lin, "lora", None) is None
                    for lin in (mlp.gate_up_proj, mlp.down_proj))
        if not plain or not isinstance(w13, torch.Tensor) or not isinstance(w2, torch.Tensor) or \
                w13.dtype != self.w13_weight.dtype or w2.dtype != self.w2_weight.dtype or \
                w2.shape[1] % self.inter_per_rank:
            return None
        if shared_scales is None:
            return SharedWeights(w13, w2)
        scales = shared_scales(self, mlp.gate_up_proj, mlp.down_proj)
        return None if scales is None else SharedWeights(w13, w2, *scales)

    def shared_folded(self, x: torch.Tensor) -> bool:
        return self.folded_shared_weights(x) is not None

    @contextlib.contextmanager
    def shared_fold_off(self) -> Iterator[None]:
        """Within it the experts' launch never computes the attached shared MLP (the compiled graph's experts op:
        the traced model adds the shared MLP itself)."""
        self.__dict__["_fold_off"] = True
        try:
            yield
        finally:
            del self.__dict__["_fold_off"]

    # ---------------------------------------------------------------- forward
    def forward(self, x: torch.Tensor, router_logits: torch.Tensor,
                correction_bias: torch.Tensor | None = None) -> torch.Tensor:
        topk_weights, topk_ids = select_experts(router_logits, self.router, correction_bias)
        return self.run_experts(x, topk_weights, topk_ids)

    def forward_gated(self, x: torch.Tensor, gate: MoEGate) -> torch.Tensor:
        """`forward(x, gate(x), gate.e_score_correction_bias)`, with the router's linear layer and top-k in one
        launch where `gate.route` can."""
        routed = gate.route(x, self.router)
        if routed is None:
            return self.forward(x, gate(x), gate.e_score_correction_bias)
        return self.run_experts(x, routed[0], routed[1])

    def run_experts(self, x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op in the compiled graph (model_executor/torch_compile.py)
            out = compiled_experts(x, topk_weights, topk_ids, self)
        else:
            out = self.quant_method.apply(self, x, topk_weights, topk_ids)
        if self.reduce_results and self.tp_size > 1:
            out = tensor_model_parallel_all_reduce(out)
        return out


_EXPERT_WEIGHT = re.compile(
    r"^(.*\.experts)\.(\d+)\.(gate_proj|up_proj|down_proj|w1|w2|w3)\.(weight|weight_scale_inv|weight_scale|input_scale"
    r"|qweight|qzeros|scales|g_idx|weight_packed|weight_shape)$")
_SHARD_OF = {"gate_proj": "w1", "w1": "w1", "up_proj": "w3", "w3": "w3", "down_proj": "w2", "w2": "w2"}


def load_expert_weight(params: dict[str, nn.Parameter], name: str, tensor: torch.Tensor) -> str | None:
    """Load a per-expert checkpoint tensor (`...experts.<e>.{gate,up,down}_proj.weight`, or Mixtral's w1/w3/w2;
    an fp8 checkpoint's `.weight_scale_inv` / `.weight_scale` / `.input_scale` beside them, a 4-bit one's packed
    tensors) into its layer's stacked parameter; returns that parameter's name, or None if `name` is not an
    expert's."""
    m = _EXPERT_WEIGHT.match(name)
    if m is None:
        return None
    prefix, expert, part, kind = m.groups()
    shard = _SHARD_OF[part]
    target = f"{prefix}.{'w2' if shard == 'w2' else 'w13'}_{kind}"
    if target not in params:
        raise ValueError(f"checkpoint tensor {name!r} has no stacked expert parameter {target!r} (is the "
                         f"checkpoint's quantization what the model was built for?)")
    params[target].weight_loader(params[target], tensor, shard, int(expert))
    return target
