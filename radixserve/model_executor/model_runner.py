"""ModelRunner: loads the model, sizes the memory pools, owns the attention backend, runs forward and sampling."""

from __future__ import annotations

import gc
import logging
import os
import time
from collections.abc import Callable
from typing import TypeVar

import torch

from radixserve.configs.hybrid import apply_hybrid_args
from radixserve.configs.model_config import ModelConfig
from radixserve.distributed.parallel_state import (
    broadcast_tensor_from_first_rank,
    init_custom_all_reduce,
    initialize_model_parallel,
    set_dp_attention,
    set_expert_parallel_size,
)
from radixserve.layers.attention import create_attention_backend
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.layers.sampler import Sampler
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.mla_memory_pool import MLATokenToKVPool
from radixserve.mem_cache.state_pool import StatePool
from radixserve.model_executor.forward_batch_info import ForwardBatch
from radixserve.model_executor.inference_mode import inference_mode
from radixserve.model_loader import get_model
from radixserve.model_loader.loader import cover_context
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)
T = TypeVar("T")

_DTYPES = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}
_KV_DTYPES = {**_DTYPES, "fp8_e4m3": torch.float8_e4m3fn, "fp8_e5m2": torch.float8_e5m2}
CPU_DEFAULT_MAX_TOTAL_TOKENS = 16384
MIN_CALIBRATION_TOKENS = 32  # --calculate-kv-scales: the fewest tokens of its text one prefill may take


POOL_TOKENS_PER_REQUEST = 1024  # what a 70 GiB+ card's KV pool must hold per request for the graphs to cover more


def default_cuda_graph_max_bs(total_gib: float, pool_tokens: int = 0) -> int:
    """The largest captured decode batch when --cuda-graph-max-bs is not given: big cards hold the KV of many
    requests, and a decode batch above the graphs runs eagerly, host-bound (an 8B step at batch 256 launches its
    ~12.6 ms of GPU work in 14-20 ms), so the graphs should cover every batch the pool can hold. On a 70 GiB+ card
    a KV pool (`pool_tokens`) of 1,024 or 512 requests of POOL_TOKENS_PER_REQUEST takes that many (a model with
    small KV, such as MLA's latents: DeepSeek-V2-Lite on an 80 GB H100 decodes 1.9x the tokens a second at 1,024
    as at 256); else 512 from 120 GiB, 256 from 70 GiB, 160 below."""
    if total_gib >= 70:
        for bs in (1024, 512):
            if pool_tokens >= bs * POOL_TOKENS_PER_REQUEST:
                return bs
    if total_gib >= 120:
        return 512
    if total_gib >= 70:
        return 256
    return 160


CPU_AUTO_DTYPE_ENV = "RADIXSERVE_CPU_AUTO_DTYPE"


def cpu_has_fast_bf16(flags: str | None = None) -> bool:
    """Whether the CPU multiplies bfloat16 natively (AVX512-BF16 or AMX-BF16): there oneDNN's bf16 products run at
    about twice float32's speed and the small-batch kernel reads half the bytes."""
    if flags is None:
        from radixserve.layers.cpu_ops import _cpu_signature

        flags = _cpu_signature()
    words = set(flags.split())
    return bool(words & {"avx512_bf16", "amx_bf16"})


def cpu_auto_dtype() -> torch.dtype:
    """What --dtype auto means on the CPU: $RADIXSERVE_CPU_AUTO_DTYPE (float32 / bfloat16) when set, else bfloat16
    where the CPU has fast bf16 and float32 elsewhere. (The test suite sets float32: its correctness checks compare
    float32 tokens.)"""
    forced = os.environ.get(CPU_AUTO_DTYPE_ENV)
    if forced:
        if forced not in ("float32", "bfloat16"):
            raise ValueError(f"${CPU_AUTO_DTYPE_ENV} must be float32 or bfloat16; got {forced!r}")
        return _DTYPES[forced]
    return torch.bfloat16 if cpu_has_fast_bf16() else torch.float32


def resolve_dtype(name: str, device: str, config_dtype: torch.dtype | None = None) -> torch.dtype:
    if name != "auto":
        return _DTYPES[name]
    if device == "cpu":
        return cpu_auto_dtype()
    # On a GPU: the checkpoint's half type, bf16 when the checkpoint is fp32 or says nothing.
    return config_dtype if config_dtype in (torch.float16, torch.bfloat16) else torch.bfloat16


def cpu_forward_threads(args: ServerArgs) -> int | None:
    """Intra-op threads of a CPU forward: --cpu-num-threads; else None (keep torch's) when $OMP_NUM_THREADS is set;
    else every core this process may run on, shared out between the ranks on this machine (oversubscribed OpenMP
    threads make every collective wait). The tokenizer and detokenizer processes block on their sockets between
    messages, so the forward takes all cores rather than leaving one idle for them."""
    if args.cpu_num_threads is not None:
        return args.cpu_num_threads
    if "OMP_NUM_THREADS" in os.environ:
        return None
    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else (os.cpu_count() or 1)
    procs = args.tp_size if args.enable_dp_attention else args.dp_size * args.tp_size  # DP attention: one world
    local_procs = max(1, procs // args.nnodes)
    return max(1, cores // local_procs)


def graphs_within_memory(what: str, flag: str, args: ServerArgs, build: Callable[[], T]) -> T:
    """`build()`, a graph runner capturing its graphs; running out of GPU memory there raises a ValueError that names
    the flag sizing those graphs and the memory fraction (the KV pool takes all but 1 - that of the card first)."""
    try:
        return build()
    except torch.OutOfMemoryError as e:
        free = ""
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
            left, total = torch.cuda.mem_get_info()
            free = f" ({left / 2**30:.1f} of {total / 2**30:.1f} GiB free after it)"
        frac = args.mem_fraction_static or 0.85
        raise ValueError(f"capturing the {what} ran out of GPU memory{free}: lower {flag} or "
                         f"--mem-fraction-static (now {frac}), or pass --disable-cuda-graph") from e


def check_attention_features(model: torch.nn.Module, attn_backend: object, backend: str) -> None:
    """ValueError when a layer of `model` needs what the attention backend (named `backend`) cannot do: soft-capped
    scores (RadixAttention.logit_cap, `supports_logit_cap`) or attention sinks (RadixAttention.sinks,
    `supports_sinks`)."""
    if not getattr(attn_backend, "supports_logit_cap", False) and any(
            getattr(m, "logit_cap", 0.0) > 0 for m in model.modules()):
        raise ValueError(f"this model soft-caps its attention scores (Gemma 2's attn_logit_softcapping), which "
                         f"the {backend} attention backend does not: use triton, torch_native, flex or (on the "
                         f"CPU) cpu")
    if not getattr(attn_backend, "supports_sinks", False) and any(
            isinstance(getattr(m, "sinks", None), torch.Tensor) for m in model.modules()):
        raise ValueError(f"this model has attention sinks (GPT-OSS's per-head sink logits), which the {backend} "
                         f"attention backend does not support: use triton, torch_native, flex or (on the CPU) cpu")
    if not getattr(attn_backend, "supports_chunked_attention", False) and any(
            getattr(m, "attention_chunk_size", -1) > 0 for m in model.modules()):
        raise ValueError(f"this model attends within chunks (Llama 4's attention_chunk_size), which the {backend} "
                         f"attention backend does not support: use triton, torch_native, flex or (on the CPU) cpu")


class ModelRunner:
    def __init__(self, model_config: ModelConfig, server_args: ServerArgs, tp_rank: int = 0, tp_size: int = 1,
                 gpu_id: int = 0, decode_rows_per_request: int | None = None) -> None:
        self.model_config = model_config
        self.server_args = server_args
        apply_hybrid_args(server_args, model_config)  # recurrent-state layers (configs/hybrid.py)
        # decode-shaped forwards carry this many rows per running request at most: 1, or 1 + k with speculation
        # (a verify is one decode row per token), which the CUDA graphs are captured for
        if decode_rows_per_request is None:
            decode_rows_per_request = 1 + server_args.speculative_num_draft_tokens \
                if server_args.speculative_algorithm is not None else 1
        self.decode_rows_per_request = decode_rows_per_request
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # the ranks the attention heads are split over: none with DP attention (each rank has every head)
        self.attn_tp_size = 1 if server_args.enable_dp_attention else tp_size
        device = server_args.resolved_device()
        if device == "cuda":
            if not torch.cuda.is_available():
                raise ValueError("--device cuda was asked for but no CUDA device is available")
            torch.cuda.set_device(gpu_id)
            self.device = f"cuda:{gpu_id}"
        else:
            self.device = "cpu"
        self.is_cuda = device == "cuda"
        self.dtype = resolve_dtype(server_args.dtype, device, model_config.torch_dtype)
        self.kv_dtype = self.dtype if server_args.kv_cache_dtype == "auto" else _KV_DTYPES[server_args.kv_cache_dtype]
        torch.manual_seed(server_args.random_seed)

        self._init_distributed()
        self.model = self._load_model()
        self.lora_manager = None
        if server_args.enable_lora:  # before the KV pool is sized: the adapter slots take device memory
            from radixserve.lora.manager import LoRAManager

            self.lora_manager = LoRAManager(self.model, model_config.num_hidden_layers, server_args, self.dtype,
                                            self.device)
        self._init_memory_pool()
        # Device table of sampled token ids that the scheduler refers to (as -(slot)) before it has seen them
        # (overlap scheduling: the worker writes each step's ids into it); the decode graphs resolve through it.
        self.future_token_ids_map = torch.zeros(4 * (self.max_running_requests + 8), dtype=torch.int64,
                                                device=self.device)
        if not self.is_cuda:
            from radixserve.layers import cpu_ops

            cpu_ops.load()  # build the CPU kernels now (once per machine, about a second), not in the first step
            from radixserve.model_executor.cpu_direct_calls import direct_calls

            direct_calls(self.model)  # module calls go straight to forward: less Python per decode step
        backend = server_args.attention_backend or ("triton" if self.is_cuda else "cpu")
        self.attn_backend = create_attention_backend(backend, self)
        check_attention_features(self.model, self.attn_backend, backend)
        self.sampler = Sampler()
        self.cuda_graph_runner = None
        self.prefill_graph_runner = None
        self.piecewise_graph_runner = None
        if server_args.enable_torch_compile and (not self.is_cuda or server_args.disable_cuda_graph
                                                 or not self.attn_backend.supports_cuda_graph):
            raise ValueError("--enable-torch-compile compiles the decode forward that the CUDA graphs capture: it "
                             "needs a CUDA device, CUDA graphs on and an attention backend that supports them")
        if server_args.calculate_kv_scales:  # before the CUDA graphs: the scales are baked into them
            self._calculate_kv_scales()
        if self.is_cuda:  # MoE models: every block config of the grouped GEMM compiled before serving
            from radixserve.layers.moe.fused_moe import precompile

            t0 = time.perf_counter()
            try:
                n = precompile(self.model, max(server_args.max_prefill_tokens, server_args.chunk_size or 0))
            except Exception as e:  # noqa: BLE001 - a warm-up: the batch that needs the kernel raises it again
                logger.warning("compiling the fused MoE kernels ahead failed (%s: %s); they compile on first use",
                               type(e).__name__, e)
                n = 0
            if n:
                logger.info("compiled the fused MoE kernels for %d block configs in %.1f s", n,
                            time.perf_counter() - t0)
        self._init_graphs()

    # ---------------------------------------------------------------- setup
    def _init_graphs(self) -> None:
        """The decode CUDA graphs, then the one-request prefill graphs and the piecewise extend graphs (CUDA, graphs
        on, a backend that supports them). Called at start, and again by a benchmark that swaps the backend."""
        args = self.server_args
        self.cuda_graph_runner = self.prefill_graph_runner = self.piecewise_graph_runner = None
        if self.is_cuda and not args.disable_cuda_graph and not self.attn_backend.supports_cuda_graph:
            logger.info("the %s attention backend has no CUDA-graph support: decode runs eagerly",
                        type(self.attn_backend).__name__)
        elif self.is_cuda and not args.disable_cuda_graph:
            from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner

            self.cuda_graph_runner = graphs_within_memory(
                "decode CUDA graphs", f"--cuda-graph-max-bs (now {self.cuda_graph_max_bs})", args,
                lambda: CudaGraphRunner(self))
        if self.cuda_graph_runner is not None and args.prefill_cuda_graph_max_tokens > 0:
            from radixserve.model_executor.prefill_graph_runner import PrefillGraphRunner, prefill_graphs_supported

            if prefill_graphs_supported(self):
                n = self._graph_max_tokens(args.prefill_cuda_graph_max_tokens)
                self.prefill_graph_runner = graphs_within_memory(
                    "one-request prefill CUDA graphs", f"--prefill-cuda-graph-max-tokens (now {n})", args,
                    lambda: PrefillGraphRunner(self, n))
        if self.cuda_graph_runner is not None and args.piecewise_cuda_graph_max_tokens > 0:
            from radixserve.model_executor.piecewise_graph_runner import (
                PiecewiseGraphRunner,
                piecewise_graphs_supported,
            )

            if piecewise_graphs_supported(self):
                n = self._graph_max_tokens(args.piecewise_cuda_graph_max_tokens)
                self.piecewise_graph_runner = graphs_within_memory(
                    "piecewise CUDA graphs", f"--piecewise-cuda-graph-max-tokens (now {n})", args,
                    lambda: PiecewiseGraphRunner(self, n))
            else:
                logger.info("piecewise CUDA graphs are not supported for this model or setup: extend batches run "
                            "eagerly")

    def _graph_max_tokens(self, flag: int) -> int:
        """The largest token bucket of the extend graphs: the flag's, but never past the context length or the KV
        pool (the capture runs a dummy prompt of that many tokens at positions 0..n-1)."""
        return max(1, min(flag, self.context_len, self.token_to_kv_pool.size))

    def _init_distributed(self) -> None:
        """Join this replica's TP world (gloo on the CPU, NCCL on CUDA) at tcp://--dist-init-addr, which the
        launcher fills with a free local port when it was not given."""
        args = self.server_args
        if not self.is_cuda:
            threads = cpu_forward_threads(args)
            if threads is not None:
                torch.set_num_threads(threads)
        if self.tp_size == 1:
            initialize_model_parallel(0, 1, "", "gloo")
            return
        addr = self.server_args.dist_init_addr
        if not addr:
            raise ValueError("--tp-size > 1 needs --dist-init-addr host:port (the launcher picks a free local port "
                             "when it is not given)")
        initialize_model_parallel(self.tp_rank, self.tp_size, f"tcp://{addr}", "nccl" if self.is_cuda else "gloo",
                                  timeout_s=self.server_args.dist_timeout)
        logger.info("joined the TP group at %s as rank %d of %d", addr, self.tp_rank, self.tp_size)
        if self.is_cuda and not args.disable_custom_all_reduce and args.nnodes == 1:
            init_custom_all_reduce(self.device)

    def _load_model(self) -> torch.nn.Module:
        set_expert_parallel_size(self.server_args.ep_size)  # read by the MoE layers as they are built
        set_dp_attention(self.server_args.enable_dp_attention)  # read by the models that support it
        model = get_model(self.model_config, load_format=self.server_args.load_format, dtype=self.dtype,
                          device=self.device, tp_rank=self.tp_rank, tp_size=self.tp_size,
                          seed=self.server_args.random_seed, quantization=self.server_args.quantization,
                          quantize_lm_head=self.server_args.quantize_lm_head,
                          cover_positions=0)  # the rotary tables are extended once the pool is sized
        model.eval()
        if self.server_args.enable_dp_attention and not getattr(model, "dp_attention", False):
            raise ValueError(f"--enable-dp-attention is not supported by {type(model).__name__} (it is by the "
                             "DeepSeek-V2/V3 MLA models)")
        self.weight_bytes = sum(p.numel() * p.element_size() for p in model.parameters())
        return model

    def _init_memory_pool(self) -> None:
        cfg, args = self.model_config, self.server_args
        num_kv_heads = max(1, cfg.num_key_value_heads // self.tp_size)
        # (a hybrid model's linear-attention layers hold no KV: their recurrent states are sized below)
        head_dim, num_layers, max_total = cfg.head_dim, cfg.kv_layer_count, args.max_total_tokens
        if getattr(cfg, "is_encoder", False):
            # an encoder attends within its forward and stores no KV: the pool only counts the tokens in flight
            # (one element a slot) and is sized by tokens, not memory: two prefill batches' worth unless given
            num_kv_heads = head_dim = num_layers = 1
            max_total = max_total or 2 * max(args.max_prefill_tokens, cfg.context_len)
        cell = 2 * num_layers * num_kv_heads * head_dim * torch.finfo(self.kv_dtype).bits // 8
        if cfg.is_mla:  # one latent vector per token and layer, shared by all heads (and all TP ranks)
            cell = MLATokenToKVPool.cell_bytes(cfg.kv_lora_rank, cfg.qk_rope_head_dim, cfg.num_hidden_layers,
                                               self.kv_dtype)
        if args.attention_backend == "double_sparsity":  # its label cache holds a row beside every KV slot
            from radixserve.layers.attention.double_sparsity_backend import label_bytes_per_token

            cell += label_bytes_per_token(cfg, args, self.dtype, self.tp_size)
        self.cuda_graph_max_bs = args.cuda_graph_max_bs or 160
        if self.is_cuda:
            gc.collect()
            torch.cuda.empty_cache()
            free, total = torch.cuda.mem_get_info()
            self.cuda_graph_max_bs = args.cuda_graph_max_bs or default_cuda_graph_max_bs(total / 2**30)
            frac = args.mem_fraction_static or 0.85
            # Keep (1 - frac) of the card for activations, CUDA graphs and the sampler.
            rest = free - total * (1 - frac)
            state_cap = self._state_request_cap(rest)
            state_rows = state_cap + 2 + self._state_snapshots(state_cap)
            rest -= state_rows * self.state_bytes if self.state_bytes else 0
            if rest <= cell * 64:
                states = (f" and {state_rows * self.state_bytes / 2**30:.1f} GiB of linear-attention states "
                          f"for {state_cap} requests and the cache's snapshots (fewer: --max-running-requests, "
                          "--state-snapshots)") if self.state_bytes else ""
                raise ValueError(f"not enough GPU memory for the KV cache: {free / 2**30:.1f} GiB free after "
                                 f"loading {self.weight_bytes / 2**30:.1f} GiB of weights{states}; raise "
                                 f"--mem-fraction-static (now {frac}) or use a smaller model / --tp-size")
            size = int(rest // cell)
            if max_total is not None:
                size = min(size, max_total)
            if args.cuda_graph_max_bs is None and not self.state_bytes:  # (a hybrid model's states took theirs)
                self.cuda_graph_max_bs = default_cuda_graph_max_bs(total / 2**30, size)
        else:
            size = max_total or CPU_DEFAULT_MAX_TOTAL_TOKENS
            state_cap = self._state_request_cap(None)
        self.max_total_num_tokens = size
        self.context_len = cfg.context_len
        max_reqs = args.max_running_requests or max(1, min(1024 if self.is_cuda else 256, size // 2))
        if args.max_running_requests is None and self.is_cuda and not args.disable_cuda_graph:
            # every decode batch replays a graph: more requests at once would decode eagerly (host-bound) and fill
            # the pool until requests are retracted (both measured slower on the 8B offline run)
            max_reqs = min(max_reqs, self.cuda_graph_max_bs)
        if self.state_bytes:
            max_reqs = min(max_reqs, state_cap)
        self.max_running_requests = max_reqs
        # a request never holds more tokens than the pool: its row of the request table (and the rotary tables)
        # need no more positions than that, however long the model's context (Llama 4 Scout's: 10M tokens)
        self.max_positions = min(self.context_len, size) + 8
        cover_context(self.model, self.max_positions)
        self.req_to_token_pool = ReqToTokenPool(max_reqs + 1, self.max_positions, self.device)
        if cfg.is_mla:
            self.token_to_kv_pool = MLATokenToKVPool(size, self.kv_dtype, cfg.kv_lora_rank, cfg.qk_rope_head_dim,
                                                     cfg.num_hidden_layers, self.device, page_size=args.page_size)
        else:
            self.token_to_kv_pool = TokenToKVPool(size, self.kv_dtype, num_kv_heads, head_dim, num_layers,
                                                  self.device, page_size=args.page_size)
        size = self.max_total_num_tokens = self.token_to_kv_pool.size  # whole pages
        logger.info("KV pool: %d tokens (%.2f GiB), %d request slots", size, size * cell / 2**30, max_reqs)
        self.state_pool: StatePool | None = None
        if self.state_bytes:  # a state row per request slot, the radix cache's snapshots, a CUDA-graph padding row
            snapshots = self._state_snapshots(state_cap)
            self.model.allocate_states(max_reqs + 1 + snapshots, self.dtype, self.device)
            if snapshots:
                self.state_pool = StatePool(self.model.state_buffers(), max_reqs + 1, snapshots)
            logger.info("linear-attention states: %.1f MiB a request, %.2f GiB for %d slots and %d cache snapshots",
                        self.state_bytes / 2**20, (max_reqs + 2 + snapshots) * self.state_bytes / 2**30, max_reqs + 1,
                        snapshots)

    @property
    def state_bytes(self) -> int:
        """Bytes of a hybrid model's recurrent state per request (0 for a model without linear attention)."""
        fn = getattr(self.model, "state_bytes_per_request", None)
        return fn(self.dtype) if fn is not None else 0

    def _state_request_cap(self, budget: float | None) -> int:
        """A hybrid model's most running requests: --max-running-requests, else as many as a quarter of the memory
        `budget` (CUDA) holds states for, at most the decode graphs' batch (32 on the CPU). The radix cache's
        snapshots (`_state_snapshots`) come on top, out of the KV pool's share."""
        if not self.state_bytes:
            return 1 << 30
        if self.server_args.max_running_requests:
            return self.server_args.max_running_requests
        if budget is None:
            return 32
        return max(1, min(self.cuda_graph_max_bs, int(0.25 * budget // self.state_bytes)))

    def _state_snapshots(self, state_cap: int) -> int:
        """How many state snapshots the radix cache of a hybrid model keeps (0 without the cache)."""
        if not self.state_bytes or self.server_args.disable_radix_cache:
            return 0
        given = self.server_args.state_snapshots
        return state_cap if given is None else given

    def _calculate_kv_scales(self) -> None:
        from radixserve.layers.quantization.kv_calibration import calculate_kv_scales, calibration_text
        from radixserve.managers.tokenizer_utils import get_tokenizer

        if self.model_config.is_mla:
            raise ValueError("--calculate-kv-scales is not supported for MLA models (their pool holds a latent "
                             "vector, not per-head k and v)")
        tokenizer = get_tokenizer(self.server_args.tokenizer_path or self.model_config.tokenizer_path,
                                  self.server_args.trust_remote_code)
        # one prefill: within the context and the pool (the text is ~200 tokens; a smaller pool takes its start)
        room = min(self.context_len - 1, self.max_total_num_tokens - self.server_args.page_size)
        ids = tokenizer.encode(calibration_text())[:room]
        if len(ids) < MIN_CALIBRATION_TOKENS:
            raise ValueError(f"--calculate-kv-scales needs room for {MIN_CALIBRATION_TOKENS} calibration tokens; the "
                             f"context ({self.context_len}) or the KV pool ({self.max_total_num_tokens} tokens) "
                             f"leaves {max(room, 0)}")
        calculate_kv_scales(self, ids)

    # ---------------------------------------------------------------- run
    @inference_mode
    def forward(self, forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        if forward_batch.decode_pack is not None:  # ForwardBatch.init_new checked that a decode graph runs it
            return self.cuda_graph_runner.replay(forward_batch)
        if self.cuda_graph_runner is not None and self.cuda_graph_runner.can_run(forward_batch):
            return self.cuda_graph_runner.replay(forward_batch)
        if self.prefill_graph_runner is not None and self.prefill_graph_runner.can_run(forward_batch):
            return self.prefill_graph_runner.replay(forward_batch)
        if self.piecewise_graph_runner is not None and self.piecewise_graph_runner.can_run(forward_batch):
            return self.piecewise_graph_runner.replay(forward_batch)
        return self.model.forward(forward_batch.input_ids, forward_batch.positions, forward_batch)

    @inference_mode
    def sample(self, logits_output: LogitsProcessorOutput, forward_batch: ForwardBatch) -> torch.Tensor:
        info = forward_batch.sampling_info
        # .forward: the sampler holds no parameters or hooks, and nn.Module.__call__ costs microseconds a step
        next_ids = self.sampler.forward(logits_output, info, forward_batch.return_logprob,
                                        forward_batch.top_logprobs_nums or [0] * forward_batch.batch_size)
        if self.tp_size > 1 and not info.is_all_greedy and not self.server_args.enable_dp_attention:
            # every rank saw the same (all-gathered) logits, but a random draw is rank 0's to make
            broadcast_tensor_from_first_rank(next_ids)
        return next_ids
