"""--quantize-lm-head: the LM head in fp8 (e4m3, one float32 scale per vocabulary row) for a model served with fp8
weights.

Published fp8 checkpoints and `--quantization fp8` leave the LM head in 16 bits, as other engines do: its rows are
few next to the layers' but it is the largest single matrix (Llama-3.1-8B: 128,256 x 4,096, 1.05 GB in bf16, an
eighth of the bytes an fp8 decode step reads). Quantised, a batch-1 step reads 0.5 GB less; the logits move by
the rounding of each weight to 3 mantissa bits (the test bounds it on the embedded model's perplexity).

`quantize_lm_head(model)` replaces the head's weight by its fp8 rows (`weight`, `weight_scale`); a head tied to the
input embedding gets a head of its own (the embedding keeps its 16-bit rows for the lookups). `fp8_head_logits`
is the product the LogitsProcessor runs for such a head, float32 logits:
- up to 16 rows on the GPU: the fp8 decode GEMV (`fp8_gemv.fp8_skinny_gemv`, W8A16, float32 out, into the decode
  graphs' shared logits rows where they are set);
- more rows: the rows quantised per token and `torch._scaled_mm` (W8A8, bf16 out, widened by the caller);
- elsewhere (the CPU, or traced by torch.compile outside the custom op below): the dequantising reference."""

from __future__ import annotations

import logging

import torch
from torch import nn

from radixserve.layers.quantization.fp8 import FP8, Fp8LinearMethod, quantize_rows

logger = logging.getLogger(__name__)


def quantize_lm_head(model: nn.Module) -> None:
    """Quantise `model.lm_head` to fp8 rows in place (a tied head: a new ParallelLMHead holding the fp8 copy).
    Raises ValueError when the model has no LM head or its linear layers are not fp8."""
    from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    head = getattr(model, "lm_head", None)
    if not isinstance(head, VocabParallelEmbedding):
        raise ValueError(f"--quantize-lm-head: {type(model).__name__} has no LM head to quantize")
    if not any(isinstance(getattr(m, "quant_method", None), Fp8LinearMethod) for m in model.modules()):
        raise ValueError("--quantize-lm-head needs fp8 weights (--quantization fp8, or an fp8 checkpoint)")
    if head.weight.dtype == FP8:
        return
    q, scale = quantize_rows(head.weight.data)
    if not isinstance(head, ParallelLMHead):  # tied to the embedding, which keeps its 16-bit rows for lookups
        with torch.device("meta"):
            own = ParallelLMHead(head.num_embeddings, head.weight.shape[1], head.tp_rank, head.tp_size)
        norm = getattr(getattr(model, "model", None), "norm", None)
        if getattr(norm, "_next", None) == [head]:  # the final norm's prefetch (fused all-reduce) follows the head
            norm.prefetch_next(own)
        model.lm_head = own
        head = own
    head.weight = nn.Parameter(q, requires_grad=False)
    head.weight_scale = nn.Parameter(scale, requires_grad=False)
    logger.info("LM head quantized to fp8: %d x %d rows, %.2f GB", q.shape[0], q.shape[1], q.numel() / 1e9)


def fp8_head_logits(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                    out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [M, K] times the fp8 head (weight [N, K], scale [N]): [M, N] logits, float32 (bf16 from the W8A8
    product above 16 rows on the GPU: the caller widens them). `out` (float32 [M, N], rows contiguous): where the
    one-row-to-16-row GEMV writes (else it allocates)."""
    from radixserve.layers.triton_ops import use_fused

    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1]:
        raise ValueError(f"fp8 LM head: hidden {tuple(hidden.shape)} does not match the head {tuple(weight.shape)}")
    if torch.compiler.is_compiling():
        return fp8_head_op(hidden, weight, scale)
    if not use_fused(hidden):
        return _reference(hidden, weight, scale)
    from radixserve.layers.quantization.fp8_gemv import MAX_M, fp8_skinny_gemv

    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    if x.shape[0] <= MAX_M:
        logits = fp8_skinny_gemv(x, weight, scale, torch.float32, out=out)
        if logits is not None:
            return logits
    from radixserve.layers.quantization.fp8 import _scaled_mm_ok
    from radixserve.layers.quantization.fp8_kernels import fp8_gemm, per_token_group_quant_fp8

    xq, xs = per_token_group_quant_fp8(x, weight.shape[1])
    if x.is_cuda and x.dtype == torch.bfloat16 and _scaled_mm_ok(weight.shape[0], weight.shape[1]):
        return torch._scaled_mm(xq, weight.t(), scale_a=xs, scale_b=scale.view(1, -1), out_dtype=torch.bfloat16)
    return fp8_gemm(xq, weight, scale.view(-1, 1), 1, weight.shape[1], torch.float32, a_scale=xs,
                    a_group_k=weight.shape[1])


def _reference(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The dequantising product in float32 (W8A16: the activations are not quantised)."""
    return torch.mm(hidden.float(), weight.float().t()) * scale.float()


@torch.library.custom_op("radixserve::fp8_lm_head", mutates_args=())
def fp8_head_op(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The fp8 head's product as one opaque op inside a torch.compile'd forward (traced, it would be the
    reference, which widens the whole head every step): float32 [M, N]."""
    return fp8_head_logits(hidden, weight, scale).float()


@fp8_head_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)
