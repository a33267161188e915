"""Linear layers shaped for tensor parallelism. Each parameter carries a `weight_loader` that narrows the full
(HF-named) tensor to this rank's shard, so TP is a sharding decision made at load time.

What a layer holds and how it multiplies is its `quant_method` (`layers/quantization/`): the unquantized one by
default; `layers.quantization.apply_quantization(model, config)` swaps it (and the parameters) for a quantized one
before the weights load. The loaders below shard any parameter from attributes the method puts on it:
`output_dim` / `input_dim` (the dim split across ranks, None: held whole), `output_block` / `input_block` (how
many rows / columns of the full weight one element of the parameter covers: 1 for weights, 128 for 128x128 block
scales) and `shard_scalar` (one value per stacked matrix: per-tensor scales of q/k/v or gate/up)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_reduce
from radixserve.layers.quantization.base import (
    LinearMethodBase,
    NormedProduct,
    UnquantizedLinearMethod,
    set_weight_attrs,
)
from radixserve.layers.triton_ops import decode_gemv_enabled
from radixserve.model_executor.torch_compile import compiled_linear, register_op_layer

if TYPE_CHECKING:
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs


def _divide(a: int, b: int, what: str) -> int:
    if a % b != 0:
        raise ValueError(f"{what} ({a}) is not divisible by the tensor parallel size ({b})")
    return a // b


def _blocks(n: int, block: int, what: str) -> int:
    if n % block:
        raise ValueError(f"{what} ({n}) is not a multiple of the quantization block ({block}); this layout cannot "
                         f"be sharded or stacked block-wise")
    return n // block


class _LinearBase(nn.Module):
    def __init__(self, in_features: int, out_features: int, bias: bool, tp_rank: int, tp_size: int,
                 output_sizes: list[int] | None = None) -> None:
        super().__init__()
        self.tp_rank, self.tp_size = tp_rank, tp_size
        self.input_size = in_features  # this rank's partition
        self.output_size = out_features
        # this rank's rows of each stacked matrix (q/k/v, gate/up), in order
        self.output_sizes = list(output_sizes) if output_sizes is not None else [out_features]
        self.params_dtype = torch.get_default_dtype()
        self.set_quant_method(UnquantizedLinearMethod())
        if bias:
            self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)
            set_weight_attrs(self.bias, {"output_dim": 0, "weight_loader": self.weight_loader})
        else:
            self.register_parameter("bias", None)
        # LoRA: a callable x -> the base output plus the batch's adapter deltas, set by radixserve.lora on the layers
        # that carry adapters (it runs the base multiply itself: it may fold the adapters' shrink into it)
        self.lora = None
        # one-row products through the one-row GEMV (`triton_ops.gemv`, whatever the table says) instead of cuBLAS
        # (set by the models whose small attention projections cuBLAS splits over K at batch 1: the MoE / MLA
        # families)
        self.decode_gemv = False
        self.compile_key = register_op_layer(self)  # how a compiled graph's quantized-linear op finds this layer

    def set_quant_method(self, method: LinearMethodBase) -> None:
        """Replace how this layer stores its weight and multiplies (before the weights load)."""
        old = getattr(self, "weight", None)
        device = old.device if isinstance(old, torch.Tensor) else torch.empty(0).device  # the ambient device
        for name in getattr(self, "_quant_param_names", ()):
            delattr(self, name)
        self.quant_method = method
        # the unquantized method on a GPU is F.linear itself: forward calls it directly (no method dispatch, no CPU
        # check) while no LoRA hook is set; eager decode of large batches is host-bound, 4-7 of these per layer
        self._plain = type(method) is UnquantizedLinearMethod
        before = {n for n, _ in self.named_parameters(recurse=False)}
        with torch.device(device):
            method.create_weights(self)
        self._quant_param_names = [n for n, _ in self.named_parameters(recurse=False) if n not in before]
        for name in self._quant_param_names:
            param = getattr(self, name)
            if not hasattr(param, "weight_loader"):
                param.weight_loader = self.weight_loader

    @staticmethod
    def _copy(param: torch.Tensor, loaded: torch.Tensor, name: str = "") -> None:
        if param.shape != loaded.shape:
            raise ValueError(f"weight shape mismatch{(' for ' + name) if name else ''}: expected {tuple(param.shape)},"
                             f" got {tuple(loaded.shape)}")
        param.data.copy_(loaded)

    def _shard_index(self, shard_id: str | int | None) -> int:
        return 0

    def _output_shard(self, shard_id: str | int | None) -> tuple[int, int, int]:
        """(row offset in this rank's parameter, rows, row offset in the loaded tensor) of one stacked matrix."""
        return 0, self.output_size, 0

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if getattr(param, "shard_scalar", False):
            idx = self._shard_index(shard_id)
            if loaded.numel() != 1:
                raise ValueError(f"expected a per-tensor scale (one value), got shape {tuple(loaded.shape)}")
            param.data[idx] = loaded.reshape(()).to(param.dtype)
            return
        dim = getattr(param, "output_dim", 0)  # a bare tensor (tests) is loaded like the weight
        if dim is None:
            self._copy(param, loaded)
            return
        dst_off, n, src_off = self._output_shard(shard_id)
        block = getattr(param, "output_block", 1)
        if block > 1:
            if (n, dst_off, src_off) == (self.output_size, 0, 0):  # the whole matrix: a partial last block is fine
                n = param.shape[dim]
            else:
                n, dst_off, src_off = (_blocks(v, block, "output rows") for v in (n, dst_off, src_off))
        if loaded.dim() != param.dim() or loaded.shape[dim] < src_off + n:
            raise ValueError(f"weight shape mismatch: a tensor of shape {tuple(loaded.shape)} has no rows "
                             f"{src_off}..{src_off + n} for a parameter of shape {tuple(param.shape)}")
        self._copy(param.data.narrow(dim, dst_off, n), loaded.narrow(dim, src_off, n))

    def _row_gemv(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor | None:
        """One activation row on a 16-bit CUDA weight: the Triton GEMV (`triton_ops/gemv`) where the swept table
        says it beats cuBLAS for this shape; None otherwise. Looked up once per layer (the weight's shape and
        device are fixed once loaded)."""
        if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1 or torch.compiler.is_compiling():
            return None  # (under torch.compile inductor generates the product)
        cache = self.__dict__.setdefault("_gemv_cfg", {})
        if silu_mul not in cache:
            from radixserve.layers.triton_ops.gemv import gemv_config

            cache[silu_mul] = gemv_config(self.weight, silu_mul)
        cfg = cache[silu_mul]
        if cfg is None:
            return None
        from radixserve.layers.triton_ops.gemv import gemv_row

        return gemv_row(x, self.weight, self.bias, cfg, silu_mul=silu_mul)

    def _mid_gemm(self, x: torch.Tensor, silu_mul: bool = False) -> torch.Tensor | None:
        """17..256 activation rows on a 16-bit CUDA weight: the Triton product (`triton_ops/gemm_mid`; with
        `silu_mul`, of a stacked [gate; up] with the activation in its epilogue) where the swept table says it beats
        cuBLAS for this shape at this many rows; None otherwise (looked up once per row count and layer)."""
        from radixserve.layers.triton_ops import gemm_mid

        m = x.shape[0]
        if not gemm_mid.MIN_M <= m <= gemm_mid.MAX_M or x.dim() != 2 or x.stride(-1) != 1 \
                or x.dtype != self.weight.dtype or torch.compiler.is_compiling():
            return None
        cache = self.__dict__.setdefault("_mid_cfg", {})
        if (m, silu_mul) not in cache:
            cache[m, silu_mul] = gemm_mid.mid_config(self.weight, m, silu_mul)
        cfg = cache[m, silu_mul]
        return None if cfg is None else gemm_mid.mid_mm(x, self.weight, self.bias, cfg, silu_mul=silu_mul)

    def _plain_cuda(self, x: torch.Tensor) -> torch.Tensor:
        out = self._row_gemv(x) if x.shape[0] == 1 else self._mid_gemm(x)
        return F.linear(x, self.weight, self.bias) if out is None else out

    def gemv_ok(self, x: torch.Tensor) -> bool:
        """Whether `x` goes through the one-row GEMV kernel as a layer that opted in (see `decode_gemv`)."""
        return self.decode_gemv and self._plain and self.lora is None and x.shape[0] == 1 and x.dim() == 2 \
            and x.stride(-1) == 1 and x.dtype == self.weight.dtype and decode_gemv_enabled(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:
            return self.lora(x)
        if self.decode_gemv and self.gemv_ok(x):
            from radixserve.layers.triton_ops.gemv import gemv_row_norm

            return gemv_row_norm(x, self.weight, self.bias)[0]
        if self._plain and x.is_cuda:
            return self._plain_cuda(x)
        return self._quant_product(x)

    def normed_product(self, x: torch.Tensor, residual: torch.Tensor | None, norm: nn.Module,
                       rope: RopeArgs | None = None) -> NormedProduct | None:
        """This layer applied to norm(x + residual), with x + residual, where the quantization method folds the
        residual add and the RMSNorm `norm` into the launch before its product (Q4_K at one row:
        `GGUFLinearMethod.apply_normed`; with `rope`, q/k/v's rotation and KV store too where it can, saying so in
        `rotated`); None otherwise (the caller runs the norm)."""
        if not self.folds_norm:
            return None
        return self.quant_method.apply_normed(self, x, residual, norm.weight, norm.eps, self.bias, rope)

    @property
    def folds_norm(self) -> bool:
        """Whether this layer's quantization method can take the norm before it into its launch (`normed_product`;
        whether it does for a given x is its own call)."""
        return self.lora is None and hasattr(self.quant_method, "apply_normed")

    def _quant_product(self, x: torch.Tensor) -> torch.Tensor:
        """The quantization method's product; inside torch.compile a quantized layer is one opaque op that runs
        the method's own kernels (model_executor/torch_compile.py)."""
        if not self._plain and torch.compiler.is_compiling():
            return compiled_linear(x, self)
        return self.quant_method.apply(self, x, self.bias)


class ReplicatedLinear(_LinearBase):
    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__(in_features, out_features, bias, tp_rank, tp_size)


class ColumnParallelLinear(_LinearBase):
    """Output dimension split across ranks; no communication."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, output_sizes: list[int] | None = None) -> None:
        super().__init__(in_features, _divide(out_features, tp_size, "output size"), bias, tp_rank, tp_size,
                         output_sizes)

    def _output_shard(self, shard_id: str | int | None) -> tuple[int, int, int]:
        n = self.output_size
        return 0, n, self.tp_rank * n


class MergedColumnParallelLinear(ColumnParallelLinear):
    """Several column-parallel matrices stacked (gate_proj and up_proj); shard_id is the index in `sizes`."""

    def __init__(self, in_features: int, sizes: list[int], bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        self.shard_sizes = [_divide(s, tp_size, "output size") for s in sizes]
        super().__init__(in_features, sum(sizes), bias, tp_rank, tp_size, self.shard_sizes)

    def _shard_index(self, shard_id: str | int | None) -> int:
        if not isinstance(shard_id, int) or not 0 <= shard_id < len(self.shard_sizes):
            raise ValueError(f"MergedColumnParallelLinear needs an integer shard id, got {shard_id!r}")
        return shard_id

    def _output_shard(self, shard_id: str | int | None) -> tuple[int, int, int]:
        i = self._shard_index(shard_id)
        n = self.shard_sizes[i]
        return sum(self.shard_sizes[:i]), n, self.tp_rank * n

    def silu_and_mul(self, x: torch.Tensor) -> torch.Tensor | None:
        """silu(gate) * up of this [gate; up] layer computed in its product's epilogue, when its quantization
        method offers that for `x` (fp8 decode GEMVs) or, unquantized, the one-row Triton GEMV or the 17..256-row
        product has a table entry for the shape; with adapters, in the LoRA expand at one row (the hook decides);
        None otherwise (the caller applies SiluAndMul)."""
        if len(self.shard_sizes) != 2 or self.shard_sizes[0] != self.shard_sizes[1]:
            return None
        if self.lora is not None:  # with adapters: their expand and the activation in one kernel, at one row
            return self.lora.silu_and_mul(x)
        if self._plain and x.is_cuda:  # 16-bit: the one-row GEMV / 17..256-row product where the table picks it
            return self._row_gemv(x, silu_mul=True) if x.shape[0] == 1 else self._mid_gemm(x, silu_mul=True)
        fused = getattr(self.quant_method, "apply_silu_and_mul", None)
        return None if fused is None else fused(self, x, self.bias)


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
        q, kv = self.num_heads * head_dim, self.num_kv_heads * head_dim
        super().__init__(hidden_size, (q + 2 * kv) * tp_size, bias, tp_rank, tp_size, [q, kv, kv])

    def _shard_index(self, shard_id: str | int | None) -> int:
        if shard_id not in ("q", "k", "v"):
            raise ValueError(f"QKVParallelLinear shard id must be 'q', 'k' or 'v', got {shard_id!r}")
        return ("q", "k", "v").index(shard_id)

    def _output_shard(self, shard_id: str | int | None) -> tuple[int, int, int]:
        q, kv = self.num_heads * self.head_dim, self.num_kv_heads * self.head_dim
        if self._shard_index(shard_id) == 0:
            return 0, q, self.tp_rank * q
        kv_rank = self.tp_rank // self.kv_replicas
        return (q if shard_id == "k" else q + kv), kv, kv_rank * kv


class RowParallelLinear(_LinearBase):
    """Input dimension split across ranks; the partial outputs are summed with an all-reduce."""

    def __init__(self, in_features: int, out_features: int, bias: bool = False, tp_rank: int = 0,
                 tp_size: int = 1, reduce_results: bool = True) -> None:
        super().__init__(_divide(in_features, tp_size, "input size"), out_features, bias, tp_rank, tp_size)
        self.reduce_results = reduce_results

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if param.dim() == 1 and not getattr(param, "shard_scalar", False):  # the bias: added once, on rank 0
            self._copy(param, loaded if self.tp_rank == 0 else torch.zeros_like(loaded))
            return
        dim = getattr(param, "input_dim", 1)
        if dim is None or getattr(param, "shard_scalar", False):
            super().weight_loader(param, loaded, shard_id)
            return
        block = getattr(param, "input_block", 1)
        n = param.shape[dim]
        if block > 1 and self.tp_size > 1:
            _blocks(self.input_size, block, "input columns")
        self._copy(param, loaded.narrow(dim, self.tp_rank * n, n))

    def gated_product(self, x: torch.Tensor) -> torch.Tensor | None:
        """This layer applied to silu(gate) * up of x = [gate | up] where the quantization method folds the
        activation into the launch before its product (Q4_K at one row: `GGUFLinearMethod.apply_gated`); None
        otherwise (the caller applies SiluAndMul)."""
        fused = getattr(self.quant_method, "apply_gated", None)
        out = None if fused is None or self.lora is not None else fused(self, x, self.bias)
        if out is not None and self.tp_size > 1 and self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.lora is not None:  # a partial sum on each rank, like the base output: reduced with it
            out = self.lora(x)
        elif self.decode_gemv and self.gemv_ok(x):
            from radixserve.layers.triton_ops.gemv import gemv_row_norm

            out = gemv_row_norm(x, self.weight, self.bias)[0]
        elif self._plain and x.is_cuda:
            out = self._plain_cuda(x)
        else:
            out = self._quant_product(x)
        if self.tp_size > 1 and self.reduce_results:
            out = tensor_model_parallel_all_reduce(out)
        return out
