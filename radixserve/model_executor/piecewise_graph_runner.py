"""PiecewiseGraphRunner: extend batches of any shape (several prompts, a chunk with the running decodes riding
along as MIXED, prompts on cached prefixes) with up to --piecewise-cuda-graph-max-tokens tokens replay CUDA graphs
for everything but attention and the logits.

A forward is cut at each attention call and at the logits: the pieces between the cuts (embedding, norms,
projections, rotary, MLP or MoE) depend only on the token count and three per-token inputs (ids, positions, and the
KV slots that a fused rotary kernel stores K/V into), so one set of graphs per token bucket (`prefill_buckets`: 16,
32, 48, ... up to the maximum), reading those from static buffers, serves every batch that fits it; attention and
the logits run eagerly between the replays, with the batch's own metadata (how many requests, their prefixes, which
of them decode), exactly as an eager forward runs them. The batch's tokens sit at the front of the bucket and
padding rows (token 0, position 0, KV slot 0, the padding slot) behind them; attention and the logits see only the
real rows, and the dense layers never mix rows, so the padding rows' values are never read.

Capture: the model's forward runs once per bucket on a dummy batch under `_capturing(...)`; `RadixAttention` and
`LogitsProcessor` hand their calls to the active capture, which ends the graph being recorded, runs the call
eagerly, keeps its inputs (static tensors of the graph just ended) and, for attention, returns a static output
buffer that the next graph reads. A model whose attention is more than one `RadixAttention` call, or chooses its
form from the batch's lengths on the host (DeepSeek's MLA: the expanded prefill or the latent form), hands the
whole of it to `_Capture.cut` instead: a function of per-token tensors and the ForwardBatch, run eagerly the same
way. Every graph of every bucket shares one memory pool; they are replayed in the order
they were captured, which is what makes that sharing safe.

Compared with `PrefillGraphRunner` (one request, attention inside the graph), a replay here launches each layer's
attention from the host: ~2 launches a layer instead of ~12."""

from __future__ import annotations

import bisect
import contextlib
import logging
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from radixserve.model_executor.prefill_graph_runner import one_request_extend, prefill_buckets

if TYPE_CHECKING:
    from radixserve.layers.logits_processor import LogitsProcessor
    from radixserve.layers.logits_processor_output import LogitsProcessorOutput
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


@dataclass
class _Piece:
    """One captured graph and the eager call that follows it: `call(*inputs, forward_batch)` (a layer's attention,
    or a model's own cut; the inputs sliced to the batch's rows, the output copied into `out`) or, for the last
    piece, the logits of `inputs[0]`."""
    graph: torch.cuda.CUDAGraph
    inputs: tuple[torch.Tensor | None, ...]
    call: Callable[..., torch.Tensor] | None = None
    out: torch.Tensor | None = None
    logits: tuple[LogitsProcessor, Any] | None = None  # (the processor, the LM head)


def _attention_call(layer: RadixAttention, save_kv_cache: bool) -> Callable[..., torch.Tensor]:
    def call(q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None, fb: ForwardBatch) -> torch.Tensor:
        return fb.attn_backend.forward(q, k, v, layer, fb, save_kv_cache)
    return call


class _Capture:
    """The capture in progress: the graph being recorded and the pieces finished so far."""

    def __init__(self, pool: Any, outs: dict[int, torch.Tensor], max_tokens: int) -> None:
        self.pool = pool
        self.outs = outs  # per attention layer, one static output of max_tokens rows shared by every bucket
        self.max_tokens = max_tokens
        self.pieces: list[_Piece] = []
        self.graph: torch.cuda.CUDAGraph | None = self._begin()

    def _begin(self) -> torch.cuda.CUDAGraph:
        graph = torch.cuda.CUDAGraph()
        graph.capture_begin(pool=self.pool)
        return graph

    def _end(self) -> torch.cuda.CUDAGraph:
        if self.graph is None:
            raise RuntimeError("the model called attention or the logits after its logits while being captured")
        graph, self.graph = self.graph, None
        graph.capture_end()
        return graph

    def attention(self, layer: RadixAttention, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                  forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        return self.cut(layer, _attention_call(layer, save_kv_cache), (q, k, v), forward_batch)

    def cut(self, owner: object, call: Callable[..., torch.Tensor], inputs: tuple[torch.Tensor | None, ...],
            forward_batch: ForwardBatch) -> torch.Tensor:
        """End the graph being recorded at `call(*inputs, forward_batch)`, which runs eagerly now and at every
        replay; return its output in a static buffer (one per `owner`, shared by every bucket) that the next graph
        reads. Each input's first dimension is the token's; `call` must return [tokens, ...]."""
        global _active
        graph = self._end()
        active, _active = _active, None  # a RadixAttention inside `call` runs as it would outside a capture
        try:
            o = call(*inputs, forward_batch)
        finally:
            _active = active
        buf = self.outs.get(id(owner))
        if buf is None:
            buf = self.outs[id(owner)] = torch.empty((self.max_tokens, *o.shape[1:]), dtype=o.dtype,
                                                     device=o.device)
        out = buf[: o.shape[0]]
        out.copy_(o)
        self.pieces.append(_Piece(graph, inputs, call=call, out=out))
        self.graph = self._begin()
        return out

    def logits(self, processor: LogitsProcessor, hidden: torch.Tensor, lm_head: Any,
               forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        self.pieces.append(_Piece(self._end(), (hidden,), logits=(processor, lm_head)))
        return processor.compute(hidden, lm_head, forward_batch)

    def abort(self) -> None:
        if self.graph is not None:
            self._end()


_active: _Capture | None = None


def active_capture() -> _Capture | None:
    """The piecewise capture in progress, if any (read by RadixAttention and LogitsProcessor on every call)."""
    return _active


@contextlib.contextmanager
def _capturing(capture: _Capture) -> Iterator[_Capture]:
    global _active
    _active = capture
    try:
        yield capture
    except BaseException:
        capture.abort()
        raise
    finally:
        _active = None


def piecewise_graphs_supported(model_runner: ModelRunner) -> bool:
    """One GPU, no LoRA, DP attention or embeddings (MLA models too: their attention is one cut), any attention
    backend (attention runs eagerly)."""
    args = model_runner.server_args
    return (model_runner.is_cuda and model_runner.tp_size == 1 and model_runner.lora_manager is None
            and not args.is_embedding and not args.enable_dp_attention)


class PiecewiseGraphRunner:
    def __init__(self, model_runner: ModelRunner, max_tokens: int) -> None:
        if max_tokens < 1:
            raise ValueError(f"max_tokens must be positive; got {max_tokens}")
        self.model_runner = model_runner
        self.max_tokens = max_tokens
        self.buckets = prefill_buckets(max_tokens)
        dev = model_runner.device
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        # the KV slots, for a model whose rotary kernel stores K/V inside a piece (padding rows: slot 0)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.pieces: dict[int, list[_Piece]] = {}
        self._outs: dict[int, torch.Tensor] = {}
        self.capture()

    def _dummy_batch(self, n: int) -> ForwardBatch:
        """One request of n new tokens on no prefix, every KV write into padding slot 0 of request row 0."""
        dev = self.model_runner.device
        self.out_cache_loc.zero_()
        self.positions[:n].copy_(torch.arange(n, device=dev))
        lens = torch.full((1,), n, dtype=torch.int64, device=dev)
        zeros = [torch.zeros(1, dtype=torch.int64, device=dev) for _ in range(3)]
        return one_request_extend(self.model_runner, self.input_ids[:n], self.positions[:n], self.out_cache_loc[:n],
                                  zeros[0], lens, zeros[1], lens, zeros[2])

    @torch.inference_mode()
    def capture(self) -> None:
        model = self.model_runner.model
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream):
            for n in reversed(self.buckets):  # the largest first: the pool is sized once
                fb = self._dummy_batch(n)
                fb.attn_backend.init_forward_metadata(fb)
                for _ in range(2):  # compile the kernels and settle the allocations outside the capture
                    model.forward(fb.input_ids, fb.positions, fb)
                stream.synchronize()
                capture = _Capture(pool, self._outs, self.max_tokens)
                with _capturing(capture):
                    model.forward(fb.input_ids, fb.positions, fb)
                if capture.graph is not None or not capture.pieces or capture.pieces[-1].logits is None:
                    capture.abort()
                    raise RuntimeError(f"{type(model).__name__}'s forward did not end with its logits: it cannot "
                                       "be captured in pieces")
                self.pieces[n] = capture.pieces
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured piecewise CUDA graphs for extend batches of %s tokens (%d pieces each) in %.1f s",
                    self.buckets, len(self.pieces[self.buckets[0]]), time.perf_counter() - start)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.forward_mode in (ForwardMode.EXTEND, ForwardMode.MIXED) and fb.lora_info is None
                and fb.dp_num_tokens is None and 0 < fb.input_ids.shape[0] <= self.max_tokens)

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        """The forward of `fb`, whose attention metadata init_forward_metadata has built (ForwardBatch.init_new)."""
        n = fb.input_ids.shape[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_cache_loc, fb.out_cache_loc)):
            buf[:n].copy_(src)
            buf[n:bucket].zero_()
        for piece in self.pieces[bucket]:
            piece.graph.replay()
            if piece.logits is not None:
                processor, lm_head = piece.logits
                return processor.compute(piece.inputs[0][:n], lm_head, fb)
            piece.out[:n].copy_(piece.call(*(t[:n] if t is not None else None for t in piece.inputs), fb))
        raise RuntimeError("the captured pieces did not end with the logits")
