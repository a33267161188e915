"""FP8 (float8_e4m3fn) linear layers.

Three ways in, one layer at the end:
- a checkpoint with per-tensor scales (`weight_scale`, and `input_scale` when its activation scheme is static):
  each stacked matrix's scale becomes the scale of its rows, i.e. per-channel scales; with per-channel scales
  (`weight_scale` [N, 1], as compressed-tensors' FP8-dynamic checkpoints ship them): kept as they are;
- a checkpoint with block-wise scales (`weight_scale_inv` [ceil(N/bn), ceil(K/bk)], `weight_block_size`
  [bn, bk], as DeepSeek-V3 and the Qwen3 FP8 releases ship; compressed-tensors names them `weight_scale`): kept
  as they are;
- `--quantization fp8` on a 16/32-bit checkpoint: quantised after loading, one scale per output channel;
- dummy weights (`--load-format dummy`) with a block-wise checkpoint's `quantization_config`: quantised after
  loading to its blocks, so the layers hold what that checkpoint would load (the layout, not the values).
The MoE layers' experts take the same forms (`fp8_moe.py`).

The product: for a batch of at most `SMALL_M` rows (any batch for a weight-only checkpoint, activation scheme
"none") the weight is widened inside a Triton kernel (W8A16; the
product reads the fp8 bytes once and needs no activation scales; per-channel weights through the bandwidth-bound
GEMV kernels of `fp8_gemv`, block-wise ones too at one or two rows, else through `fp8_gemm`); above it the
activations get dynamic scales (per token, or per token and 128-column group for block-wise weights; static
per-tensor when the checkpoint says so) and the product runs on fp8 tensor cores: `torch._scaled_mm` for
per-channel weights, the Triton block-scaled kernel for block-wise ones; per-channel weights at batch sizes the
swept table covers (up to MID_MAX_M rows) take the kernel it names (`fp8_mid`). On the CPU the same arithmetic runs
as a dequantising torch reference."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers.quantization.base import (
    LinearMethodBase,
    QuantizationConfig,
    QuantizeMethodBase,
    is_ignored,
    new_param,
)

if TYPE_CHECKING:
    from radixserve.layers.linear import _LinearBase
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs

logger = logging.getLogger(__name__)

FP8 = torch.float8_e4m3fn
FP8_MAX = float(torch.finfo(FP8).max)
SMALL_M = int(os.environ.get("RADIXSERVE_FP8_W8A16_MAX_M", "16"))
# Rows up to which the elementwise GEMV kernel runs instead of the tl.dot one; 0 (off) by default: on an H200 it
# was slower at batch 1 (8B shape: 6.51 ms a step against 5.62 ms with the tl.dot kernel, bf16 4.92-5.52 ms).
FP8_GEMV_MAX_M = int(os.environ.get("RADIXSERVE_FP8_GEMV_MAX_M", "0"))
# Per-channel weights at up to SMALL_M rows, block-wise ones at one or two, go through the bandwidth-bound kernels of
# `fp8_gemv` (block sizes swept per shape, `gemv_configs`); RADIXSERVE_FP8_SKINNY=0 sends them to the W8A16 `fp8_gemm`
# instead (comparisons).
SKINNY = os.environ.get("RADIXSERVE_FP8_SKINNY", "1") != "0"
# Above SMALL_M and up to this many rows, per-channel products run the kernel the swept table names for the shape
# and batch size (`fp8_mid`: a transposed W8A8 or W8A16 Triton product that keeps every SM streaming the weight),
# where it has one; 0 turns the table off (torch._scaled_mm throughout).
MID_MAX_M = int(os.environ.get("RADIXSERVE_FP8_MID_MAX_M", "256"))
_EPS = 1e-10


# ---------------------------------------------------------------- torch references (the CPU path)
def quantize_rows(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scales [N]): one scale per row, amax / 448."""
    scale = w.float().abs().amax(dim=1).clamp(min=_EPS) / FP8_MAX
    q = (w.float() / scale[:, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q, scale


def quantize_blocks(w: torch.Tensor, bn: int, bk: int) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (fp8 [N, K], float32 scales [ceil(N/bn), ceil(K/bk)]): one scale per bn x bk block."""
    n, k = w.shape
    gn, gk = -(-n // bn), -(-k // bk)
    padded = torch.zeros(gn * bn, gk * bk, dtype=torch.float32, device=w.device)
    padded[:n, :k] = w.float()
    blocks = padded.view(gn, bn, gk, bk)
    scale = blocks.abs().amax(dim=(1, 3)).clamp(min=_EPS) / FP8_MAX
    q = (blocks / scale[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).view(gn * bn, gk * bk)[:n, :k]
    return q.to(FP8).contiguous(), scale


def dequantize_blocks(q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int) -> torch.Tensor:
    """float32 weight of an fp8 [N, K] tensor with scales [ceil(N/bn), ceil(K/bk)] per bn x bk block (per row: bn
    1, bk >= K), or per row for 1-D scales [N]."""
    n, k = q.shape
    if scale.dim() == 1:
        return q.float() * scale.reshape(n, 1).float()
    s = scale.repeat_interleave(bn, dim=0)[:n].repeat_interleave(bk, dim=1)[:, :k]
    return q.float() * s


def quantize_groups_ref(x: torch.Tensor, group: int) -> tuple[torch.Tensor, torch.Tensor]:
    """x [M, K] -> (fp8 [M, K], float32 scales [M, K // group]): the reference of `per_token_group_quant_fp8`."""
    m, k = x.shape
    g = x.float().view(m, k // group, group)
    scale = g.abs().amax(dim=-1).clamp(min=_EPS) / FP8_MAX
    q = (g / scale[..., None]).clamp(-FP8_MAX, FP8_MAX).to(FP8).view(m, k)
    return q, scale


def fp8_linear_ref(x: torch.Tensor, q: torch.Tensor, scale: torch.Tensor, bn: int, bk: int,
                   bias: torch.Tensor | None, act_group: int | None, input_scale: torch.Tensor | None = None,
                   ) -> torch.Tensor:
    """The dequantising reference: x [M, K] times the fp8 weight; activations quantised first unless act_group
    is None (W8A16). Computed in float32, returned in x's dtype."""
    w = dequantize_blocks(q, scale, bn, bk)
    xf = x.float()
    if input_scale is not None:  # static per-tensor activation scale
        s = input_scale.float()
        xf = (xf / s).clamp(-FP8_MAX, FP8_MAX).to(FP8).float() * s
    elif act_group is not None:
        xq, xs = quantize_groups_ref(xf, act_group)
        xf = (xq.float().view(x.shape[0], -1, act_group) * xs[..., None]).view(x.shape)
    out = xf @ w.t()
    if bias is not None:
        out = out + bias.float()
    return out.to(x.dtype)


# ---------------------------------------------------------------- config
class Fp8Config(QuantizationConfig):
    """fp8 weights. `activation_scheme`: "dynamic" (scales computed per token, W8A8 above SMALL_M rows), "static"
    (the checkpoint's per-tensor `input_scale`) or "none" (weight-only: activations stay 16-bit, W8A16).
    `weight_strategy` says how a serialized checkpoint stores the weight scales: "tensor" (one per matrix, the
    default), "channel" ([N, 1]) or "block" (given by `weight_block_size`; the tensor named `block_scale_name`)."""

    name = "fp8"
    ACTIVATION_SCHEMES = ("dynamic", "static", "none")
    WEIGHT_STRATEGIES = ("tensor", "channel", "block")

    def __init__(self, serialized: bool, activation_scheme: str = "dynamic",
                 weight_block_size: list[int] | None = None, ignored_layers: list[str] | None = None,
                 weight_strategy: str | None = None, block_scale_name: str = "weight_scale_inv") -> None:
        if activation_scheme not in self.ACTIVATION_SCHEMES:
            raise ValueError(f"fp8 activation_scheme must be one of {', '.join(self.ACTIVATION_SCHEMES)}, got "
                             f"{activation_scheme!r}")
        if not serialized and activation_scheme == "static":
            raise ValueError("a static fp8 activation scheme needs the checkpoint's input scales")
        strategy = weight_strategy or ("block" if weight_block_size is not None else "tensor")
        if strategy not in self.WEIGHT_STRATEGIES:
            raise ValueError(f"fp8 weight strategy must be one of {', '.join(self.WEIGHT_STRATEGIES)}, got "
                             f"{strategy!r}")
        if (strategy == "block") != (weight_block_size is not None):
            raise ValueError(f"fp8 weight strategy {strategy!r} with weight_block_size {weight_block_size}: a block "
                             f"size goes with the block strategy only")
        if weight_block_size is not None:
            if len(weight_block_size) != 2 or any(int(b) < 16 or int(b) & (int(b) - 1) for b in weight_block_size):
                raise ValueError(f"fp8 weight_block_size must be two powers of two >= 16, got {weight_block_size}")
            if activation_scheme == "static":
                raise ValueError("block-wise fp8 supports only dynamic or 16-bit activations")
        self.serialized = serialized
        self.activation_scheme = activation_scheme
        self.weight_block_size = [int(b) for b in weight_block_size] if weight_block_size else None
        self.ignored_layers = list(ignored_layers or [])
        self.weight_strategy = strategy
        self.block_scale_name = block_scale_name

    @property
    def weight_only(self) -> bool:
        return self.activation_scheme == "none"

    @classmethod
    def from_config(cls, config: dict[str, Any], *, serialized: bool) -> Fp8Config:
        ignored = config.get("ignored_layers") or config.get("modules_to_not_convert") or []
        return cls(serialized=serialized and "fp8" in str(config.get("quant_method", "fp8")),
                   activation_scheme=config.get("activation_scheme", "dynamic"),
                   weight_block_size=config.get("weight_block_size"), ignored_layers=ignored)

    def matrix_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        """For a layer the model reads as a matrix (MLA's kv_b_proj): in an fp8 checkpoint, load it as stored and
        dequantise it once (`Fp8DequantizedMethod`); else None (it stays in the model dtype)."""
        from radixserve.layers.linear import _LinearBase

        if not self.serialized or not isinstance(layer, _LinearBase) or is_ignored(prefix, self.ignored_layers):
            return None
        return Fp8DequantizedMethod(self)

    def get_quant_method(self, layer: nn.Module, prefix: str) -> QuantizeMethodBase | None:
        from radixserve.layers.linear import _LinearBase
        from radixserve.layers.moe.layer import FusedMoE

        if is_ignored(prefix, self.ignored_layers):
            return None
        if isinstance(layer, _LinearBase):
            return Fp8LinearMethod(self)
        if isinstance(layer, FusedMoE):
            from radixserve.layers.quantization.fp8_moe import Fp8MoEMethod

            return Fp8MoEMethod(self)
        return None


# ---------------------------------------------------------------- linear method
def _on_gpu_kernels(x: torch.Tensor) -> bool:
    from radixserve.layers.triton_ops import use_fused

    return use_fused(x)


class Fp8LinearMethod(LinearMethodBase):
    """The layer ends with `weight` fp8 [N, K] and `weight_scale` float32: [N] (per channel) or
    [ceil(N/bn), ceil(K/bk)] (block-wise, the checkpoint's `weight_scale_inv`); `input_scale` (a scalar) for a
    static activation scheme."""

    def __init__(self, config: Fp8Config) -> None:
        self.config = config
        self.block = config.weight_block_size

    def create_weights(self, layer: _LinearBase) -> None:
        n, k = layer.output_size, layer.input_size
        if not self.config.serialized:  # quantised after loading
            layer.weight = new_param((n, k), layer.params_dtype, {"output_dim": 0, "input_dim": 1})
            return
        layer.weight = new_param((n, k), FP8, {"output_dim": 0, "input_dim": 1})
        strategy = self.config.weight_strategy
        if strategy == "block":
            bn, bk = self.block
            if len(layer.output_sizes) > 1 or layer.tp_size > 1:
                for size in layer.output_sizes:
                    if size % bn:
                        raise ValueError(f"block-wise fp8: output rows {size} of a stacked or sharded layer are not "
                                         f"a multiple of the block {bn}")
            setattr(layer, self.config.block_scale_name,
                    new_param((-(-n // bn), -(-k // bk)), torch.float32,
                              {"output_dim": 0, "input_dim": 1, "output_block": bn, "input_block": bk}, fill=1.0))
            return
        shards = len(layer.output_sizes)
        if strategy == "channel":  # [N, 1], split with the rows
            layer.weight_scale = new_param((n, 1), torch.float32, {"output_dim": 0, "input_dim": None}, fill=1.0)
        else:
            layer.weight_scale = new_param((shards,), torch.float32, {"shard_scalar": True}, fill=1.0)
        if self.config.activation_scheme == "static":
            layer.input_scale = new_param((shards,), torch.float32, {"shard_scalar": True}, fill=1.0)

    def process_weights_after_loading(self, layer: _LinearBase) -> None:
        if not self.config.serialized:
            w = layer.weight.data
            q, scale = quantize_rows(w) if self.block is None else quantize_blocks(w, *self.block)
            layer.weight = nn.Parameter(q, requires_grad=False)
            layer.weight_scale = nn.Parameter(scale, requires_grad=False)
            return
        strategy = self.config.weight_strategy
        if strategy == "block":
            scale = getattr(layer, self.config.block_scale_name).data
            delattr(layer, self.config.block_scale_name)
            layer.weight_scale = nn.Parameter(scale.float().contiguous(), requires_grad=False)
            return
        if strategy == "channel":
            layer.weight_scale = nn.Parameter(layer.weight_scale.data.float().reshape(-1).contiguous(),
                                              requires_grad=False)
        else:
            per_shard = layer.weight_scale.data.float()
            sizes = torch.tensor(layer.output_sizes, device=per_shard.device)
            layer.weight_scale = nn.Parameter(per_shard.repeat_interleave(sizes), requires_grad=False)
        if hasattr(layer, "input_scale"):  # one activation scale for the stacked product: the largest
            layer.input_scale = nn.Parameter(layer.input_scale.data.max().reshape(1), requires_grad=False)

    def _groups(self, layer: _LinearBase) -> tuple[int, int]:
        if self.block is not None:
            return self.block[0], self.block[1]
        return 1, layer.input_size

    def apply(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
        shape = x.shape
        x2 = x.reshape(-1, shape[-1])
        bn, bk = self._groups(layer)
        input_scale = getattr(layer, "input_scale", None)
        small = (x2.shape[0] <= SMALL_M or self.config.weight_only) and input_scale is None
        if _on_gpu_kernels(x2):
            out = self._apply_kernels(layer, x2, bias, bn, bk, small, input_scale)
        else:
            out = fp8_linear_ref(x2, layer.weight, layer.weight_scale, bn, bk, bias, None if small else bk,
                                 input_scale)
        return out.view(*shape[:-1], out.shape[-1])

    def apply_silu_and_mul(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
                           ) -> torch.Tensor | None:
        """silu(gate) * up of a [gate; up] layer from the decode GEMV's epilogue (`fp8_gemv`: per-channel weights
        at most SMALL_M rows, block-wise ones one row, on the GPU); None where that does not apply."""
        x2 = x.reshape(-1, x.shape[-1])
        if not SKINNY or x2.shape[0] > SMALL_M or getattr(layer, "input_scale", None) is not None \
                or not _on_gpu_kernels(x2):
            return None
        from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv

        x2 = x2 if x2.stride(-1) == 1 else x2.contiguous()
        out = fp8_skinny_gemv(x2, layer.weight, layer.weight_scale, x2.dtype, bias, silu_mul=True, block=self.block)
        return None if out is None else out.view(*x.shape[:-1], out.shape[-1])

    def apply_rope(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None,
                   rope: RopeArgs) -> torch.Tensor | None:
        """q/k/v for one row with q and k rotated and k / v stored to `rope.kv` in the elementwise GEMV's epilogue
        (`fp8_gemv_rope`; per-channel scales, on the GPU kernels, where the table's tile for the shape pairs the
        rotary halves); None otherwise (the caller runs the product and the rotary kernel)."""
        if self.block is not None or not SKINNY or getattr(layer, "input_scale", None) is not None \
                or x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1 or not _on_gpu_kernels(x):
            return None
        from radixserve.layers.quantization.fp8_gemv_rope import fp8_qkv_rope

        return fp8_qkv_rope(x, layer.weight, layer.weight_scale, bias, rope)

    def _apply_kernels(self, layer: _LinearBase, x: torch.Tensor, bias: torch.Tensor | None, bn: int, bk: int,
                       small: bool, input_scale: torch.Tensor | None) -> torch.Tensor:
        from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
        from radixserve.layers.quantization.fp8_kernels import (
            fp8_gemm,
            fp8_gemv,
            per_token_group_quant_fp8,
        )

        x = x if x.stride(-1) == 1 else x.contiguous()
        w, ws = layer.weight, layer.weight_scale
        if small:
            ws2 = ws.view(-1, 1) if ws.dim() == 1 else ws
            out = None
            if SKINNY:  # (block-wise: one or two rows, else None)
                out = fp8_skinny_gemv(x, w, ws, x.dtype, bias, block=self.block)
            if out is None and x.shape[0] <= FP8_GEMV_MAX_M:
                out = fp8_gemv(x, w, ws2, bn, bk, x.dtype, bias)
            return out if out is not None else fp8_gemm(x, w, ws2, bn, bk, x.dtype, bias=bias)
        if self.block is None and input_scale is None and x.is_cuda and x.shape[0] <= MID_MAX_M:
            out = _mid_product(x, w, ws, bias)
            if out is not None:
                return out
        if input_scale is not None:
            s = input_scale.float()
            xq = (x.float() / s).clamp(-FP8_MAX, FP8_MAX).to(FP8)
            xs = s.expand(x.shape[0]).reshape(-1, 1).contiguous()
        else:
            xq, xs = per_token_group_quant_fp8(x, bk)
        if self.block is None and x.is_cuda and x.dtype == torch.bfloat16 and _scaled_mm_ok(w.shape[0], w.shape[1]):
            out = torch._scaled_mm(xq, w.t(), scale_a=xs, scale_b=ws.view(1, -1), out_dtype=x.dtype)
            return out if bias is None else out + bias
        return fp8_gemm(xq, w, ws.view(-1, 1) if ws.dim() == 1 else ws, bn, bk, x.dtype, a_scale=xs,
                        a_group_k=bk if self.block is not None else w.shape[1], bias=bias)


class Fp8DequantizedMethod(Fp8LinearMethod):
    """A layer of an fp8 checkpoint that the model reads as a matrix (MLA's kv_b_proj, absorbed into the attention):
    loaded as the checkpoint stores it, then dequantised once to the model dtype, after which it is an unquantized
    layer."""

    def process_weights_after_loading(self, layer: _LinearBase) -> None:
        from radixserve.layers.quantization.base import UnquantizedLinearMethod

        super().process_weights_after_loading(layer)
        bn, bk = self._groups(layer)
        w = dequantize_blocks(layer.weight.data, layer.weight_scale.data, bn, bk).to(layer.params_dtype)
        for name in ("weight_scale", "input_scale"):
            if hasattr(layer, name):
                delattr(layer, name)
        layer._quant_param_names = ["weight"]
        layer.set_quant_method(UnquantizedLinearMethod())
        layer.weight.data.copy_(w)


def _mid_product(x: torch.Tensor, w: torch.Tensor, ws: torch.Tensor, bias: torch.Tensor | None,
                 ) -> torch.Tensor | None:
    """The swept kernel of `fp8_mid` for this batch size and weight shape, or None (no entry, or the entry is
    `torch._scaled_mm`)."""
    from radixserve.layers.quantization import gemv_configs
    from radixserve.layers.quantization.fp8_mid import fp8_mid_mm

    cfg = gemv_configs.get_mid(x.shape[0], w.shape[0], w.shape[1])
    if cfg is None or cfg.kernel == "scaled_mm":
        return None
    return fp8_mid_mm(x, w, ws, x.dtype, cfg, bias)


def _scaled_mm_ok(n: int, k: int) -> bool:
    """torch._scaled_mm (cuBLASLt, row-wise scales, bf16 out) needs both dims of the weight multiples of 16;
    RADIXSERVE_FP8_SCALED_MM=0 sends the product to the Triton kernel instead (for comparisons)."""
    return n % 16 == 0 and k % 16 == 0 and os.environ.get("RADIXSERVE_FP8_SCALED_MM", "1") != "0"

