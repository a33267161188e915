"""FP8 experts: the MoE layers of an fp8 model (`Fp8Config` gives every `FusedMoE` this method).

Three ways in, as for the linear layers (`fp8.py`):
- a checkpoint with block-wise scales (DeepSeek-V3, the Qwen3 FP8 releases): each expert's `gate_proj` / `up_proj`
  / `down_proj` `.weight` (float8_e4m3fn) and `.weight_scale_inv` [ceil(N / bn), ceil(K / bk)], stacked here;
- a checkpoint with per-tensor scales (`.weight_scale`, one per expert matrix): the scale becomes its rows';
  with per-channel scales (`.weight_scale` [N, 1], compressed-tensors): kept;
- `--quantization fp8` on a 16/32-bit checkpoint: each expert quantised after loading, one scale per output row
  (dummy weights with a block-wise checkpoint's `quantization_config`: to its blocks).
Non-gated relu2 experts (Nemotron 3; NVIDIA's ModelOpt FP8 release: per-tensor scales) have no gate: w13 holds each
expert's `up_proj` rows alone ([E, I, H]) and its scales as many rows (one per-tensor scale, not a (gate, up) pair);
the kernels skip the gate (`ACT` 2). Experts with biases (GPT-OSS) are not served here (`serves`).

The products (`MoEMethod.apply`): for the fewest tokens W8A16, the activations as they are (multiplied on the CUDA
cores, block-wise scales applied to each K step's sums: `small_batch`); above `small_batch_tokens` (4), for
16-bit models, W8A8 grouped GEMMs with the activations quantised per row and 128 columns on the fly (`fused_moe`;
W8A16 for a weight-only checkpoint).
A static checkpoint's `input_scale`s load and go unused (the activation scales are always dynamic). On the CPU the
torch reference dequantises one expert at a time (`moe_torch`)."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.layers.moe.methods import ExpertScales, MoEMethod
from radixserve.layers.quantization.fp8 import FP8, quantize_blocks, quantize_rows

if TYPE_CHECKING:
    from radixserve.layers.moe.layer import FusedMoE
    from radixserve.layers.quantization.fp8 import Fp8Config

logger = logging.getLogger(__name__)
_static_noted = False  # one log line a process for a static checkpoint's unused expert input scales


def _param(data: torch.Tensor, loader: object) -> nn.Parameter:
    p = nn.Parameter(data, requires_grad=False)
    p.weight_loader = loader
    return p


class Fp8MoEMethod(MoEMethod):
    """The layer ends with `w13_weight` fp8 [E, 2I, H] ([E, I, H], up rows alone, for non-gated relu2 experts),
    `w2_weight` fp8 [E, H, I] and their float32 scales `w13_scale` / `w2_scale` (`ExpertScales`' layout). SiLU and
    relu2 experts without biases (GPT-OSS's biased experts stay in the model dtype)."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.block = config.weight_block_size
        self.groups: tuple[int, int, int] | None = None  # (group_n, group_k13, group_k2), set after loading
        self._forms: dict[str, tuple[bool, int]] = {}  # FP8_BLOCKS_FORM -> (W8A8 grouped GEMMs, small-batch form)

    # ------------------------------------------------------------ weights
    def serves(self, layer: FusedMoE) -> bool:
        return layer.w13_bias is None and layer.activation.kind in ("silu", "relu2")

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, inter_size: int) -> None:
        e, h, i = num_experts, hidden_size, inter_size
        rows = layer.activation.w13_rows(i)  # gate rows then up rows, or (relu2) up rows alone
        shards = 2 if layer.activation.gated else 1  # per-tensor scales of w13: (gate, up) or (up,)
        if not self.config.serialized:  # 16/32-bit weights, quantised after loading
            layer.w13_weight = _param(torch.empty(e, rows, h), layer.weight_loader)
            layer.w2_weight = _param(torch.empty(e, h, i), layer.weight_loader)
            return
        layer.w13_weight = _param(torch.empty(e, rows, h, dtype=FP8), layer.weight_loader)
        layer.w2_weight = _param(torch.empty(e, h, i, dtype=FP8), layer.weight_loader)

        def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                   expert_id: int | None = None) -> None:
            self._load_scale(layer, param, loaded, shard_id, expert_id)

        strategy = self.config.weight_strategy
        if strategy == "block":
            bn, bk = self.block
            if i % bn or (layer.moe_tp_size > 1 and i % bk):
                raise ValueError(f"block-wise fp8 experts: the intermediate size per rank {i} is not a multiple of "
                                 f"the block {self.block}")
            f32, name = torch.float32, self.config.block_scale_name
            setattr(layer, f"w13_{name}", _param(torch.ones(e, rows // bn, -(-h // bk), dtype=f32), loader))
            setattr(layer, f"w2_{name}", _param(torch.ones(e, -(-h // bn), -(-i // bk), dtype=f32), loader))
            return
        if strategy == "channel":  # a scale per row: [E, 2I, 1] (gate rows, then up rows; relu2: up) and [E, H, 1]
            layer.w13_weight_scale = _param(torch.ones(e, rows, 1, dtype=torch.float32), loader)
            layer.w2_weight_scale = _param(torch.ones(e, h, 1, dtype=torch.float32), loader)
        else:
            layer.w13_weight_scale = _param(torch.ones(e, shards, dtype=torch.float32), loader)  # (gate, up) / (up,)
            layer.w2_weight_scale = _param(torch.ones(e, dtype=torch.float32), loader)
        if self.config.activation_scheme == "static":
            layer.w13_input_scale = _param(torch.ones(e, shards, dtype=torch.float32), loader)
            layer.w2_input_scale = _param(torch.ones(e, dtype=torch.float32), loader)

    def _load_scale(self, layer: FusedMoE, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None,
                    expert_id: int | None) -> None:
        """One expert's scale tensor from the checkpoint (`shard_id` w1 = gate, w3 = up, w2 = down; non-gated
        experts: their up rows are all of w13, and a gate's scale is refused)."""
        if shard_id not in ("w1", "w2", "w3") or expert_id is None or not 0 <= expert_id < layer.num_experts:
            raise ValueError(f"fp8 expert scale: shard {shard_id!r} / expert {expert_id} is not one expert's "
                             f"gate, up or down matrix")
        gated = layer.activation.gated
        if shard_id == "w1" and not gated:
            raise ValueError(f"expert {expert_id}: {layer.activation.kind} experts are not gated (no gate "
                             f"projection's scale to load)")
        local = expert_id - layer.expert_offset
        if not 0 <= local < layer.num_local_experts:
            return  # another rank's expert
        is_w13 = shard_id != "w2"
        first = shard_id == "w1" or not gated  # the w13 section this shard fills: the first (gate, or relu2's up)
        loaded = loaded.float()
        strategy = self.config.weight_strategy if param.dim() > 2 else "tensor"  # (input scales: per tensor)
        if strategy == "channel":
            h, i_full, i = layer.hidden_size, layer.intermediate_size, layer.inter_per_rank
            rows = i_full if is_w13 else h
            if loaded.numel() != rows or (loaded.dim() == 2 and loaded.shape[1] != 1) or loaded.dim() > 2:
                raise ValueError(f"expert {expert_id} {shard_id}: a per-channel fp8 scale has shape ({rows}, 1), got "
                                 f"{tuple(loaded.shape)}")
            loaded = loaded.reshape(rows, 1)
            if is_w13:
                dst = param.data[local, :i] if first else param.data[local, i:]
                dst.copy_(loaded[layer.moe_tp_rank * i:(layer.moe_tp_rank + 1) * i])
            else:
                param.data[local].copy_(loaded)
            return
        if strategy == "block":  # rows of blocks over N, columns over K
            bn, bk = self.block
            h, i_full, i = layer.hidden_size, layer.intermediate_size, layer.inter_per_rank
            full = (-(-i_full // bn), -(-h // bk)) if is_w13 else (-(-h // bn), -(-i_full // bk))
            if tuple(loaded.shape) != full:
                raise ValueError(f"expert {expert_id} {shard_id} {self.config.block_scale_name} shape "
                                 f"{tuple(loaded.shape)}, expected {full}")
            if is_w13:
                nb = i // bn
                dst = param.data[local, :nb] if first else param.data[local, nb:]
                dst.copy_(loaded[layer.moe_tp_rank * nb:(layer.moe_tp_rank + 1) * nb])
            else:
                kb = -(-i // bk)
                param.data[local].copy_(loaded[:, layer.moe_tp_rank * kb:layer.moe_tp_rank * kb + kb])
            return
        if loaded.numel() != 1:
            raise ValueError(f"expert {expert_id} {shard_id}: a per-tensor fp8 scale has one value, got "
                             f"{tuple(loaded.shape)}")
        if is_w13:
            param.data[local, 0 if first else 1] = loaded.reshape(())
        else:
            param.data[local] = loaded.reshape(())

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        h, i = layer.hidden_size, layer.inter_per_rank
        self._forms.clear()
        if not self.config.serialized:
            q13, s13 = _quantize_experts(layer.w13_weight.data, self.block)
            q2, s2 = _quantize_experts(layer.w2_weight.data, self.block)
            layer.w13_weight = _param(q13, layer.weight_loader)
            layer.w2_weight = _param(q2, layer.weight_loader)
            self.groups = (1, h, i) if self.block is None else (self.block[0], self.block[1], self.block[1])
        elif self.block is not None:
            name = self.config.block_scale_name
            s13, s2 = getattr(layer, f"w13_{name}").data, getattr(layer, f"w2_{name}").data
            delattr(layer, f"w13_{name}")
            delattr(layer, f"w2_{name}")
            self.groups = (self.block[0], self.block[1], self.block[1])
        else:  # per channel as stored; per tensor: each matrix's scale on each of its rows
            if self.config.weight_strategy == "channel":
                s13, s2 = layer.w13_weight_scale.data, layer.w2_weight_scale.data
            else:  # (gate, up) or relu2's (up,): each section's I rows
                s13 = layer.w13_weight_scale.data.repeat_interleave(i, dim=1).unsqueeze(-1)
                s2 = layer.w2_weight_scale.data[:, None, None].expand(-1, h, 1)
            del layer.w13_weight_scale, layer.w2_weight_scale
            if hasattr(layer, "w13_input_scale"):  # activation scales are dynamic here
                del layer.w13_input_scale, layer.w2_input_scale
                _note_static_scales()
            self.groups = (1, h, i)
        layer.w13_scale = nn.Parameter(s13.float().contiguous(), requires_grad=False)
        layer.w2_scale = nn.Parameter(s2.float().contiguous(), requires_grad=False)

    def expert_scales(self, layer: FusedMoE) -> ExpertScales | None:
        if self.groups is None:
            raise RuntimeError("fp8 experts used before their weights were processed (finish_quantization)")
        return ExpertScales(layer.w13_scale, layer.w2_scale, *self.groups)

    def shared_scales(self, layer: FusedMoE, gate_up: nn.Module, down: nn.Module,
                      ) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The scales of a shared MLP's fp8 gate_up / down layers in the form the small-batch kernels read the
        experts' (`small_batch.small_batch_moe`'s shared_scales), or None when they cannot ride along: not fp8, a
        static activation scale, or another scale form than the experts'."""
        from radixserve.layers.quantization.fp8 import Fp8LinearMethod

        methods = [getattr(lin, "quant_method", None) for lin in (gate_up, down)]
        if self.groups is None or not all(type(m) is Fp8LinearMethod for m in methods) or \
                any(getattr(lin, "input_scale", None) is not None for lin in (gate_up, down)):
            return None
        gn, gk13, gk2 = self.groups
        s13, s2 = gate_up.weight_scale, down.weight_scale
        if gk13 >= layer.hidden_size and gk2 >= layer.inter_per_rank:  # the experts: a scale per row
            if methods[0].block is not None or methods[1].block is not None or gn != 1:
                return None
            return s13.reshape(-1, 1), s2.reshape(-1, 1)
        if any(m.block != [gn, gk13] for m in methods) or gk13 != gk2:
            return None
        return s13, s2

    def activations_fp8(self, layer: FusedMoE) -> bool | None:
        """16-bit activations (W8A16 grouped GEMMs) for a weight-only checkpoint; else `fused_moe`'s default."""
        return False if self.config.weight_only else None

    def small_batch_tokens(self, layer: FusedMoE) -> int:
        """Fewer than 16-bit experts where the grouped GEMMs would run W8A8 (measured: `small_batch`'s
        SMALL_BATCH_TOKENS_FP8 for its CUDA-core forms, SMALL_BATCH_TOKENS_FP8_DOT for block-wise `tl.dot`); the
        16-bit limit where they would widen the weights (W8A16)."""
        from radixserve.layers.moe import small_batch
        from radixserve.layers.moe.fused_moe import fp8_activations

        forms = self._forms.get(small_batch.FP8_BLOCKS_FORM)
        if forms is None:  # fixed once the weights are processed (asked on every eager call of every layer)
            scales = self.expert_scales(layer)
            forms = (not self.config.weight_only
                     and fp8_activations(scales, layer.act_dtype, layer.hidden_size, layer.inter_per_rank),
                     small_batch.fp8_form(scales))
            self._forms[small_batch.FP8_BLOCKS_FORM] = forms
        a8, form = forms
        if not a8:
            return small_batch.SMALL_BATCH_TOKENS
        return small_batch.SMALL_BATCH_TOKENS_FP8_DOT if form == 2 else small_batch.SMALL_BATCH_TOKENS_FP8


def _quantize_experts(w: torch.Tensor, block: list[int] | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """w [E, N, K] -> (fp8 [E, N, K], float32 scales): [E, N, 1], one scale per row, or with `block` [bn, bk]
    [E, ceil(N / bn), ceil(K / bk)], one per block; an expert at a time (no float32 copy of the whole stack)."""
    e, n, k = w.shape
    q = torch.empty(w.shape, dtype=FP8, device=w.device)
    if block is None:
        s = torch.empty(e, n, 1, dtype=torch.float32, device=w.device)
        for x in range(e):
            q[x], s[x, :, 0] = quantize_rows(w[x])
        return q, s
    s = torch.empty(e, -(-n // block[0]), -(-k // block[1]), dtype=torch.float32, device=w.device)
    for x in range(e):
        q[x], s[x] = quantize_blocks(w[x], *block)
    return q, s


def _note_static_scales() -> None:
    global _static_noted
    if not _static_noted:
        _static_noted = True
        logger.info("fp8 experts: the checkpoint's static input scales are not used; the experts quantise their "
                    "activations with dynamic scales (per row and 128 columns) or keep them 16-bit")
