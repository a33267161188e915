"""--enable-torch-compile: the decode forward of batches up to --torch-compile-max-bs compiled with torch.compile
(inductor) and then captured in the CUDA graphs (`CudaGraphRunner`).

Inside a compiled region the layers run their plain torch code (`use_fused` and the CPU kernels step aside while
`torch.compiler.is_compiling()`), so inductor generates and fuses the elementwise work itself (residual add with
RMSNorm, SiLU·mul, rotary). The attention backend is one opaque custom op, `radixserve::attention`: the traced graph
holds tensors only (no ForwardBatch, no backend metadata), and the op's implementation finds the batch in the
forward context the runner sets around the call (`forward_context`) and the layer in a registry keyed by
`RadixAttention.compile_key`. A quantized linear layer (fp8, GGUF) is likewise one opaque op,
`radixserve::quantized_linear`: its method's own kernels run inside it (traced, the product would be the method's
dequantising torch reference), and so are a MoE layer's experts, `radixserve::moe_experts`: the fused Triton kernels
run inside it (the torch reference sizes tensors by the routing, which cannot be traced into one graph). The shared
experts are then computed by the model's own MLP, never folded into the experts' launch. The whole model traces
without a graph break (`fullgraph=True` in the tests).

Batch 1 stays uncompiled when the model's one-row products go through our one-row GEMV (`triton_ops/gemv.py`):
the compiled code cannot use it (inductor generates the products), and on the 8B shape the uncompiled batch-1 graph
measured faster (215 against 197 tok/s), while batches 8-160 went from -1% to +6% with the compile.
`compiled_batch_sizes` decides; with the one-row GEMV off (RADIXSERVE_GEMV_ROW=0 for the dense layers,
RADIXSERVE_DISABLE_DECODE_GEMV=1 for the layers that opt in) batch 1 is compiled with the rest.

Compiled artefacts are cached on disk under TORCHINDUCTOR_CACHE_DIR, which defaults here to
`<radixserve cache root>/torch_compile`, so a second start with the same shapes mostly loads instead of compiling."""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import weakref
from collections.abc import Callable, Iterator
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch

logger = logging.getLogger(__name__)

_keys = itertools.count()
_layers: weakref.WeakValueDictionary[int, RadixAttention] = weakref.WeakValueDictionary()
_op_layers: weakref.WeakValueDictionary[int, torch.nn.Module] = weakref.WeakValueDictionary()
_batches: list[ForwardBatch] = []


def register_attention_layer(layer: RadixAttention) -> int:
    """A process-unique key for `layer` (the custom op carries it as a constant)."""
    key = next(_keys)
    _layers[key] = layer
    return key


@contextlib.contextmanager
def forward_context(forward_batch: ForwardBatch) -> Iterator[None]:
    """The batch the attention op runs on while a compiled forward is called (traced, run, or captured)."""
    _batches.append(forward_batch)
    try:
        yield
    finally:
        _batches.pop()


@torch.library.custom_op("radixserve::attention", mutates_args=())
def attention_op(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_key: int, out_dim: int,
                 save_kv_cache: bool) -> torch.Tensor:
    """RadixAttention of one layer over the current forward batch: [T, out_dim]. Writes the batch's K/V into the
    pool when `save_kv_cache` (a side effect on state outside the graph, ordered by the data dependence of the
    layers)."""
    if not _batches:
        raise RuntimeError("radixserve::attention called outside forward_context()")
    forward_batch = _batches[-1]
    layer = _layers[layer_key]
    out = forward_batch.attn_backend.forward(q, k, v, layer, forward_batch, save_kv_cache)
    if out.data_ptr() in (q.data_ptr(), k.data_ptr(), v.data_ptr()):
        out = out.clone()  # a custom op's output may not alias its inputs
    return out


@attention_op.register_fake
def _(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer_key: int, out_dim: int,
      save_kv_cache: bool) -> torch.Tensor:
    return q.new_empty((q.shape[0], out_dim))


def compiled_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       save_kv_cache: bool) -> torch.Tensor:
    return attention_op(q, k, v, layer.compile_key, layer.tp_q_head_num * layer.v_head_dim, save_kv_cache)


def register_op_layer(layer: torch.nn.Module) -> int:
    """A process-unique key for a linear or MoE layer (the quantized-linear and experts ops carry it as a
    constant)."""
    key = next(_keys)
    _op_layers[key] = layer
    return key


@torch.library.custom_op("radixserve::quantized_linear", mutates_args=())
def quantized_linear_op(x: torch.Tensor, layer_key: int, out_features: int) -> torch.Tensor:
    """x through the quantized linear layer `layer_key` with its method's own kernels: [..., out_features]."""
    layer = _op_layers[layer_key]
    out = layer.quant_method.apply(layer, x, layer.bias)
    return out.clone() if out.data_ptr() == x.data_ptr() else out  # a custom op's output may not alias its input


@quantized_linear_op.register_fake
def _(x: torch.Tensor, layer_key: int, out_features: int) -> torch.Tensor:
    return x.new_empty((*x.shape[:-1], out_features))


def compiled_linear(x: torch.Tensor, layer: torch.nn.Module) -> torch.Tensor:
    return quantized_linear_op(x, layer.compile_key, layer.output_size)


@torch.library.custom_op("radixserve::moe_experts", mutates_args=())
def moe_experts_op(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_key: int
                   ) -> torch.Tensor:
    """The routed experts of the MoE layer `layer_key` for x [T, H]: [T, H], without the attached shared experts
    (the traced model added those itself) and before any TP reduction."""
    layer = _op_layers[layer_key]
    with layer.shared_fold_off():
        out = layer.quant_method.apply(layer, x, topk_weights, topk_ids)
    return out.clone() if out.data_ptr() == x.data_ptr() else out


@moe_experts_op.register_fake
def _(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer_key: int) -> torch.Tensor:
    return x.new_empty(x.shape)


def compiled_experts(x: torch.Tensor, topk_weights: torch.Tensor, topk_ids: torch.Tensor, layer: torch.nn.Module
                     ) -> torch.Tensor:
    return moe_experts_op(x, topk_weights, topk_ids, layer.compile_key)


def uses_one_row_gemv(model: torch.nn.Module) -> bool:
    """Whether a one-row (batch-1) forward of `model` runs a linear layer through the one-row GEMV kernel: a layer
    that opted in (`decode_gemv`, the MoE / MLA attention projections) or a plain 16-bit CUDA weight whose shape
    has an entry in the swept table (`gemv_config`, or the q/k/v + rotary kernel's `rope_entry`)."""
    from radixserve.layers.linear import _LinearBase
    from radixserve.layers.triton_ops import decode_gemv_enabled
    from radixserve.layers.triton_ops.gemv import gemv_config
    from radixserve.layers.triton_ops.gemv_rope import rope_entry

    for m in model.modules():
        if not isinstance(m, _LinearBase) or m.lora is not None or not m._plain:
            continue
        w = m.weight
        if m.decode_gemv and w.is_cuda and decode_gemv_enabled(w):
            return True
        if gemv_config(w) is not None or gemv_config(w, silu_mul=True) is not None or rope_entry(w) is not None:
            return True
    return False


def compiled_batch_sizes(capture_bs: list[int], max_bs: int, model: torch.nn.Module) -> set[int]:
    """The captured decode batch sizes to compile: those up to `max_bs`, less batch 1 where the model's one-row
    products run the one-row GEMV (faster than inductor's code there; see the module's docstring)."""
    sizes = {bs for bs in capture_bs if bs <= max_bs}
    if 1 in sizes and uses_one_row_gemv(model):
        sizes.discard(1)
        logger.info("torch.compile: batch 1 stays uncompiled (its products run the one-row GEMV kernel)")
    return sizes


def set_cache_dir() -> str:
    """TORCHINDUCTOR_CACHE_DIR: the user's own setting, else <radixserve cache root>/torch_compile."""
    path = os.environ.get("TORCHINDUCTOR_CACHE_DIR")
    if not path:
        from radixserve.model_loader.embedded import cache_root

        path = os.path.join(cache_root(), "torch_compile")
        os.environ["TORCHINDUCTOR_CACHE_DIR"] = path
    os.makedirs(path, exist_ok=True)
    return path


def compile_forward(forward: Callable[..., Any], backend: str = "inductor", fullgraph: bool = True
                    ) -> Callable[..., Any]:
    """torch.compile of a model's forward(input_ids, positions, forward_batch); call it inside forward_context.
    Shapes are left to dynamo's automatic dynamic: the first batch size compiles a static graph, the second one a
    graph with a symbolic batch size that serves the rest."""
    import torch._dynamo

    cache = set_cache_dir()
    torch._dynamo.config.cache_size_limit = max(torch._dynamo.config.cache_size_limit, 64)
    torch._dynamo.config.accumulated_cache_size_limit = max(torch._dynamo.config.accumulated_cache_size_limit, 256)
    logger.info("torch.compile (%s) of the decode forward; cache %s", backend, cache)
    return torch.compile(forward, backend=backend, fullgraph=fullgraph)
