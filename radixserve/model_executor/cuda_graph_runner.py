"""CudaGraphRunner: decode forward passes captured as CUDA graphs, one per batch size in 1, 2, 4, 8, 16, 24, …
up to --cuda-graph-max-bs, sharing one memory pool. A batch is padded up to the next captured size: padded rows
read request row 0 with seq_len = the backend's fill value and write their KV into padding slot 0. Each graph also
takes the argmax of its logits, which the sampler uses for all-greedy batches with nothing that changes the logits
(greedy sampling inside the graph). With --enable-torch-compile the sizes up to --torch-compile-max-bs capture the
forward compiled by torch.compile instead (model_executor/torch_compile.py).

DP attention: the graphs hold the MoE/MLP collectives over every rank's rows, so all ranks replay the graph of the
same size, the one for the largest batch among them (a rank without requests replays it on padding rows only), and
only when every rank decodes (or idles); the ranks agree on the captured sizes first."""

from __future__ import annotations

import bisect
import logging
import time
from typing import TYPE_CHECKING

import torch
from tqdm import tqdm

from radixserve.layers.logits_processor import logits_into
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.layers.triton_ops import pdl
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from radixserve.model_executor.graph_inputs import check_graph_buffers, launch_decode_pack, load_graph_inputs
from radixserve.model_executor.raw_copy import RawHostToDevice

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)


def greedy_argmax(logits: torch.Tensor) -> torch.Tensor:
    """The graph's argmax of each row's logits: the two-kernel Triton argmax (`torch.argmax` reduces a row in one
    thread block: ~27 us for 128K logits on an H200); torch's where the logits are not rows of unit stride."""
    if logits.dim() == 2 and logits.stride(-1) == 1 and logits.shape[-1] < (1 << 31) and logits.is_cuda:
        from radixserve.layers.triton_ops.argmax import row_argmax

        return row_argmax(logits)
    return torch.argmax(logits, dim=-1)


def capture_batch_sizes(max_bs: int) -> list[int]:
    sizes = [1, 2, 4] + list(range(8, max_bs + 1, 8))
    return sorted({s for s in sizes if s <= max_bs} | {max_bs})


class CudaGraphRunner:
    def __init__(self, model_runner: ModelRunner) -> None:
        self.model_runner = model_runner
        self.max_bs = min(model_runner.cuda_graph_max_bs,
                          model_runner.max_running_requests * getattr(model_runner, "decode_rows_per_request", 1))
        self.dp_attention = model_runner.server_args.enable_dp_attention and model_runner.tp_size > 1
        if self.dp_attention:  # request slots follow each GPU's free memory: capture the sizes every rank has
            from radixserve.distributed.parallel_state import all_gather_pyobj

            self.max_bs = min(all_gather_pyobj(self.max_bs))
        self.capture_bs = capture_batch_sizes(self.max_bs)
        dev = model_runner.device
        self.backend = model_runner.attn_backend
        self.fill = self.backend.get_cuda_graph_seq_len_fill_value()
        self.input_ids = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.out_cache_loc = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.positions = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
        self.backend.init_cuda_graph_state(self.max_bs)
        self.lora = model_runner.lora_manager  # LoRA: the rows' adapter grouping is a graph input
        if self.lora is not None:
            self.lora.init_cuda_graph_state(self.max_bs)
        shared = self.backend.cuda_graph_input_buffers()
        if shared is not None:  # fill the backend's own buffers: its replay hook then has nothing to copy
            self.req_pool_indices, self.seq_lens = shared
        else:
            self.req_pool_indices = torch.zeros(self.max_bs, dtype=torch.int64, device=dev)
            self.seq_lens = torch.full((self.max_bs,), self.fill, dtype=torch.int64, device=dev)
        self.inputs = (self.input_ids, self.req_pool_indices, self.seq_lens, self.out_cache_loc, self.positions)
        check_graph_buffers(self.inputs, self.max_bs)  # once: replays load them without checks
        # The static device copy of a decode batch's pack (ScheduleBatch.decode_pack: header row, five columns), the
        # request table and the future map its input kernel reads. Where the backend's replay hook does not read the
        # graph's inputs on the device, that kernel is captured at the start of every graph: a decode step is then
        # one host-to-device copy and one graph launch. The header's batch size starts at -1 (nothing to load).
        width = self.max_bs + self.max_bs % 2
        self.pack = torch.zeros(6 * width, dtype=torch.int64, device=dev)
        self.pack[0] = -1
        self.future_map = model_runner.future_token_ids_map
        self.table = model_runner.req_to_token_pool.req_to_token
        self.load_in_graph = not self.dp_attention and shared is not None \
            and not self.backend.replay_reads_graph_inputs
        # the pack's copy records no event for the pinned allocator: the last two packs sent stay referenced
        self.copy_pack = RawHostToDevice(self.pack)
        self._sent: list[torch.Tensor | None] = [None, None]
        # the backend's replay hook has nothing to do when it would only load buffers the runner fills itself
        self.skip_replay_hook = shared is not None and self.backend.replay_hook_only_loads_inputs
        self._pack_dst: dict[int, torch.Tensor] = {}  # pack width -> the [6, width] view of self.pack
        self._views: dict[int, tuple[torch.Tensor, ...]] = {}  # batch size -> views of the five buffers
        self._out_views: dict[tuple[int, int], tuple[torch.Tensor, torch.Tensor]] = {}
        self.graphs: dict[int, torch.cuda.CUDAGraph] = {}
        # every graph's float32 logits in rows of one buffer (`logits_into`; each graph's own: sum of the sizes x
        # vocabulary x 4 bytes in the pool); the torch.compile sizes and other widths keep their own
        self.logits_rows = torch.empty((self.max_bs, model_runner.model_config.vocab_size), dtype=torch.float32,
                                       device=dev)
        self.outputs: dict[int, torch.Tensor] = {}
        self.greedy_ids: dict[int, torch.Tensor] = {}
        self.pool = torch.cuda.graph_pool_handle()
        args = model_runner.server_args
        # --enable-torch-compile: these sizes capture the compiled forward (model_executor/torch_compile.py)
        self.compile_bs: set[int] = set()
        if args.enable_torch_compile:
            from radixserve.model_executor.torch_compile import compiled_batch_sizes

            self.compile_bs = compiled_batch_sizes(self.capture_bs, args.torch_compile_max_bs, model_runner.model)
        self.compiled_forward = None
        if self.compile_bs:
            from radixserve.model_executor.torch_compile import compile_forward

            # one graph without breaks on one GPU; TP collectives may break it (the CUDA graph captures all pieces)
            self.compiled_forward = compile_forward(model_runner.model.forward,
                                                    fullgraph=model_runner.tp_size == 1)
        self.capture()

    def _forward_batch(self, bs: int) -> ForwardBatch:
        mr = self.model_runner
        return ForwardBatch(forward_mode=ForwardMode.DECODE, batch_size=bs, input_ids=self.input_ids[:bs],
                            req_pool_indices=self.req_pool_indices[:bs], seq_lens=self.seq_lens[:bs],
                            out_cache_loc=self.out_cache_loc[:bs], seq_lens_sum=bs * self.fill,
                            positions=self.positions[:bs], req_to_token_pool=mr.req_to_token_pool,
                            token_to_kv_pool=mr.token_to_kv_pool, attn_backend=self.backend,
                            dp_num_tokens=[bs] * mr.tp_size if self.dp_attention else None,
                            dp_all_decode=self.dp_attention)

    @torch.inference_mode()
    def capture(self) -> None:
        from radixserve.model_executor.torch_compile import forward_context

        model = self.model_runner.model
        stream = torch.cuda.Stream()
        stream.wait_stream(torch.cuda.current_stream())
        desc = "Capturing CUDA graphs" + (f" (torch.compile of {len(self.compile_bs)} sizes up to "
                                          f"{max(self.compile_bs)})"
                                          if self.compile_bs else "")
        bar = tqdm(reversed(self.capture_bs), total=len(self.capture_bs), desc=desc,
                   disable=self.model_runner.tp_rank != 0)
        start = time.perf_counter()
        compile_s = 0.0
        with torch.cuda.stream(stream), logits_into(self.logits_rows):
            for bs in bar:
                fb = self._forward_batch(bs)
                forward = self.compiled_forward if bs in self.compile_bs else model.forward
                self.backend.init_forward_metadata_capture_cuda_graph(bs, self.req_pool_indices[:bs],
                                                                      self.seq_lens[:bs])
                if self.lora is not None:
                    self.lora.begin_capture(bs)
                with forward_context(fb), pdl.level_while(pdl.graph_level(bs)):
                    t = time.perf_counter()
                    for _ in range(2):  # compile kernels and settle allocations outside the capture
                        self._load_pack_in_graph(bs)
                        greedy_argmax(forward(fb.input_ids, fb.positions, fb).next_token_logits)
                    if bs in self.compile_bs:
                        compile_s += time.perf_counter() - t
                    graph = torch.cuda.CUDAGraph()
                    with torch.cuda.graph(graph, pool=self.pool, stream=stream):
                        self._load_pack_in_graph(bs)
                        out = forward(fb.input_ids, fb.positions, fb)
                        greedy = greedy_argmax(out.next_token_logits)  # used when the whole batch is greedy
                self.graphs[bs] = graph
                self.outputs[bs] = out.next_token_logits
                self.greedy_ids[bs] = greedy
        if self.lora is not None:
            self.lora.end_capture()
        torch.cuda.current_stream().wait_stream(stream)
        torch.cuda.synchronize()
        took = time.perf_counter() - start
        if self.compile_bs:
            logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s (torch.compile of batch sizes "
                        "%s: %.1f s)", self.capture_bs, took, sorted(self.compile_bs), compile_s)
        else:
            logger.info("captured CUDA graphs for decode batch sizes %s in %.1f s", self.capture_bs, took)

    def _load_pack_in_graph(self, bs: int) -> None:
        """The input kernel as the graph's first node (a no-op while the pack header's batch size is -1)."""
        if self.load_in_graph:
            launch_decode_pack(self.inputs, self.pack, bs, self.fill, self.table, self.future_map)

    def input_views(self, n: int) -> tuple[torch.Tensor, ...]:
        """The first n rows of the five input buffers (made once per n): a replayed batch's device tensors."""
        views = self._views.get(n)
        if views is None:
            views = self._views[n] = tuple(t[:n] for t in self.inputs)
        return views

    def can_run(self, forward_batch: ForwardBatch) -> bool:
        if self.dp_attention:  # the same answer on every rank: it depends on all ranks' counts only
            return self.backend.cuda_graph_max_seq_len() is None and forward_batch.dp_all_decode \
                and max(forward_batch.dp_num_tokens) <= self.max_bs
        return forward_batch.forward_mode.is_decode() and self.can_run_decode(forward_batch.batch_size,
                                                                              forward_batch.seq_lens_cpu)

    def can_run_decode(self, batch_size: int, seq_lens_cpu: list[int] | None) -> bool:
        """Whether a decode batch of this size and these lengths (without DP attention) replays a graph."""
        cap = self.backend.cuda_graph_max_seq_len()
        if cap is not None and (seq_lens_cpu is None or max(seq_lens_cpu) > cap):
            return False
        return 1 <= batch_size <= self.max_bs and not self.dp_attention

    def replay(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        raw = forward_batch.batch_size
        want = max(forward_batch.dp_num_tokens) if self.dp_attention else raw  # DP attention: the largest rank's
        bs = self.capture_bs[bisect.bisect_left(self.capture_bs, want)]
        if raw == 0:  # DP attention, a rank without requests: padding rows only
            for buf in (self.input_ids, self.req_pool_indices, self.out_cache_loc, self.positions):
                buf[:bs].zero_()
            self.seq_lens[:bs].fill_(self.fill)
        elif forward_batch.decode_pack is not None:
            # ForwardBatch's one-copy path: the pack to the static device pack, whose kernel (in the graph, or
            # launched here) loads the buffers, fills padding rows, writes the new KV slots into the request table
            # and resolves ids in flight
            host = forward_batch.decode_pack
            dst = self._pack_dst.get(host.shape[1])
            if dst is None:
                dst = self._pack_dst[host.shape[1]] = self.pack[:host.numel()].view(host.shape)
            self.copy_pack(host, dst)
            # a pack copied two replays ago has reached the device: its step has run (a decode step is prepared
            # only after the step before the previous one finished: Scheduler.step)
            self._sent[0], self._sent[1] = self._sent[1], host
            if not self.load_in_graph:
                launch_decode_pack(self.inputs, self.pack, bs, self.fill, self.table, self.future_map)
        else:
            # one kernel loads the batch and fills padding rows (request row 0, the fill length, KV to slot 0); it
            # sets the device pack's batch size to -1, so the graph's own input kernel leaves the buffers alone
            load_graph_inputs(self.inputs, (forward_batch.input_ids, forward_batch.req_pool_indices,
                                            forward_batch.seq_lens, forward_batch.out_cache_loc,
                                            forward_batch.positions), bs, self.fill,
                              header=self.pack if self.load_in_graph else None)
        if self.lora is not None:
            self.lora.load_graph_inputs(forward_batch, bs)
        if not self.skip_replay_hook:
            views = self.input_views(bs)
            self.backend.init_forward_metadata_replay_cuda_graph(bs, views[1], views[2],
                                                                 forward_batch.seq_lens_sum + (bs - raw) * self.fill,
                                                                 seq_lens_cpu=forward_batch.seq_lens_cpu)
        self.graphs[bs].replay()
        self.backend.after_replay_cuda_graph(bs)
        out = self._out_views.get((bs, raw))
        if out is None:
            out = self._out_views[bs, raw] = (self.outputs[bs][:raw], self.greedy_ids[bs][:raw])
        return LogitsProcessorOutput(next_token_logits=out[0], greedy_token_ids=out[1])
