"""LogitsProcessor: logits of the last token of each request (plus prompt logprobs when asked)."""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.distributed.parallel_state import tensor_model_parallel_all_gather
from radixserve.layers import cpu_ops
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.model_executor.piecewise_graph_runner import active_capture

if TYPE_CHECKING:
    from radixserve.layers.vocab_parallel_embedding import VocabParallelEmbedding
    from radixserve.model_executor.forward_batch_info import ForwardBatch


# Rows from which a 16-bit LM head on CUDA writes float32 logits itself (measured on an H200 at 64-512 rows, where
# the widening copy it saves costs more than the wider store; fewer rows keep the 16-bit product and the cast).
FLOAT_LOGITS_MIN_ROWS = 64

# Set while the decode CUDA graphs capture (`logits_into`): the float32 rows every batch size's logits go to.
_logits_out: torch.Tensor | None = None


@contextlib.contextmanager
def logits_into(buf: torch.Tensor) -> Iterator[None]:
    """Write the logits of the forwards inside into the first rows of `buf` (float32, one row per batch row, the
    vocabulary wide). The decode graphs share one such buffer: a graph's own logits would stay allocated in the
    graphs' pool after its capture, the sum over the captured sizes (8.1 GiB for Llama-3.1-8B's sizes up to 512)."""
    global _logits_out
    if buf.dtype != torch.float32 or buf.dim() != 2:
        raise ValueError(f"the logits buffer must be a 2-D float32 tensor; got {buf.dtype}, {buf.dim()}-D")
    previous, _logits_out = _logits_out, buf
    try:
        yield
    finally:
        _logits_out = previous


def _logits_rows(rows: int, width: int) -> torch.Tensor | None:
    """The shared logits rows for a product of `rows` x `width` (`logits_into`), or None (none set, another shape, or
    torch.compile tracing: the compiled sizes keep their own)."""
    out = _logits_out
    if out is None or rows > out.shape[0] or width != out.shape[1] or torch.compiler.is_compiling():
        return None
    return out[:rows]


class LogitsProcessor(nn.Module):
    def __init__(self, vocab_size: int, final_logit_softcapping: float | None = None,
                 logits_scaling: float = 1.0, logit_scale: float = 1.0) -> None:
        super().__init__()
        self.vocab_size = vocab_size
        if final_logit_softcapping is not None and not final_logit_softcapping > 0:
            raise ValueError(f"final_logit_softcapping must be positive; got {final_logit_softcapping}")
        if not logits_scaling > 0 or not logit_scale > 0:
            raise ValueError(f"logits_scaling and logit_scale must be positive; got {logits_scaling}, {logit_scale}")
        self.cap = final_logit_softcapping  # Gemma 2: logits = cap * tanh(logits / cap)
        self.divisor = float(logits_scaling)  # Granite: logits / logits_scaling
        self.scale = float(logit_scale)  # Cohere: logits * logit_scale

    def _logits(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding) -> torch.Tensor:
        if getattr(lm_head, "weight_scale", None) is not None:  # an int8 head (--quantize-lm-head)
            from radixserve.layers.quantization.lm_head_int8 import int8_head_logits

            logits = int8_head_logits(hidden, lm_head.weight, lm_head.weight_scale,
                                      out=_logits_rows(hidden.shape[0], lm_head.weight.shape[0]))
        elif hidden.device.type == "cpu":  # on every core for a few rows (decode), as the other linears
            logits = cpu_ops.linear(hidden, lm_head.weight, persistent=True)
        else:
            logits = None
            if hidden.shape[0] == 1 and hidden.dim() == 2 and hidden.stride(-1) == 1 \
                    and not torch.compiler.is_compiling():  # one row: the one-row GEMV where the table has the shape
                from radixserve.layers.triton_ops.gemv import gemv_config, gemv_row

                cfg = gemv_config(lm_head.weight)
                logits = gemv_row(hidden, lm_head.weight, None, cfg) if cfg is not None else None
            if logits is None and hidden.dim() == 2 and hidden.shape[0] >= FLOAT_LOGITS_MIN_ROWS \
                    and hidden.dtype in (torch.bfloat16, torch.float16) and lm_head.tp_size == 1 \
                    and lm_head.weight.dtype == hidden.dtype and not torch.compiler.is_compiling():
                # float32 straight from the product's accumulator: no 16-bit logits written, read and widened
                # (a copy of 6 bytes a logit: 0.15 ms of a DeepSeek-V2-Lite step at batch 512)
                # (into the decode graphs' shared rows where they are set: `logits_into`)
                logits = torch.mm(hidden, lm_head.weight.T, out_dtype=torch.float32,
                                  out=_logits_rows(hidden.shape[0], lm_head.weight.shape[0]))
            if logits is None:
                logits = torch.matmul(hidden, lm_head.weight.T)
        bias = getattr(lm_head, "bias", None)
        if bias is not None:  # a biased LM head (Phi-3.5-MoE): this rank's slice of the vocabulary
            logits = logits + bias.to(logits.dtype)
        if lm_head.tp_size > 1:
            logits = tensor_model_parallel_all_gather(logits, dim=-1)
        logits = logits[:, : self.vocab_size]
        dst = _logits_rows(logits.shape[0], logits.shape[1])
        if dst is not None:  # the widening (or a copy) into the shared rows, then in place
            if dst.data_ptr() != logits.data_ptr():
                dst.copy_(logits)
            logits = dst
        elif logits.dtype != torch.float32:
            logits = logits.float()
        else:  # a float32 product of ours (or a view of one: a padded vocabulary): scaled in place below
            logits = logits.contiguous()
        if self.divisor != 1.0:
            logits.div_(self.divisor)
        if self.scale != 1.0:
            logits.mul_(self.scale)
        if self.cap is not None:
            logits.div_(self.cap).tanh_().mul_(self.cap)
        return logits

    def forward(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        capture = active_capture()
        if capture is not None:  # a piecewise CUDA graph ends here; the logits run eagerly (piecewise_graph_runner)
            return capture.logits(self, hidden, lm_head, forward_batch)
        return self.compute(hidden, lm_head, forward_batch)

    def compute(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        mode = forward_batch.forward_mode
        if mode.is_decode():
            return LogitsProcessorOutput(next_token_logits=self._logits(hidden, lm_head))
        if mode.is_target_verify():  # speculative verify: every position's logits (the drafts are checked on all)
            return LogitsProcessorOutput(next_token_logits=self._logits(hidden, lm_head))
        last = torch.cumsum(forward_batch.extend_seq_lens, 0) - 1
        out = LogitsProcessorOutput(next_token_logits=self._logits(hidden[last], lm_head))
        if forward_batch.pooling is not None:
            out.pooled_hidden = self._pool(hidden, last, forward_batch)
        starts = forward_batch.extend_logprob_start_lens_cpu
        if forward_batch.return_logprob and starts is not None and any(s is not None for s in starts):
            self._input_logprobs(hidden, lm_head, forward_batch, out)
        return out

    @staticmethod
    def _pool(hidden: torch.Tensor, last: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        """Embedding rows: the last extend token's hidden state, or the sum over the extend tokens (a mean's
        numerator: the scheduler adds up the chunks of a long prompt and divides)."""
        pooled = hidden[last].float()
        offset = 0
        for i, (n, how) in enumerate(zip(forward_batch.extend_seq_lens_cpu, forward_batch.pooling, strict=True)):
            if how == "mean":
                pooled[i] = hidden[offset: offset + n].float().sum(0)
            offset += n
        return pooled

    def _input_logprobs(self, hidden: torch.Tensor, lm_head: VocabParallelEmbedding, forward_batch: ForwardBatch,
                        out: LogitsProcessorOutput) -> None:
        """Prompt logprobs: for each request, the log-probability of each of its extend tokens after the first
        `start` given what precedes it. Row i of the result covers tokens from `start` (relative to the extend) on;
        the logprob of the token at position p is read from the logits at p - 1."""
        ids = forward_batch.input_ids
        vals, top_vals, top_idx = [], [], []
        offset = 0
        for ext_len, start, top_n in zip(forward_batch.extend_seq_lens_cpu, forward_batch.extend_logprob_start_lens_cpu,
                                         forward_batch.top_logprobs_nums or [0] * forward_batch.batch_size,
                                         strict=True):
            if start is None or start >= ext_len:
                vals.append(None)
                top_vals.append(None)
                top_idx.append(None)
                offset += ext_len
                continue
            # positions (within the extend) start..ext_len-1 whose logits predict the tokens start+1..ext_len-1
            h = hidden[offset + start: offset + ext_len - 1]
            targets = ids[offset + start + 1: offset + ext_len]
            if h.shape[0] == 0:
                lp = torch.empty(0, device=hidden.device)
                tv, ti = None, None
            else:
                logp = torch.log_softmax(self._logits(h, lm_head), dim=-1)
                lp = logp.gather(1, targets.unsqueeze(1)).squeeze(1)
                tv, ti = (logp.topk(top_n, dim=-1) if top_n else (None, None))
            vals.append(lp)
            top_vals.append(tv)
            top_idx.append(ti)
            offset += ext_len
        out.input_token_logprobs = vals
        out.input_top_logprobs_val = top_vals
        out.input_top_logprobs_idx = top_idx
