"""--quantize-lm-head: the LM head as int8 rows with one float32 scale each (symmetric, |max| / 127), multiplied in
16 bits (W8A16: the activations are not quantised).

Quantized checkpoints and `--quantization` leave the LM head in 16 bits, as other engines do, yet it is the largest
single matrix a decode step reads (Llama-3.1-8B: 128,256 x 4,096, 1.05 GB in bf16; an eighth of an fp8 model's
step). In int8 a batch-1 step reads 0.5 GB less. Int8 rather than fp8: the same bytes, but a row's values keep 7
bits against e4m3's 3 of mantissa; on the embedded SmolLM2 the head alone moved the perplexity +0.6% in int8 and
+1.8% in fp8 rows (the test bounds it; `benchmarks/bench_quality.py` prints it).

`quantize_lm_head(model)` replaces the head's weight by its int8 rows (`weight`, `weight_scale`); a head tied to the
input embedding gets a head of its own (the embedding keeps its 16-bit rows for the lookups). `int8_head_logits` is
the product the LogitsProcessor runs for such a head, float32 logits:
- up to 16 rows on the GPU: the decode GEMV of the fp8 layers (`fp8_gemv.fp8_skinny_gemv`, which widens int8 by
  conversion), written into the decode graphs' shared logits rows where they are set;
- 17..256 rows where the swept table has an "int8_mid" "w8a16" entry: the W8A16 kernel of `fp8_mid` (tensor cores,
  the weight's rows on the MMA's long side, so the vocabulary's rows spread over every SM);
- otherwise (no entry, or a "gemm" one where the sweep found this fastest): the Triton W8A16 GEMM of the fp8 layers
  (`fp8_kernels.fp8_gemm`, tensor cores, the int8 tile widened to the activation dtype);
- on the CPU: torch's int8 weight-only product (`torch._weight_int8pack_mm`) for one row, or up to 32 rows in 16 bits,
  else the head widened to the activations' dtype each call. Only bf16 decodes of up to 8 rows match or beat the
  plain head there (1.07-1.15x on SmolLM2's); larger batches and float32 lose to it (up to 5x): the flag is for the
  GPU, and `quantize_lm_head` says so in the log when the model is on the CPU.
- inside torch.compile: one opaque custom op around the above."""

from __future__ import annotations

import logging

import torch
from torch import nn

logger = logging.getLogger(__name__)

_EPS = 1e-10
# On the CPU torch's int8 weight-only kernel beats widening the head up to this many 16-bit rows, and only at one
# float32 row (SmolLM2's head, 2 cores: bf16 2.9 / 8.5 / 36.2 ms at 1 / 8 / 32 rows against 32-35 ms widened; float32
# 29.7 ms at 1 row, 216 at 8 against 64 widened). Against the plain head (`benchmarks/bench_lm_head.py --device cpu
# --vocab 49152 --hidden 576 --rows 1 8 32`): bf16 1.33 / 5.86 / 27.0 ms against 1.53 / 6.30 / 7.13; float32 slower
# at every size.
CPU_INT8PACK_MAX_M = 32


def quantize_rows_int8(w: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """w [N, K] -> (int8 [N, K], float32 scales [N]): w ~= q * scale, scale = |max of the row| / 127."""
    scale = w.float().abs().amax(dim=1).clamp(min=_EPS) / 127.0
    q = torch.round(w.float() / scale[:, None]).clamp(-127, 127).to(torch.int8)
    return q, scale


def quantize_lm_head(model: nn.Module) -> None:
    """Quantise `model.lm_head` to int8 rows in place (a tied head: a new ParallelLMHead holding the int8 copy).
    Raises ValueError when the model has no LM head."""
    from radixserve.layers.vocab_parallel_embedding import ParallelLMHead, VocabParallelEmbedding

    head = getattr(model, "lm_head", None)
    if not isinstance(head, VocabParallelEmbedding):
        raise ValueError(f"--quantize-lm-head: {type(model).__name__} has no LM head to quantize")
    if head.weight.dtype == torch.int8:
        return
    q, scale = quantize_rows_int8(head.weight.data)
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
    logger.info("LM head quantized to int8 rows: %d x %d, %.2f GB", q.shape[0], q.shape[1], q.numel() / 1e9)
    if q.device.type == "cpu":
        logger.warning("--quantize-lm-head on the CPU saves memory, but only bf16 decodes of a few rows are as fast "
                       "as the plain head; larger batches and float32 are slower (the int8 rows widened each call)")


def int8_head_logits(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor,
                     out: torch.Tensor | None = None) -> torch.Tensor:
    """hidden [M, K] times the int8 head (weight [N, K], scale [N]): float32 logits [M, N]. `out` (float32
    [M, N], rows contiguous): where the decode GEMV writes them (else, and on the other paths, a new tensor)."""
    from radixserve.layers.triton_ops import use_fused

    if hidden.dim() != 2 or hidden.shape[1] != weight.shape[1] or weight.dtype != torch.int8:
        raise ValueError(f"int8 LM head: hidden {tuple(hidden.shape)} does not match the head {weight.dtype} "
                         f"{tuple(weight.shape)}")
    if torch.compiler.is_compiling():
        return int8_head_op(hidden, weight, scale)
    if not use_fused(hidden) or hidden.shape[1] % 16:  # (the GPU kernels take K in steps of 16)
        m, half = hidden.shape[0], hidden.dtype in (torch.bfloat16, torch.float16)
        if hidden.device.type == "cpu" and (m == 1 or (half and m <= CPU_INT8PACK_MAX_M)) \
                and (half or hidden.dtype == torch.float32):
            x = hidden.contiguous()  # torch's int8 weight-only CPU kernel
            return torch._weight_int8pack_mm(x, weight, scale.to(x.dtype)).float()
        dtype = hidden.dtype if half or hidden.dtype == torch.float32 else torch.float32
        return (torch.mm(hidden.to(dtype), weight.to(dtype).t()) * scale.to(dtype)).float()
    from radixserve.layers.quantization import gemv_configs
    from radixserve.layers.quantization.fp8_gemv import MAX_M, fp8_skinny_gemv
    from radixserve.layers.quantization.fp8_kernels import fp8_gemm
    from radixserve.layers.quantization.fp8_mid import MAX_M as MID_MAX_M
    from radixserve.layers.quantization.fp8_mid import fp8_mid_mm

    x = hidden if hidden.stride(-1) == 1 else hidden.contiguous()
    m, (n, k) = x.shape[0], weight.shape
    logits = fp8_skinny_gemv(x, weight, scale, torch.float32, out=out) if m <= MAX_M else None
    cfg = gemv_configs.get_mid(m, n, k, "int8_mid") if logits is None and m <= MID_MAX_M else None
    if cfg is not None and cfg.kernel != "gemm":  # ("gemm": the sweep found fp8_gemm fastest at that M)
        logits = fp8_mid_mm(x, weight, scale, torch.float32, cfg)
    if logits is None:
        logits = fp8_gemm(x, weight, scale.view(-1, 1), 1, weight.shape[1], torch.float32)
    return logits


@torch.library.custom_op("radixserve::int8_lm_head", mutates_args=())
def int8_head_op(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """The int8 head's product as one opaque op inside a torch.compile'd forward (traced, it would be the
    reference, which widens the whole head every step): float32 [M, N]."""
    return int8_head_logits(hidden, weight, scale)


@int8_head_op.register_fake
def _(hidden: torch.Tensor, weight: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    return hidden.new_empty((hidden.shape[0], weight.shape[0]), dtype=torch.float32)
