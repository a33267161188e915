"""ServerArgs: every flag of the engine in one dataclass, parsed by argparse and validated once."""

from __future__ import annotations

import argparse
import dataclasses
import os
import tempfile
from dataclasses import dataclass, field
from typing import Any, get_args, get_origin

LOAD_FORMATS = ("auto", "safetensors", "pt", "gguf", "dummy")
DTYPES = ("auto", "float32", "float16", "bfloat16")
KV_CACHE_DTYPES = (*DTYPES, "fp8_e4m3", "fp8_e5m2")
DEVICES = ("auto", "cpu", "cuda")
SCHEDULE_POLICIES = ("lpm", "dfs-weight", "fcfs", "lof", "random")
# radixserve.constrained.GRAMMAR_BACKENDS and "none" (that package imports torch, which parsing flags need not)
GRAMMAR_BACKENDS = ("xgrammar", "none")
SAMPLING_DEFAULTS = ("model", "none")
LOAD_BALANCE_METHODS = ("round_robin", "shortest_queue", "cache_aware")


def _registry_names(module: str, attr: str) -> tuple[str, ...]:
    """Names of a registry (a dict of lazy import paths: importing it loads no implementation)."""
    import importlib

    return tuple(getattr(importlib.import_module(module), attr))


ATTENTION_BACKENDS = _registry_names("radixserve.layers.attention", "ATTENTION_BACKENDS")
TOOL_CALL_PARSERS = _registry_names("radixserve.entrypoints.openai.tool_parsers", "TOOL_PARSERS")
REASONING_PARSERS = _registry_names("radixserve.entrypoints.openai.reasoning_parsers", "REASONING_PARSERS")
QUANTIZATIONS = tuple(sorted(_registry_names("radixserve.layers.quantization", "QUANTIZATION_METHODS")))
SPECULATIVE_ALGORITHMS = _registry_names("radixserve.speculative", "DRAFTERS")


def _flag(help: str, **kw: Any) -> Any:
    """A dataclass field carrying its argparse help (and choices)."""
    default = kw.pop("default", None)
    factory = kw.pop("default_factory", None)
    meta = {"help": help, **kw}
    if factory is not None:
        return field(default_factory=factory, metadata=meta)
    return field(default=default, metadata=meta)


@dataclass
class ServerArgs:
    # model and tokenizer
    model_path: str | None = _flag("HF folder, .gguf file, or none for the embedded SmolLM2-135M-Instruct")
    tokenizer_path: str | None = _flag("Tokenizer folder (defaults to the model folder)")
    load_format: str = _flag("How to load weights", default="auto", choices=LOAD_FORMATS)
    dtype: str = _flag("Weights and activations dtype (auto: bf16 on CUDA; on a CPU bf16 where it has "
                             "AVX512-BF16 or AMX, else fp32; $RADIXSERVE_CPU_AUTO_DTYPE overrides)", default="auto",
                       choices=DTYPES)
    quantization: str | None = _flag("Weight quantization (default: the checkpoint's quantization_config; fp8 on a "
                                     "16/32-bit checkpoint quantises online; a .gguf file keeps Q8_0/Q4_K packed "
                                     "with gguf)", choices=QUANTIZATIONS)
    quantize_lm_head: bool = _flag("The LM head as int8 rows with one scale each, multiplied in 16 bits (quantized "
                                   "checkpoints and --quantization keep it 16-bit): half its bytes a decode step",
                                   default=False)
    kv_cache_dtype: str = _flag("KV cache dtype (auto: same as dtype; fp8_e4m3 / fp8_e5m2 store K/V in 8 bits, "
                                "scaled by the checkpoint's k_scale / v_scale or 1.0)", default="auto",
                                choices=KV_CACHE_DTYPES)
    calculate_kv_scales: bool = _flag("With an fp8 KV cache: give every attention layer whose checkpoint has no "
                                      "k_scale / v_scale scales measured at startup (one prefill over a short "
                                      "built-in English text; 2 x the largest |k|, |v| seen / the fp8 maximum) "
                                      "instead of 1.0", default=False)
    context_length: int | None = _flag("Override the model's context length")
    trust_remote_code: bool = _flag("Allow custom code from the model folder", default=False)
    served_model_name: str | None = _flag("Model name reported by the API (default: the model path)")
    chat_template: str | None = _flag("Jinja chat template file overriding the tokenizer's")
    is_embedding: bool = _flag("Serve embeddings (/v1/embeddings, /encode) from the model's pooled final hidden "
                               "states instead of generation", default=False)
    pooling_method: str | None = _flag("Embedding pooling (default: the model folder's sentence-transformers "
                                       "1_Pooling config, else last; cls: encoders only)",
                                       choices=("last", "mean", "cls"))
    tool_call_parser: str | None = _flag("Tool-call format of the model (default: from its chat template, else "
                                         "hermes)", choices=TOOL_CALL_PARSERS)
    reasoning_parser: str | None = _flag("Split <think> reasoning into reasoning_content (default: off)",
                                         choices=REASONING_PARSERS)
    # device and memory
    device: str = _flag("Where to run", default="auto", choices=DEVICES)
    mem_fraction_static: float | None = _flag("GPU memory fraction for weights + KV pool (default 0.85)")
    max_total_tokens: int | None = _flag("KV pool size in tokens (CPU default 16384; GPU: from memory)")
    page_size: int = _flag("KV cache page size in tokens: the pool allocates and frees whole pages and the radix "
                           "cache shares whole pages only (a partial last page is recomputed)", default=1)
    max_running_requests: int | None = _flag("Most requests decoding at once (default: on CUDA with graphs the "
                                             "largest captured batch, else from the pool size)")
    max_queued_requests: int | None = _flag("Most requests waiting to be scheduled (running ones do not count; "
                                            "with --dp-size, per replica); more get HTTP 503")
    max_prefill_tokens: int = _flag("Token budget of one prefill batch", default=16384)
    chunked_prefill_size: int | None = _flag("Prefill chunk size in tokens; -1 disables (default 8192 on GPU, "
                                             "4096 on CPU)")
    enable_mixed_chunk: bool = _flag("Run every prefill chunk together with the decode batch (MIXED); steps under "
                                     "--step-token-budget are mixed without it", default=False)
    step_token_budget: int | None = _flag("While requests decode and no backlog waits (the waiting prompts fit in "
                                          "one chunk), a step computes at most this many tokens: a prefill chunk "
                                          "and the running decodes riding with it (MIXED), so a decode never waits "
                                          "behind a long prefill (256 suits an 8B model on one GPU, where such a "
                                          "step replays the piecewise CUDA graphs). Default 256 on one GPU with "
                                          "CUDA graphs and no LoRA, speculative decoding or DP attention; else "
                                          "off; 0: off")
    schedule_policy: str = _flag("Order of the waiting queue", default="fcfs", choices=SCHEDULE_POLICIES)
    schedule_conservativeness: float = _flag("Scales the reserved decode tokens", default=1.0)
    disable_radix_cache: bool = _flag("Use ChunkCache (no prefix sharing)", default=False)
    state_snapshots: int | None = _flag("Hybrid models (Qwen3-Next, Qwen3.5): the linear-attention state snapshots "
                                        "the radix cache keeps, each the state of every such layer at the end of "
                                        "one cached prefix (default: as many as request slots; 0: no prefix "
                                        "caching for these models)")
    attention_backend: str | None = _flag("Attention backend (default triton on CUDA, cpu on CPU; torch_native is "
                                          "the pure-PyTorch reference)", choices=ATTENTION_BACKENDS)
    grammar_backend: str = _flag("Structured output backend", default="xgrammar", choices=GRAMMAR_BACKENDS)
    disable_cuda_graph: bool = _flag("Run decode eagerly", default=False)
    cuda_graph_max_bs: int | None = _flag("Largest captured decode batch (default by GPU memory and the KV pool: from "
                                          "70 GiB, 1024 or 512 where the pool holds that many requests of 1,024 "
                                          "tokens, else 512 from 120 GiB and 256 from 70 GiB; 160 below)")
    prefill_cuda_graph_max_tokens: int = _flag("A prefill of one request with up to this many new tokens replays a "
                                               "CUDA graph (one GPU, with decode graphs on); 0: always eager",
                                               default=1024)
    piecewise_cuda_graph_max_tokens: int = _flag("An extend batch of up to this many tokens (several prompts, or a "
                                                 "chunk with the running decodes under --enable-mixed-chunk) "
                                                 "replays CUDA graphs around eager attention (one GPU, decode "
                                                 "graphs on); 0: eager", default=2048)
    enable_torch_compile: bool = _flag("Compile the decode forward of batches up to --torch-compile-max-bs with "
                                       "torch.compile before capturing their CUDA graphs (start-up takes longer; "
                                       "compiled code is cached under TORCHINDUCTOR_CACHE_DIR)", default=False)
    torch_compile_max_bs: int = _flag("Largest decode batch compiled with --enable-torch-compile", default=32)
    disable_overlap_schedule: bool = _flag("Run scheduling and forward in one thread", default=False)
    enable_overlap_schedule: bool = _flag("Force the overlap loop (default: on for CUDA only)", default=False)
    random_seed: int = _flag("Seed for dummy weights and sampling", default=42)
    # speculative decoding (radixserve/speculative/)
    speculative_algorithm: str | None = _flag("Speculative decoding: ngram drafts the next tokens by matching the "
                                              "last ones against the prompt and output so far, draft_model asks a "
                                              "small model; the model checks them in one pass (turns overlap "
                                              "scheduling off)",
                                              choices=SPECULATIVE_ALGORITHMS)
    speculative_num_draft_tokens: int = _flag("Most tokens drafted per request and step with "
                                              "--speculative-algorithm", default=4)
    speculative_draft_model_path: str | None = _flag("The draft model of --speculative-algorithm draft_model (an "
                                                     "HF folder; same tokenizer as the target)")
    # double sparsity (--attention-backend double_sparsity; layers/attention/double_sparsity_backend.py)
    ds_channel_config_path: str | None = _flag("Channel file of the double_sparsity backend (each head's heavy "
                                               "channels; python -m radixserve.calibrate_double_sparsity)")
    ds_heavy_channel_num: int | None = _flag("Channels per KV head in the double-sparsity label cache (default 16)")
    ds_heavy_token_num: int | None = _flag("Tokens per KV head a double-sparsity decode attends over (default "
                                           "1024)")
    ds_sparse_decode_threshold: int | None = _flag("Requests of at most this many tokens decode densely under "
                                                   "double sparsity (default 4096)")
    cpu_num_threads: int | None = _flag("Intra-op threads of the forward on the CPU (default: $OMP_NUM_THREADS if "
                                        "set, else every core, shared out between ranks on one machine)")
    # server
    host: str = _flag("Address to bind", default="127.0.0.1")
    port: int = _flag("Port to bind", default=30000)
    api_key: str | None = _flag("Require 'Authorization: Bearer KEY' on all routes but /health and the web page's "
                                "static files (visible in `ps`: prefer --api-key-file or the RADIXSERVE_API_KEY "
                                "environment variable)")
    api_key_file: str | None = _flag("File whose first line is the API key (see --api-key)")
    max_request_bytes: int = _flag("Largest request body in bytes; a larger one gets HTTP 413", default=8 << 20)
    request_read_timeout: float = _flag("Seconds a client may take to send its request body; then HTTP 408",
                                        default=30.0)
    graceful_shutdown_timeout: float = _flag("On SIGTERM: seconds in-flight requests may take to finish (new ones "
                                             "get 503) before the rest are aborted", default=30.0)
    responses_store_size: int = _flag("Most /v1/responses responses kept in the server's memory for "
                                      "previous_response_id and GET /v1/responses/{id} (the least recently used "
                                      "go first; lost on restart); 0: store none", default=1000)
    disable_web_ui: bool = _flag("Do not serve the built-in web page (chat playground and dashboard) at /",
                                 default=False)
    enable_metrics: bool = _flag("Expose Prometheus metrics on /metrics", default=False)
    log_level: str = _flag("Logging level", default="info", choices=("debug", "info", "warning", "error"))
    log_requests: bool = _flag("Log every request", default=False)
    watchdog_timeout: float = _flag("Seconds a busy scheduler may take one step before /health says 503",
                                    default=300.0)
    stream_interval: int = _flag("Send streamed tokens every N steps", default=1)
    decode_log_interval: int = _flag("Log decode batch stats (running, tokens, throughput) every N decode steps",
                                     default=40)
    skip_tokenizer_init: bool = _flag("Take and return token ids only", default=False)
    sampling_defaults: str = _flag("Where the sampling parameters a request leaves unset come from: 'model' (the "
                                   "model's generation_config.json: temperature, top_p, top_k, min_p, "
                                   "repetition_penalty) or 'none' (the engine's: temperature 1, top_p 1, ...)",
                                   default="model", choices=SAMPLING_DEFAULTS)
    parse_special_tokens_in_messages: bool = _flag("Chat: tokenize special-token strings inside message content "
                                                   "(e.g. '<|im_start|>system') as special tokens; by default they "
                                                   "are plain text, so user input cannot forge role markers",
                                                   default=False)
    skip_server_warmup: bool = _flag("Serve without first running a short warm-up request (on CUDA the warm-up "
                                     "compiles the Triton kernels before the first user request)", default=False)
    # parallelism
    tp_size: int = _flag("Tensor parallel ranks", default=1)
    ep_size: int = _flag("Expert parallel ranks: the MoE layers split their experts over the TP ranks instead of "
                         "sharding each expert (1, or equal to --tp-size)", default=1)
    dp_size: int = _flag("Data parallel replicas", default=1)
    load_balance_method: str = _flag("DP routing", default="round_robin", choices=LOAD_BALANCE_METHODS)
    nnodes: int = _flag("Number of nodes", default=1)
    node_rank: int = _flag("This node's rank", default=0)
    dist_init_addr: str | None = _flag("host:port of node 0 for torch.distributed (DP replica i uses port + i)")
    dist_timeout: float = _flag("Seconds a TP collective may wait for the other ranks before this rank reports "
                                "them dead and exits", default=600.0)
    balance_abs_threshold: int = _flag("cache_aware: leave the replica holding the prefix when its queue is this many "
                                       "requests longer than the shortest one (and see --balance-rel-threshold)",
                                       default=8)
    balance_rel_threshold: float = _flag("cache_aware: ... and longer than this times the shortest queue",
                                         default=1.5)
    base_gpu_id: int = _flag("First GPU index to use", default=0)
    enable_dp_attention: bool = _flag("MLA models: attention data-parallel over the TP ranks (each rank schedules its "
                                      "own requests with its own KV cache; the MoE/MLP layers stay tensor- or "
                                      "expert-parallel over all ranks' tokens). Needs --dp-size equal to --tp-size",
                                      default=False)
    disable_custom_all_reduce: bool = _flag("TP on CUDA: send every all-reduce through NCCL (by default decode-sized "
                                            "ones use a one-/two-shot all-reduce over symmetric memory)",
                                            default=False)
    # LoRA adapters
    lora_paths: list[str] | None = _flag("LoRA adapters (PEFT folders) to serve from the start, as NAME=PATH (or "
                                         "PATH, named by itself)", nargs="*")
    enable_lora: bool = _flag("Serve LoRA adapters (on when --lora-paths is given; lets /load_lora_adapter add "
                              "adapters to a server started without any)", default=False)
    max_loras_per_batch: int = _flag("Adapter slots on the device: the most distinct adapters in one batch",
                                     default=8)
    max_lora_rank: int | None = _flag("Largest adapter rank served (default: the largest of --lora-paths, or 64)")
    lora_target_modules: list[str] | None = _flag("Projections that may carry LoRA (default: those of "
                                                  "--lora-paths, or all of q/k/v/o/gate/up/down_proj)", nargs="*")
    # internal
    ipc_dir: str | None = _flag("Folder for ZMQ ipc:// sockets (default: a private temp dir)")

    # ------------------------------------------------------------------ resolution and validation
    def __post_init__(self) -> None:
        self.validate()

    def resolved_device(self) -> str:
        if self.device != "auto":
            return self.device
        import torch

        return "cuda" if torch.cuda.is_available() else "cpu"

    def validate(self) -> None:
        def choice(name: str, allowed: tuple[str, ...]) -> None:
            v = getattr(self, name)
            if v is not None and v not in allowed:
                raise ValueError(f"--{name.replace('_', '-')} must be one of {', '.join(allowed)}; got {v!r}")

        for name, allowed in [("load_format", LOAD_FORMATS), ("dtype", DTYPES), ("quantization", QUANTIZATIONS),
                              ("kv_cache_dtype", KV_CACHE_DTYPES),
                              ("device", DEVICES), ("attention_backend", ATTENTION_BACKENDS),
                              ("schedule_policy", SCHEDULE_POLICIES), ("grammar_backend", GRAMMAR_BACKENDS),
                              ("load_balance_method", LOAD_BALANCE_METHODS),
                              ("speculative_algorithm", SPECULATIVE_ALGORITHMS),
                              ("tool_call_parser", TOOL_CALL_PARSERS), ("reasoning_parser", REASONING_PARSERS),
                              ("pooling_method", ("last", "mean", "cls"))]:
            choice(name, allowed)

        def positive(name: str, allow_none: bool = True) -> None:
            v = getattr(self, name)
            if v is None and allow_none:
                return
            if not isinstance(v, int) or isinstance(v, bool) or v <= 0:
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {v!r}")

        for name in ("context_length", "max_total_tokens", "max_running_requests", "max_queued_requests",
                     "max_prefill_tokens", "cuda_graph_max_bs", "tp_size", "ep_size", "dp_size", "nnodes",
                     "stream_interval", "decode_log_interval", "cpu_num_threads", "speculative_num_draft_tokens",
                     "torch_compile_max_bs"):
            positive(name)
        positive("page_size", allow_none=False)
        if self.state_snapshots is not None and (not isinstance(self.state_snapshots, int)
                                                 or isinstance(self.state_snapshots, bool) or self.state_snapshots < 0):
            raise ValueError(f"--state-snapshots must be a non-negative integer; got {self.state_snapshots!r}")
        if self.page_size > 1 and self.speculative_algorithm is not None:
            raise ValueError("--speculative-algorithm needs --page-size 1 (a rejected draft's slot may share a page "
                             "with kept tokens, and pages are freed whole)")
        if not isinstance(self.prefill_cuda_graph_max_tokens, int) or self.prefill_cuda_graph_max_tokens < 0:
            raise ValueError("--prefill-cuda-graph-max-tokens must be a non-negative integer; got "
                             f"{self.prefill_cuda_graph_max_tokens!r}")
        if not isinstance(self.piecewise_cuda_graph_max_tokens, int) or self.piecewise_cuda_graph_max_tokens < 0:
            raise ValueError("--piecewise-cuda-graph-max-tokens must be a non-negative integer; got "
                             f"{self.piecewise_cuda_graph_max_tokens!r}")
        if self.step_token_budget is not None and (not isinstance(self.step_token_budget, int)
                                                   or isinstance(self.step_token_budget, bool)
                                                   or self.step_token_budget < 0):
            raise ValueError(f"--step-token-budget must be a non-negative integer; got {self.step_token_budget!r}")
        if self.step_token_budget and (self.speculative_algorithm is not None or self.enable_dp_attention):
            raise ValueError("--step-token-budget is not supported with speculative decoding or "
                             "--enable-dp-attention (their steps are scheduled differently)")
        if self.chunked_prefill_size is not None and self.chunked_prefill_size != -1:
            positive("chunked_prefill_size")
        if self.mem_fraction_static is not None and not 0.0 < self.mem_fraction_static < 1.0:
            raise ValueError(f"--mem-fraction-static must be in (0, 1); got {self.mem_fraction_static}")
        if not 0 < self.port < 65536:
            raise ValueError(f"--port must be in 1..65535; got {self.port}")
        if self.pooling_method is not None and not self.is_embedding:
            raise ValueError("--pooling-method needs --is-embedding (it chooses how embeddings are pooled)")
        if not self.watchdog_timeout > 0:
            raise ValueError(f"--watchdog-timeout must be > 0 seconds; got {self.watchdog_timeout}")
        if self.enable_overlap_schedule and self.disable_overlap_schedule:
            raise ValueError("give at most one of --enable-overlap-schedule and --disable-overlap-schedule")
        if not isinstance(self.base_gpu_id, int) or isinstance(self.base_gpu_id, bool) or self.base_gpu_id < 0:
            raise ValueError(f"--base-gpu-id must be a GPU index >= 0; got {self.base_gpu_id!r}")
        if self.tokenizer_path is not None and not os.path.exists(self.tokenizer_path):
            raise ValueError(f"--tokenizer-path {self.tokenizer_path!r} does not exist")
        if self.calculate_kv_scales and not self.kv_cache_dtype.startswith("fp8"):
            raise ValueError("--calculate-kv-scales needs an fp8 KV cache (--kv-cache-dtype fp8_e4m3 or fp8_e5m2); "
                             f"got --kv-cache-dtype {self.kv_cache_dtype}")
        if not 0 <= self.node_rank < self.nnodes:
            raise ValueError(f"--node-rank must be in 0..{self.nnodes - 1}; got {self.node_rank}")
        if self.nnodes > 1 and not self.dist_init_addr:
            raise ValueError("--dist-init-addr host:port is required with --nnodes > 1")
        if self.dist_init_addr is not None and not _is_host_port(self.dist_init_addr):
            raise ValueError(f"--dist-init-addr must be host:port; got {self.dist_init_addr!r}")
        if self.dist_timeout <= 0:
            raise ValueError(f"--dist-timeout must be > 0; got {self.dist_timeout}")
        if self.balance_abs_threshold < 0 or self.balance_rel_threshold < 1.0:
            raise ValueError("--balance-abs-threshold must be >= 0 and --balance-rel-threshold >= 1")
        if self.ep_size not in (1, self.tp_size):
            raise ValueError(f"--ep-size must be 1 or equal to --tp-size ({self.tp_size}); got {self.ep_size}")
        if self.enable_dp_attention:
            if self.tp_size < 2 or self.dp_size != self.tp_size:
                raise ValueError("--enable-dp-attention needs --tp-size >= 2 and --dp-size equal to it (each TP rank "
                                 f"is an attention DP rank); got --tp-size {self.tp_size} --dp-size {self.dp_size}")
            if self.nnodes != 1:
                raise ValueError("--enable-dp-attention runs on one node")
            if self.speculative_algorithm is not None:
                raise ValueError("--enable-dp-attention does not support speculative decoding")
        if self.tp_size % self.nnodes != 0:
            raise ValueError(f"--tp-size {self.tp_size} must be a multiple of --nnodes {self.nnodes}")
        if self.schedule_conservativeness <= 0:
            raise ValueError("--schedule-conservativeness must be > 0")
        if self.model_path is not None and self.load_format != "dummy" and not os.path.exists(self.model_path):
            raise ValueError(f"--model-path {self.model_path!r} does not exist")
        if self.chat_template is not None and not os.path.isfile(self.chat_template):
            raise ValueError(f"--chat-template {self.chat_template!r} is not a file")
        if self.api_key is not None and self.api_key_file is not None:
            raise ValueError("give at most one of --api-key and --api-key-file")
        if self.api_key_file is not None and not os.path.isfile(self.api_key_file):
            raise ValueError(f"--api-key-file {self.api_key_file!r} is not a file")
        if self.max_request_bytes <= 0:
            raise ValueError(f"--max-request-bytes must be > 0; got {self.max_request_bytes}")
        if not isinstance(self.responses_store_size, int) or isinstance(self.responses_store_size, bool) \
                or self.responses_store_size < 0:
            raise ValueError(f"--responses-store-size must be an integer >= 0; got {self.responses_store_size!r}")
        if self.request_read_timeout <= 0 or self.graceful_shutdown_timeout < 0:
            raise ValueError("--request-read-timeout must be > 0 and --graceful-shutdown-timeout >= 0")
        if (self.speculative_draft_model_path is not None) != (self.speculative_algorithm == "draft_model"):
            raise ValueError("--speculative-draft-model-path goes with --speculative-algorithm draft_model (both or "
                             "neither)")
        if self.speculative_draft_model_path is not None and not os.path.exists(self.speculative_draft_model_path):
            raise ValueError(f"--speculative-draft-model-path {self.speculative_draft_model_path!r} does not exist")
        self._validate_lora()
        self._validate_double_sparsity()

    def _validate_double_sparsity(self) -> None:
        ds = ("ds_channel_config_path", "ds_heavy_channel_num", "ds_heavy_token_num", "ds_sparse_decode_threshold")
        if self.attention_backend != "double_sparsity":
            given = [f"--{n.replace('_', '-')}" for n in ds if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need --attention-backend double_sparsity")
            return
        if self.ds_channel_config_path is None:
            raise ValueError("--attention-backend double_sparsity needs --ds-channel-config-path (write one with "
                             "python -m radixserve.calibrate_double_sparsity)")
        if not os.path.isfile(self.ds_channel_config_path):
            raise ValueError(f"--ds-channel-config-path {self.ds_channel_config_path!r} is not a file")
        for name, low in (("ds_heavy_channel_num", 1), ("ds_heavy_token_num", 1), ("ds_sparse_decode_threshold", 0)):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < low):
                raise ValueError(f"--{name.replace('_', '-')} must be an integer >= {low}; got {v!r}")

    def _validate_lora(self) -> None:
        from radixserve.lora.config import TARGET_MODULES

        if self.lora_paths:
            self.enable_lora = True
        if not self.enable_lora:
            given = [f"--{n.replace('_', '-')}" for n in ("max_lora_rank", "lora_target_modules")
                     if getattr(self, n) is not None]
            if given:
                raise ValueError(f"{', '.join(given)} need LoRA serving (--lora-paths or --enable-lora)")
        for name in ("max_loras_per_batch", "max_lora_rank"):
            v = getattr(self, name)
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v <= 0):
                raise ValueError(f"--{name.replace('_', '-')} must be a positive integer; got {v!r}")
        bad = sorted(set(self.lora_target_modules or ()) - set(TARGET_MODULES))
        if bad:
            raise ValueError(f"--lora-target-modules: {', '.join(bad)} not supported (choose among "
                             f"{', '.join(TARGET_MODULES)})")
        if self.enable_lora and self.enable_torch_compile:
            raise ValueError("--enable-torch-compile cannot serve LoRA adapters (the compiled decode would run the "
                             "adapters' per-batch grouping as traced torch code); drop one of the two")
        names = [n for n, _ in self.lora_path_pairs()]
        if len(set(names)) != len(names):
            raise ValueError(f"--lora-paths: adapter names must be unique; got {names}")
        reserved = {"default", self.served_model_name} & set(names)  # `model` with these names is the base model
        if reserved:
            raise ValueError(f"--lora-paths: {', '.join(sorted(n for n in reserved if n))} names the served model; "
                             "choose another adapter name")
        for name, path in self.lora_path_pairs():
            if not os.path.isdir(path):
                raise ValueError(f"--lora-paths: adapter {name!r}: {path!r} is not a folder")

    def lora_path_pairs(self) -> list[tuple[str, str]]:
        """--lora-paths as (name, path) pairs."""
        out = []
        for item in self.lora_paths or ():
            name, sep, path = item.partition("=")
            if not sep:
                name, path = item, item
            if not name or not path:
                raise ValueError(f"--lora-paths entries are NAME=PATH; got {item!r}")
            out.append((name, path))
        return out

    # ------------------------------------------------------------------ derived values
    def resolved_api_key(self) -> str | None:
        """--api-key, else the first line of --api-key-file, else $RADIXSERVE_API_KEY (None: no key needed)."""
        if self.api_key is not None:
            return self.api_key
        if self.api_key_file is not None:
            with open(self.api_key_file, encoding="utf-8") as f:
                key = f.readline().strip()
            if not key:
                raise ValueError(f"--api-key-file {self.api_key_file!r} is empty")
            return key
        return os.environ.get("RADIXSERVE_API_KEY") or None

    @property
    def resolved_step_token_budget(self) -> int:
        """--step-token-budget; unset: 256 where its steps replay CUDA graphs (one GPU, graphs on, no LoRA: the
        piecewise graphs take a chunk with the decodes riding along; P99 inter-token latency 10.3 ms against 34.7
        without it at 16 requests/s of 1024-token prompts on an H200, docs/PERFORMANCE.md) and the steps are plain
        ones (no speculative decoding or DP attention); else off, as on the CPU (an eager 256-token step costs
        more than it saves there)."""
        if self.step_token_budget is not None:
            return self.step_token_budget
        graphs = self.resolved_device() == "cuda" and not self.disable_cuda_graph and self.tp_size == 1 \
            and not self.enable_lora
        if graphs and self.speculative_algorithm is None and not self.enable_dp_attention:
            return 256
        return 0

    @property
    def chunk_size(self) -> int | None:
        """Prefill chunk size in tokens, or None when chunking is off."""
        if self.chunked_prefill_size == -1:
            return None
        if self.chunked_prefill_size is None:
            return 8192 if self.resolved_device() == "cuda" else 4096
        return self.chunked_prefill_size

    @property
    def use_overlap(self) -> bool:
        if self.disable_overlap_schedule or self.speculative_algorithm is not None:
            return False
        return self.enable_overlap_schedule or self.resolved_device() == "cuda"

    def make_ipc_dir(self) -> str:
        if self.ipc_dir is None:
            self.ipc_dir = tempfile.mkdtemp(prefix="radixserve-")
        return self.ipc_dir

    # ------------------------------------------------------------------ argparse
    @staticmethod
    def add_cli_args(parser: argparse.ArgumentParser) -> None:
        for f in dataclasses.fields(ServerArgs):
            if f.name == "ipc_dir":
                continue
            flag = "--" + f.name.replace("_", "-")
            meta = dict(f.metadata)
            help_text = meta.pop("help", "")
            tp = _base_type(f.type)
            if tp is bool:
                parser.add_argument(flag, action="store_true", help=help_text)
            else:
                if f.default is not None and f.default is not dataclasses.MISSING and "default" not in help_text:
                    help_text += " (default: %(default)s)"  # argparse fills in the value, set_defaults included
                parser.add_argument(flag, type=tp, default=f.default, help=help_text, **meta)

    @classmethod
    def from_cli_args(cls, args: argparse.Namespace) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        return cls(**{k: v for k, v in vars(args).items() if k in names})

    @classmethod
    def from_kwargs(cls, **kwargs: Any) -> ServerArgs:
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(kwargs) - names)
        if unknown:
            raise ValueError(f"unknown server argument(s): {', '.join(unknown)}")
        return cls(**kwargs)


def _is_host_port(addr: str) -> bool:
    host, sep, port = addr.rpartition(":")
    return bool(sep and host and port.isdigit() and 0 < int(port) < 65536)


def _base_type(annotation: Any) -> type:
    """Turn 'int | None' (possibly a string under postponed annotations) into int."""
    if isinstance(annotation, str):
        annotation = annotation.replace(" ", "").replace("|None", "")
        return {"int": int, "float": float, "str": str, "bool": bool, "list[str]": str}[annotation]
    args = [a for a in get_args(annotation) if a is not type(None)]
    if get_origin(annotation) is not None and args:
        return args[0]
    return annotation


def prepare_server_args(argv: list[str] | None = None) -> ServerArgs:
    parser = argparse.ArgumentParser(description="radixserve server")
    ServerArgs.add_cli_args(parser)
    return ServerArgs.from_cli_args(parser.parse_args(argv))
