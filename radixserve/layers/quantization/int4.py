"""Integer weight-only linear layers (W4A16, W8A16) from GPTQ (4 or 8 bits) and AWQ (4 bits) checkpoints (the
`...-GPTQ-Int4` / `-Int8` / `...-AWQ` releases), and from compressed-tensors' pack-quantized W4A16 / W8A16 groups
(`compressed_tensors.py` hands those layers this method).

Each layer's checkpoint tensors are converted as they load into one layout (`int4_formats`: `qweight` uint8 [N, K/2]
(4 bits) or [N, K] (8 bits), `scales` [N, K/G], `qzeros` uint8 [N, K/G]) and sharded like any weight (rows for
column-parallel layers, whole groups of columns for row-parallel ones). A GPTQ model quantised in activation order
(`desc_act`, a `g_idx` that is not k // G) has its input columns sorted by group once loaded and x gathered in that
order before the product (one permutation per layer: q/k/v and gate/up share their input and so their order). The
product: on the GPU a Triton GEMV for up to `GEMV_MAX_M` rows (`int4_kernels`), above that the weight dequantised
into a 16-bit buffer and cuBLAS; on the CPU each layer is dequantised once loaded unless the method was named
(`Int4Config.keep_packed`; packed, the dequantising torch reference runs at every product). Activations stay 16-bit
throughout.

With dummy weights (`--load-format dummy` and such a config) the layers are quantised online to the config's
bits, group and symmetry (round to nearest), so the layout can be measured at a real model's shape. MoE experts in
these formats are dequantised once loaded into the model dtype (`Int4MoEMethod`, with a warning): they load and
run as a 16-bit model's experts would, without the 4-bit memory saving."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.moe.methods import UnquantizedMoEMethod
from radixserve.layers.quantization import int4_formats as fmt
from radixserve.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    UnquantizedLinearMethod,
    is_ignored,
    new_param,
)

if TYPE_CHECKING:
    from radixserve.layers.linear import _LinearBase
    from radixserve.layers.moe.layer import FusedMoE

logger = logging.getLogger(__name__)
_experts_noted = False

FORMATS = ("gptq", "awq", "compressed-tensors")


def quantize_groups(w: torch.Tensor, group: int, sym: bool, bits: int = 4,
                    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """Round-to-nearest quantisation of w [N, K] to `bits` in groups of `group` columns: (our qweight, scales
    float16, qzeros). Symmetric: zero 2^(bits-1) and scale amax / (2^(bits-1) - 0.5); else min/max over the
    2^bits - 1 steps."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.float().reshape(n, k // group, group)
    if sym:
        scale = (g.abs().amax(dim=-1) / (top / 2)).clamp(min=1e-8)
        zero = torch.full_like(scale, float(1 << (bits - 1)))
    else:
        lo, hi = g.amin(dim=-1).clamp(max=0), g.amax(dim=-1).clamp(min=0)
        scale = ((hi - lo) / top).clamp(min=1e-8)
        zero = (-lo / scale).round().clamp(0, top)
    scale = scale.half().float()  # the checkpoints' float16 scales
    q = (g / scale[..., None] + zero[..., None]).round().clamp(0, top).to(torch.uint8).reshape(n, k)
    return fmt.to_layout(q, bits), scale.half(), zero.to(torch.uint8)


class Int4Config(QuantizationConfig):
    """A 4-bit group-quantized checkpoint: `fmt` (gptq, awq, compressed-tensors), `group_size` (-1: a whole row),
    `sym`, `desc_act` (GPTQ's activation order), GPTQ's `checkpoint_format` (gptq_v2 stores zeros as they are),
    `ignored` (modules_to_not_convert / ignore). `serialized` False: dummy weights, quantised online."""

    name = "int4"

    def __init__(self, fmt_name: str, group_size: int, sym: bool = True, desc_act: bool = False,
                 serialized: bool = True, ignored: list[str] | None = None, zeros_stored_minus_one: bool = True,
                 bits: int = 4) -> None:
        if fmt_name not in FORMATS:
            raise ValueError(f"int4 format must be one of {', '.join(FORMATS)}, got {fmt_name!r}")
        if bits not in fmt.BITS or (fmt_name == "awq" and bits != 4):
            raise ValueError(f"{fmt_name}: {bits}-bit weights are not supported (4, or 8 for gptq and "
                             f"compressed-tensors)")
        if group_size != -1 and (group_size < 2 or group_size % 2):
            raise ValueError(f"{fmt_name}: group_size must be -1 or an even number >= 2, got {group_size}")
        if fmt_name == "compressed-tensors" and not sym:
            raise ValueError("compressed-tensors 4-bit weights: only symmetric schemes are supported")
        self.fmt = fmt_name
        self.name = fmt_name
        self.group_size = group_size
        self.sym = sym
        self.desc_act = desc_act
        self.serialized = serialized
        self.ignored = list(ignored or [])
        self.zeros_stored_minus_one = zeros_stored_minus_one
        self.bits = bits
        self.packed = True  # False: each layer dequantised once loaded (the CPU default, `keep_packed`)
        self._unpacked_noted = False

    def qweight_of(self, words: torch.Tensor) -> torch.Tensor:
        """The checkpoint's packed weight (whole) in our layout."""
        if self.fmt == "awq":
            return fmt.awq_qweight(words)
        return (fmt.gptq_qweight if self.fmt == "gptq" else fmt.ct_weight_packed)(words, self.bits)

    def qzeros_of(self, words: torch.Tensor | None, scales: torch.Tensor) -> torch.Tensor:
        """The checkpoint's packed zeros (whole) in our layout; compressed-tensors stores none (2^(bits-1))."""
        if self.fmt == "compressed-tensors":
            return torch.full(scales.shape, 1 << (self.bits - 1), dtype=torch.uint8, device=scales.device)
        if words is None:
            raise ValueError(f"{self.fmt}: the checkpoint lacks qzeros")
        if self.fmt == "awq":
            return fmt.awq_qzeros(words)
        return (fmt.gptq_qzeros if self.zeros_stored_minus_one else fmt.gptq_v2_qzeros)(words, self.bits)

    def keep_packed(self, packed: bool) -> None:
        """Whether the linear layers keep their 4-bit form (the GPU, or the method named) or are dequantised once
        loaded (the CPU by default: the same products, without dequantising at every step)."""
        self.packed = packed

    def note_unpacked(self) -> None:
        if not self._unpacked_noted:
            self._unpacked_noted = True
            logger.info("%s: 4-bit linear layers dequantised to the model dtype once loaded (the CPU default; "
                        "--quantization %s keeps them packed)", self.fmt, self.fmt)

    @classmethod
    def from_config(cls, config: dict[str, Any], *, serialized: bool) -> Int4Config:
        method = str(config.get("quant_method", "")).lower()
        if method not in ("gptq", "awq"):
            raise ValueError(f"{method or 'gptq/awq'} quantization reads the checkpoint's quantization_config; this "
                             f"checkpoint has none (for online 4-bit weights, use --quantization q4_k)")
        bits = config.get("bits", config.get("w_bit"))
        if bits not in ((4,) if method == "awq" else fmt.BITS):
            raise ValueError(f"{method}: {bits}-bit weights are not supported (awq: 4; gptq: 4 or 8)")
        group = int(config.get("group_size", config.get("q_group_size", 128)))
        ignored = list(config.get("modules_to_not_convert") or [])
        if method == "awq":
            version = str(config.get("version", "gemm")).lower()
            if version != "gemm":
                raise ValueError(f"awq version {version!r} is not supported (the GEMM layout is)")
            if config.get("zero_point") is False:
                raise ValueError("awq without zero points is not supported")
            return cls("awq", group, sym=False, serialized=serialized, ignored=ignored)
        if config.get("dynamic"):
            raise ValueError("gptq per-module overrides (`dynamic`) are not supported")
        if config.get("lm_head"):
            raise ValueError("gptq with a quantized lm_head is not supported")
        ckpt = str(config.get("checkpoint_format", "gptq")).lower()
        if ckpt not in ("gptq", "gptq_v2"):
            raise ValueError(f"gptq checkpoint_format {ckpt!r} is not supported (gptq, gptq_v2)")
        return cls("gptq", group, sym=bool(config.get("sym", True)), desc_act=bool(config.get("desc_act", False)),
                   serialized=serialized, ignored=ignored, zeros_stored_minus_one=ckpt == "gptq", bits=int(bits))

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from radixserve.layers.linear import _LinearBase
        from radixserve.layers.moe.layer import FusedMoE

        if is_ignored(prefix, self.ignored):
            return None
        if isinstance(layer, _LinearBase):
            # a layer of fewer than 8 output rows (Qwen2-MoE's shared_expert_gate) has no packing in these formats:
            # the quantisers leave it 16-bit
            return Int4LinearMethod(self) if layer.output_size >= 8 else None
        if isinstance(layer, FusedMoE):
            if not self.serialized:
                return None  # dummy weights: the experts stay 16-bit, as a checkpoint's would once loaded
            if not _experts_noted:
                _note_experts(self.fmt)
            return Int4MoEMethod(self)
        return None

    def matrix_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """A layer the model reads as a matrix (MLA's kv_b_proj): loaded as stored, dequantised once."""
        from radixserve.layers.linear import _LinearBase

        if not isinstance(layer, _LinearBase) or is_ignored(prefix, self.ignored):
            return None
        return Int4DequantizedMethod(self)


def _names(cfg: Int4Config) -> tuple[str, str, str | None]:
    """The checkpoint's names of the packed weight, the scales and the zeros (None: not stored)."""
    if cfg.fmt == "compressed-tensors":
        return "weight_packed", "weight_scale", None
    return "qweight", "scales", "qzeros"


class Int4LinearMethod(LinearMethodBase):
    """Ends with `qweight`, `scales`, `qzeros` in `int4_formats`' layout and `perm` (int64 [K] or None)."""

    def __init__(self, config: Int4Config) -> None:
        self.config = config

    def _group(self, layer: _LinearBase) -> int:
        k = layer.input_size
        group = self.config.group_size
        if group == -1:
            if _row_split(layer):
                raise ValueError(f"{self.config.fmt}: a whole-row group (group_size -1) cannot be split across "
                                 f"{layer.tp_size} ranks")
            return k
        if k % group or k % 2:
            raise ValueError(f"{self.config.fmt}: this rank's {k} input columns are not whole groups of {group}")
        return group

    def create_weights(self, layer: _LinearBase) -> None:
        n, k = layer.output_size, layer.input_size
        group = self._group(layer)
        cfg = self.config
        if not cfg.serialized:
            layer.weight = new_param((n, k), layer.params_dtype, {"output_dim": 0, "input_dim": 1})
            return
        if cfg.desc_act and _row_split(layer):
            raise ValueError("gptq with desc_act (activation order) cannot split a layer's input columns across "
                             "ranks; serve it without tensor parallelism")
        wname, sname, zname = _names(cfg)
        per_byte = 8 // cfg.bits
        dims = {"output_dim": 0, "input_dim": 1}
        self._param(layer, wname, new_param((n, k // per_byte), torch.uint8, {**dims, "input_block": per_byte}),
                    cfg.qweight_of)
        gdims = {"output_dim": 0, "input_dim": 1, "input_block": group}
        dtype = torch.float16 if cfg.fmt != "compressed-tensors" else layer.params_dtype
        self._param(layer, sname, new_param((n, k // group), dtype, gdims, fill=0.0),
                    None if cfg.fmt == "compressed-tensors" else fmt.group_transpose)
        if zname is not None:
            self._param(layer, zname, new_param((n, k // group), torch.uint8, gdims),
                        lambda words: cfg.qzeros_of(words, None))
        if cfg.fmt == "gptq":
            g_idx = new_param((k,), torch.int32, {"output_dim": None, "input_dim": 0}, fill=-1)
            g_idx.optional = True  # absent from some checkpoints (those quantised in plain order)
            g_idx.weight_loader = _same_for_every_member(layer, group)
            layer.g_idx = g_idx
        if cfg.fmt == "compressed-tensors":
            shape = new_param((2,), torch.int64, {}, fill=0)
            shape.weight_loader = _shape_check(layer)
            layer.weight_shape = shape

    @staticmethod
    def _param(layer: _LinearBase, name: str, param: nn.Parameter, convert: Any) -> None:
        def loader(p: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
            layer.weight_loader(p, convert(loaded) if convert is not None else loaded.to(p.dtype), shard_id)

        param.weight_loader = loader
        setattr(layer, name, param)

    def process_weights_after_loading(self, layer: _LinearBase) -> None:
        cfg = self.config
        if not cfg.serialized:
            qweight, scales, qzeros = quantize_groups(layer.weight.data, self._group(layer), cfg.sym, cfg.bits)
            del layer.weight
            self._finish(layer, qweight, scales, qzeros, None)
            return
        wname, sname, zname = _names(cfg)
        qweight, scales = getattr(layer, wname).data, getattr(layer, sname).data
        qzeros = cfg.qzeros_of(None, scales) if zname is None else getattr(layer, zname).data
        perm = None
        g_idx = getattr(layer, "g_idx", None)
        if g_idx is not None and bool((g_idx.data >= 0).all()):
            perm = _activation_order(g_idx.data, self._group(layer), cfg.desc_act)
        for name in (wname, sname, zname, "g_idx", "weight_shape"):
            if name is not None and hasattr(layer, name):
                delattr(layer, name)
        if perm is not None:  # sort the input columns by group: x is gathered the same way at every product
            qweight = fmt.to_layout(fmt.values_of(qweight, cfg.bits)[:, perm], cfg.bits)
        self._finish(layer, qweight, scales, qzeros, perm)
        if not cfg.packed and type(self) is Int4LinearMethod:
            cfg.note_unpacked()
            _dequantize_layer(layer, cfg.bits)

    @staticmethod
    def _finish(layer: _LinearBase, qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                perm: torch.Tensor | None) -> None:
        layer.qweight = nn.Parameter(qweight.contiguous(), requires_grad=False)
        layer.scales = nn.Parameter(scales.contiguous(), requires_grad=False)
        layer.qzeros = nn.Parameter(qzeros.contiguous(), requires_grad=False)
        layer.register_buffer("perm", None if perm is None else perm.to(torch.int64), persistent=False)
        layer._quant_param_names = ["qweight", "scales", "qzeros"]

    def apply(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        from radixserve.layers.triton_ops import use_fused

        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        if layer.perm is not None:
            x2 = x2.index_select(1, layer.perm)
        if use_fused(x2):
            from radixserve.layers.quantization.int4_kernels import GEMV_MAX_M, int4_dequantize, int4_gemv

            bits = self.config.bits
            if x2.shape[0] <= GEMV_MAX_M:
                out = int4_gemv(x2.contiguous(), layer.qweight, layer.scales, layer.qzeros, bias, bits)
            else:
                w = int4_dequantize(layer.qweight, layer.scales, layer.qzeros, x2.shape[1], x2.dtype, bits)
                out = F.linear(x2, w, bias)
        else:
            w = fmt.dequantize(layer.qweight, layer.scales, layer.qzeros, self.config.bits).to(x2.dtype)
            out = F.linear(x2, w, bias)
        return out.view(*shape[:-1], out.shape[-1])


class Int4DequantizedMethod(Int4LinearMethod):
    """A layer the model reads as a matrix (MLA's kv_b_proj): loaded as the checkpoint stores it, then dequantised
    once to the model dtype, after which it is an unquantized layer."""

    def process_weights_after_loading(self, layer: _LinearBase) -> None:
        super().process_weights_after_loading(layer)
        _dequantize_layer(layer, self.config.bits)


def _dequantize_layer(layer: _LinearBase, bits: int) -> None:
    """Turn a loaded 4/8-bit layer into an unquantized one holding the dequantised weight (in the checkpoint's
    column order)."""
    w = fmt.dequantize(layer.qweight.data, layer.scales.data, layer.qzeros.data, bits)
    if layer.perm is not None:
        w = w[:, torch.argsort(layer.perm)]
    w = w.to(layer.params_dtype)
    for name in ("qweight", "scales", "qzeros"):
        delattr(layer, name)
    layer.perm = None
    layer._quant_param_names = []
    layer.set_quant_method(UnquantizedLinearMethod())
    layer.weight.data.copy_(w)


def _row_split(layer: _LinearBase) -> bool:
    """Whether this rank holds only some of the layer's input columns (a row-parallel layer under TP)."""
    from radixserve.layers.linear import RowParallelLinear

    return isinstance(layer, RowParallelLinear) and layer.tp_size > 1


def _activation_order(g_idx: torch.Tensor, group: int, desc_act: bool) -> torch.Tensor | None:
    """None when every column k is in group k // G (plain order); else the permutation sorting the columns by
    group, each group exactly G columns (GPTQ's activation order)."""
    k = g_idx.shape[0]
    plain = torch.arange(k, device=g_idx.device) // group
    if torch.equal(g_idx.to(plain.dtype), plain):
        return None
    counts = torch.bincount(g_idx.long(), minlength=k // group)
    if counts.shape[0] != k // group or not bool((counts == group).all()):
        raise ValueError(f"gptq g_idx does not put {group} columns in each of the {k // group} groups")
    if not desc_act:
        logger.warning("gptq: desc_act is false but g_idx is in activation order; following g_idx")
    return torch.argsort(g_idx.long(), stable=True)


def _same_for_every_member(layer: _LinearBase, group: int) -> Any:
    """g_idx's loader: a stacked layer's matrices share their input, so their g_idx must agree. A row-parallel
    rank takes its columns' entries, renumbered from its first group (its columns are whole groups; activation
    order is refused there)."""
    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        k = param.shape[0]
        if _row_split(layer) and loaded.shape[0] == k * layer.tp_size:
            loaded = loaded.narrow(0, layer.tp_rank * k, k) - (layer.tp_rank * k) // group
        if loaded.shape != param.shape:
            raise ValueError(f"gptq g_idx of shape {tuple(loaded.shape)}, expected {tuple(param.shape)}")
        loaded = loaded.to(param.dtype)
        if bool((param.data >= 0).all()) and not torch.equal(param.data, loaded):
            raise ValueError("gptq: the matrices of a stacked layer (q/k/v or gate/up) have different g_idx")
        param.data.copy_(loaded)

    return loader


def _shape_check(layer: _LinearBase) -> Any:
    """compressed-tensors' `weight_shape` ([rows, columns] of each matrix): its columns must be the layer's."""
    def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        k = layer.input_size * (layer.tp_size if _row_split(layer) else 1)
        if loaded.numel() != 2 or int(loaded.reshape(-1)[1]) != k:
            raise ValueError(f"compressed-tensors weight_shape {loaded.tolist()} does not have the layer's {k} "
                             f"input columns")
        param.data.copy_(loaded.reshape(-1).to(param.dtype))

    return loader


def _note_experts(fmt_name: str) -> None:
    global _experts_noted
    _experts_noted = True
    logger.warning("%s: the MoE experts' 4-bit weights are dequantised to the model dtype once loaded (the linear "
                   "layers stay 4-bit)", fmt_name)


class Int4MoEMethod(UnquantizedMoEMethod):
    """4-bit experts dequantised once loaded: the checkpoint's per-expert packed tensors are kept (this rank's
    experts only) until every weight is in, then each matrix is dequantised (by its g_idx where it has one) and
    loaded into the 16-bit `w13_weight` / `w2_weight` through the layer's own loader (which takes this rank's
    rows or columns)."""

    def __init__(self, config: Int4Config) -> None:
        self.config = config
        self.pending: dict[tuple[int, str, str], torch.Tensor] = {}

    def _kinds(self) -> tuple[str, ...]:
        if self.config.fmt == "compressed-tensors":
            return "weight_packed", "weight_scale", "weight_shape"
        kinds = ("qweight", "qzeros", "scales")
        return (*kinds, "g_idx") if self.config.fmt == "gptq" else kinds

    def create_weights(self, layer: FusedMoE, num_experts: int, hidden_size: int, inter_size: int) -> None:
        super().create_weights(layer, num_experts, hidden_size, inter_size)
        for p in (layer.w13_weight, layer.w2_weight):
            p.optional = True  # filled from the packed tensors, not from checkpoint tensors of these names
        for kind in self._kinds():
            for stack in ("w13", "w2"):
                param = nn.Parameter(torch.empty(0), requires_grad=False)
                param.weight_loader = self._stash(layer, kind)
                param.optional = kind == "g_idx"
                setattr(layer, f"{stack}_{kind}", param)

    def _stash(self, layer: FusedMoE, kind: str) -> Any:
        def loader(param: nn.Parameter, loaded: torch.Tensor, shard_id: str | None = None,
                   expert_id: int | None = None) -> None:
            if shard_id not in ("w1", "w2", "w3") or expert_id is None or not 0 <= expert_id < layer.num_experts:
                raise ValueError(f"4-bit expert tensor {kind}: shard {shard_id!r} / expert {expert_id} is not one "
                                 f"expert's gate, up or down matrix")
            if 0 <= expert_id - layer.expert_offset < layer.num_local_experts:
                self.pending[expert_id, shard_id, kind] = loaded.clone()

        return loader

    def _dequantized(self, expert: int, shard: str) -> torch.Tensor:
        cfg = self.config
        got = {kind: self.pending.pop((expert, shard, kind), None) for kind in self._kinds()}
        wname, sname, zname = _names(cfg)
        if got[wname] is None or got[sname] is None or (zname is not None and got[zname] is None):
            raise ValueError(f"expert {expert} {shard}: the checkpoint lacks its {wname} / {sname} / {zname}")
        qweight = cfg.qweight_of(got[wname])
        scales = got[sname] if cfg.fmt == "compressed-tensors" else fmt.group_transpose(got[sname])
        qzeros = cfg.qzeros_of(None if zname is None else got[zname], scales)
        k = qweight.shape[1] * (8 // cfg.bits)
        if k % scales.shape[1]:
            raise ValueError(f"expert {expert} {shard}: {k} columns are not whole groups of {scales.shape}")
        g_idx = got.get("g_idx")
        if g_idx is None:
            g_idx = torch.arange(k, device=qweight.device) // (k // scales.shape[1])
        return fmt.dequantize_by_index(qweight, scales, qzeros, g_idx, cfg.bits)

    def process_weights_after_loading(self, layer: FusedMoE) -> None:
        dtype = layer.w13_weight.dtype
        for local in range(layer.num_local_experts):
            expert = layer.expert_offset + local
            for shard in ("w1", "w3", "w2"):
                w = self._dequantized(expert, shard).to(dtype)
                target = layer.w2_weight if shard == "w2" else layer.w13_weight
                layer.weight_loader(target, w, shard, expert)
        if self.pending:
            raise ValueError(f"4-bit experts: unexpected checkpoint tensors {sorted(self.pending)[:4]}")
        for kind in self._kinds():
            for stack in ("w13", "w2"):
                delattr(layer, f"{stack}_{kind}")
