"""PrefillGraphRunner: a prefill of one request with up to --prefill-cuda-graph-max-tokens new tokens replays a
CUDA graph instead of launching its ~400 kernels one by one. At low load a short prompt's time to first token is
mostly those launches (an eager forward of an 8B model spends longer on the host than the GPU spends on 128
tokens).

One graph per token bucket (`prefill_buckets`: 16, 32, ..., 128, 160, ..., 256, 320, ... up to the maximum), all of
a single extend request: the new tokens sit at the front of the bucket and the padding rows behind them (token 0,
position 0, KV written to padding slot 0). The graph is captured with the bucket as the attention grid's extent,
while the request's real lengths (`extend_seq_lens`, `extend_prefix_lens`, `seq_lens`) are device values loaded
before each replay: the extend kernel attends only the real tokens (causal, so no real token sees a padding row),
works on top of any cached prefix, and the logits processor picks the last real token's row through the same device
lengths. Rows never mix in the dense layers, so the padding rows' values (never read) cannot reach the real ones.

Only plain single-request prefills take it (no logprobs, pooling, LoRA or DP attention; one GPU; not MLA); every
other extend runs eagerly as before."""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch

from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def prefill_buckets(max_tokens: int) -> list[int]:
    """Token counts to capture, up to max_tokens: every 16 up to 128, then steps of an eighth of the next power of
    two (32 to 256, 64 to 512, ...), so that a prompt runs at most ~25% padding rows (a 136-token prompt replays
    the 160-token graph, not the 256-token one: at these sizes the GEMMs' time grows with the rows)."""
    sizes = []
    n, step = 16, 16
    while n < max_tokens:
        sizes.append(n)
        if n >= 8 * step:
            step *= 2
        n += step
    return sizes + [max_tokens]


def one_request_extend(model_runner: ModelRunner, input_ids: torch.Tensor, positions: torch.Tensor,
                       out_cache_loc: torch.Tensor, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                       prefix_lens: torch.Tensor, extend_lens: torch.Tensor, start_loc: torch.Tensor) -> ForwardBatch:
    """The EXTEND batch a graph is captured with: one request of len(input_ids) new tokens on no prefix, read
    through the given (static) tensors."""
    n = input_ids.shape[0]
    mr = model_runner
    return ForwardBatch(forward_mode=ForwardMode.EXTEND, batch_size=1, input_ids=input_ids,
                        req_pool_indices=req_pool_indices, seq_lens=seq_lens, out_cache_loc=out_cache_loc,
                        seq_lens_sum=n, positions=positions, req_to_token_pool=mr.req_to_token_pool,
                        token_to_kv_pool=mr.token_to_kv_pool, attn_backend=mr.attn_backend,
                        extend_seq_lens=extend_lens, extend_prefix_lens=prefix_lens, extend_start_loc=start_loc,
                        extend_seq_lens_cpu=[n], extend_prefix_lens_cpu=[0], seq_lens_cpu=[n])


def prefill_graphs_supported(model_runner: ModelRunner) -> bool:
    """Whether this runner's prefills can be captured (see the module docstring for what is left out)."""
    args = model_runner.server_args
    return (model_runner.is_cuda and model_runner.tp_size == 1 and model_runner.lora_manager is None
            and not model_runner.model_config.is_mla and not args.is_embedding and not args.enable_dp_attention
            and model_runner.attn_backend.supports_prefill_cuda_graph)


class PrefillGraphRunner:
    def __init__(self, model_runner: ModelRunner, max_tokens: int) -> None:
        self.model_runner = model_runner
        self.max_tokens = max_tokens
        self.buckets = prefill_buckets(max_tokens)
        dev = model_runner.device
        self.backend = model_runner.attn_backend
        self.input_ids = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(max_tokens, dtype=torch.int64, device=dev)
        # the request's row, total length, cached prefix, new tokens and their start (always 0)
        self.req_pool_indices = torch.zeros(1, dtype=torch.int64, device=dev)
        self.seq_lens = torch.zeros(1, dtype=torch.int64, device=dev)
        self.prefix_lens = torch.zeros(1, dtype=torch.int64, device=dev)
        self.extend_lens = torch.zeros(1, dtype=torch.int64, device=dev)
        self.start_loc = torch.zeros(1, dtype=torch.int64, device=dev)
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        self.outputs: dict[int, torch.Tensor] = {}
        self.capture()

    def _forward_batch(self, n: int) -> ForwardBatch:
        return one_request_extend(self.model_runner, self.input_ids[:n], self.positions[:n], self.out_cache_loc[:n],
                                  self.req_pool_indices, self.seq_lens, self.prefix_lens, self.extend_lens,
                                  self.start_loc)

    @torch.inference_mode()
    def capture(self) -> None:
        model = self.model_runner.model
        start = time.perf_counter()
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        pool = torch.cuda.graph_pool_handle()
        with torch.cuda.stream(stream):
            for n in reversed(self.buckets):
                # a dummy request: row 0, n new tokens on no prefix, every KV write into padding slot 0
                self.positions[:n].copy_(torch.arange(n, device=self.positions.device))
                self.seq_lens.fill_(n)
                self.extend_lens.fill_(n)
                self.prefix_lens.zero_()
                fb = self._forward_batch(n)
                self.backend.init_forward_metadata(fb)
                for _ in range(2):  # compile kernels and settle allocations outside the capture
                    model.forward(fb.input_ids, fb.positions, fb)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph, pool=pool, stream=stream):
                    out = model.forward(fb.input_ids, fb.positions, fb)
                self.graphs[n] = graph
                self.outputs[n] = out.next_token_logits
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        logger.info("captured CUDA graphs for single-request prefills of %s tokens in %.1f s", self.buckets,
                    time.perf_counter() - start)

    def can_run(self, fb: ForwardBatch) -> bool:
        return (fb.forward_mode == ForwardMode.EXTEND and fb.batch_size == 1 and not fb.return_logprob
                and fb.pooling is None and fb.lora_info is None and fb.dp_num_tokens is None
                and fb.extend_seq_lens_cpu is not None and 0 < fb.extend_seq_lens_cpu[0] <= self.max_tokens)

    def replay(self, fb: ForwardBatch) -> LogitsProcessorOutput:
        n = fb.extend_seq_lens_cpu[0]
        bucket = self.buckets[bisect.bisect_left(self.buckets, n)]
        for buf, src in ((self.input_ids, fb.input_ids), (self.positions, fb.positions),
                         (self.out_cache_loc, fb.out_cache_loc)):
            buf[:n].copy_(src)
            buf[n:bucket].zero_()
        self.req_pool_indices.copy_(fb.req_pool_indices)
        self.seq_lens.copy_(fb.seq_lens)
        self.prefix_lens.copy_(fb.extend_prefix_lens)
        self.extend_lens.copy_(fb.extend_seq_lens)
        self.graphs[bucket].replay()
        return LogitsProcessorOutput(next_token_logits=self.outputs[bucket])
