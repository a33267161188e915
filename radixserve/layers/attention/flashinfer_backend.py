"""FlashInfer attention backend (optional: the `flashinfer-python` package, CUDA only).

FlashInfer reads a paged KV cache through a page table in CSR form: per request, `kv_indptr` (where its pages start
in `kv_indices`), the page ids, and how many tokens its last page holds. Our pool is such a cache: with page size P
its K buffer [rows, Hkv, D] is viewed as [rows / P, P, Hkv, D] (page p = slots p*P .. p*P+P-1, a request's
positions i*P .. i*P+P-1 in one page), so the page ids of a request are req_to_token[row, 0:len:P] // P.

- extend: `BatchPrefillWithPagedKVCacheWrapper` (causal over the cached prefix and the new tokens, which are stored
  in the pool first); from RAGGED_MIN_TOKENS new tokens in the batch, a model without sliding windows runs the new
  tokens' attention among themselves on FlashInfer's ragged kernel (`BatchPrefillWithRaggedKVCacheWrapper`: K and V
  read where the layer computed them, not gathered through the page table), the attention to the cached prefixes
  on the paged kernel, and merges the two by their log-sum-exps (`triton_ops/merge_state.py`);
- decode: `BatchDecodeWithPagedKVCacheWrapper`, on FlashInfer's tensor-core kernel (a KV head's query group as one
  tile) from 4 query heads a KV head, else on its CUDA-core decode kernel; `decode_on_tensor_cores` decides,
  `RADIXSERVE_FLASHINFER_TENSOR_CORES=0|1` forces it, and where the decode kernel's module cannot be loaded (no
  compiler, no module built ahead of time) decode falls back to the tensor cores with one warning;
- both use FlashInfer's FA2 kernels (one JIT module per dtype / head_dim / sliding-window setting); a model whose
  layers have a sliding window gets a second pair of wrappers planned with `window_left = W - 1`;
- CUDA graphs: one decode wrapper per captured batch size, bound to static index buffers; the replay hook plans it
  (on the host, outside the graph) for the batch at hand, directly through the wrapper's module rather than
  FlashInfer's `plan()` (`_replay_plan`; `RADIXSERVE_FLASHINFER_FAST_PLAN=0` goes through `plan()`). The page ids
  are written inside the graph (one kernel before the first layer's attention, reading the request table after the
  graph's input kernel), so the hook reads nothing on the device. Right after a replay is launched, while the GPU
  runs it and the host would wait, the next step is planned on the guess that every request grows by one token
  (`after_replay_cuda_graph`); the next replay plans only where the guess was wrong.

Planning happens once per forward in `init_forward_metadata`; every layer then calls `run`. MLA, an fp8 KV cache
and logit soft-capping are not served (a clear error at start).
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.layers.attention.base_attn_backend import AttentionBackend, attention_layers, kv_scales, sliding_window
from radixserve.layers.attention.triton_ops.merge_state import merge_attn_states
from radixserve.layers.attention.triton_ops.page_indices import fill_page_indices

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner

import flashinfer  # noqa: E402  (an ImportError here tells the registry the backend is not installed)

logger = logging.getLogger(__name__)
WORKSPACE_BYTES = 256 << 20
TENSOR_CORES_ENV = "RADIXSERVE_FLASHINFER_TENSOR_CORES"  # "1": decode on the prefill kernel, "0": the decode kernel
FAST_PLAN_ENV = "RADIXSERVE_FLASHINFER_FAST_PLAN"  # "0": CUDA-graph replays plan through FlashInfer's plan()
PDL_ENV = "RADIXSERVE_FLASHINFER_PDL"  # "0" / "1": launch FlashInfer's kernels without / with PDL (unset: its default)
RAGGED_ENV = "RADIXSERVE_FLASHINFER_RAGGED_MIN_TOKENS"  # overrides RAGGED_MIN_TOKENS (0: every extend ragged)
RAGGED_MIN_TOKENS = 512  # an extend batch with this many new tokens runs them on the ragged kernel


def _env_flag(name: str) -> bool | None:
    """An environment switch: "1" True, "0" False, unset or empty None; anything else is refused."""
    value = os.environ.get(name, "").strip()
    if value not in ("", "0", "1"):
        raise ValueError(f"{name} must be 0 or 1, got {value!r}")
    return None if not value else value == "1"


def ragged_min_tokens() -> int:
    """New tokens from which an extend batch runs the ragged kernel (RAGGED_MIN_TOKENS unless the variable says)."""
    value = os.environ.get(RAGGED_ENV, "").strip()
    if not value:
        return RAGGED_MIN_TOKENS
    if not value.isdigit():
        raise ValueError(f"{RAGGED_ENV} must be a count of tokens (0 or more), got {value!r}")
    return int(value)


def decode_on_tensor_cores(num_heads: int, num_kv_heads: int, kv_dtype: torch.dtype) -> bool:
    """Whether decode runs FlashInfer's tensor-core (prefill) kernel over one-token queries rather than its CUDA-core
    decode kernel: tensor cores from 4 query heads a KV head (at Llama-3.1-8B's 32 / 8 on the H200 the prefill
    kernel took 272 / 1,550 / 3,473 µs a step at batch 1 / 64 / 160 against the decode kernel's 477 / 1,773 /
    4,132) and for an fp8 KV cache; the decode kernel for narrower groups, where a query group fills little of a
    tensor-core tile. The environment variable overrides the rule."""
    forced = _env_flag(TENSOR_CORES_ENV)
    if forced is not None:
        return forced
    if kv_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
        return True
    return num_heads // max(1, num_kv_heads) >= 4


def host_page_meta(seq_lens: list[int], page_size: int) -> tuple[list[int], torch.Tensor, torch.Tensor]:
    """(pages per request, kv_indptr [bs+1] int32, last_page_len [bs] int32) on the host for these lengths."""
    pages = [(n + page_size - 1) // page_size for n in seq_lens]
    indptr = torch.zeros(len(pages) + 1, dtype=torch.int32)
    indptr[1:] = torch.cumsum(torch.tensor(pages, dtype=torch.int32), 0)
    last = torch.tensor([n - (p - 1) * page_size if p else 0 for n, p in zip(seq_lens, pages, strict=True)],
                        dtype=torch.int32)
    return pages, indptr, last


def page_table(req_to_token: torch.Tensor, rows: torch.Tensor, seq_lens: list[int], page_size: int,
               out_indices: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(kv_indptr [bs+1] int32 on the host, kv_indices int32 on the device, last_page_len [bs] int32 on the host)
    for requests in rows `rows` (device) of the request table with host lengths `seq_lens`. Nothing waits for the
    GPU: the host values go up in one copy from pinned memory, so the planning of the next step overlaps the GPU's
    work on the current one (a plain host-to-device copy synchronises the stream)."""
    pages, indptr, last = host_page_meta(seq_lens, page_size)
    total = int(indptr[-1])
    dev = req_to_token.device
    if total:
        n = len(pages)
        host = torch.tensor(pages + indptr[:-1].tolist(), dtype=torch.int64)  # pages, then each request's first
        if dev.type == "cuda":
            host = host.pin_memory()
        up = host.to(dev, non_blocking=True)
        owner = torch.repeat_interleave(torch.arange(n, device=dev), up[:n], output_size=total)
        pos = (torch.arange(total, device=dev) - up[n:][owner]) * page_size
        indices = (req_to_token[rows.to(torch.int64)[owner], pos] // page_size).to(torch.int32)
    else:
        indices = torch.zeros(0, dtype=torch.int32, device=dev)
    if out_indices is not None:
        out_indices[:total].copy_(indices)
        indices = out_indices
    return indptr, indices, last


@dataclass
class _Plan:
    decode: bool
    wrappers: dict[int, Any]  # window_left -> the planned wrapper (with `ragged`: over the cached prefixes only)
    graph: bool = False  # a captured decode: its first attention layer writes the page ids (`_run`)
    ragged: Any = None  # an extend's new tokens among themselves, merged with `wrappers` where there are any

    @property
    def prefix(self) -> bool:
        """A ragged extend with cached prefixes to attend to as well (its `wrappers` are planned over them)."""
        return self.ragged is not None and bool(self.wrappers)


class FlashInferAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    replay_reads_graph_inputs = False  # the replay hook plans from the host lengths; the graph reads the page table

    def __init__(self, model_runner: ModelRunner, sliding_windows: list[int] | None = None) -> None:
        """sliding_windows: the layers' windows in tokens (-1: none), read from the model when not given."""
        self.device = torch.device(model_runner.device)
        if self.device.type != "cuda":
            raise ValueError("the flashinfer attention backend needs a CUDA device")
        cfg = model_runner.model_config
        if getattr(cfg, "is_mla", False):
            raise ValueError("the flashinfer backend does not serve MLA models here (use triton)")
        pool = model_runner.token_to_kv_pool
        if pool.dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            raise ValueError("the flashinfer backend does not serve an fp8 KV cache here (use triton)")
        tp = getattr(model_runner, "tp_size", 1) or 1
        self.num_heads = cfg.num_attention_heads // tp
        self.num_kv_heads = max(1, cfg.num_key_value_heads // tp)
        self.head_dim = cfg.head_dim
        self.page_size = getattr(pool, "page_size", 1)
        self.kv_dtype = pool.dtype
        self.q_dtype = getattr(model_runner, "dtype", pool.dtype)
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        # every layer's window (W tokens: window_left = W - 1; -1 full) and softmax scale
        layers = attention_layers(model_runner)
        if sliding_windows is None:
            sliding_windows = [sliding_window(m) for m in layers]
        self.windows = sorted({w - 1 if w > 0 else -1 for w in sliding_windows} or {-1})
        scales = {float(m.scaling) for m in layers}
        if len(scales) > 1:
            raise ValueError(f"the flashinfer backend plans one softmax scale per model; layers use {scales}")
        self.sm_scale = scales.pop() if scales else self.head_dim ** -0.5
        self.workspace = torch.empty(WORKSPACE_BYTES, dtype=torch.uint8, device=self.device)
        self.prefill = {w: flashinfer.BatchPrefillWithPagedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
                        for w in self.windows}
        # sliding-window layers keep the paged path (a window would cut across the ragged / prefix split)
        self.ragged_min_tokens = ragged_min_tokens()
        self.ragged = (flashinfer.BatchPrefillWithRaggedKVCacheWrapper(self.workspace, "NHD", backend="fa2")
                       if self.windows == [-1] else None)
        self.tensor_cores = decode_on_tensor_cores(self.num_heads, self.num_kv_heads, self.kv_dtype)
        self.decode = self._decode_wrappers()
        if not self.tensor_cores:
            try:  # the decode kernel's module is built (or found ahead of time) here, not inside a forward
                self._plan_decode(self.decode, torch.zeros(1, dtype=torch.int64, device=self.device), [1])
            except Exception as exc:  # noqa: BLE001  (FlashInfer raises RuntimeError / OSError / its own types)
                if _env_flag(TENSOR_CORES_ENV) is False:
                    raise
                logger.warning("flashinfer: its decode kernel is not available (%s: %s); decode runs the "
                               "tensor-core prefill kernel", type(exc).__name__, str(exc).splitlines()[0][:200])
                self.tensor_cores = True
                self.decode = self._decode_wrappers()
        self.plan: _Plan | None = None
        self.fast_plan = _env_flag(FAST_PLAN_ENV) is not False
        self.pdl = _env_flag(PDL_ENV)  # None: FlashInfer's default
        self._qo_host: dict[int, torch.Tensor] = {}
        self._empty_q = torch.empty(0, dtype=self.q_dtype)
        self._empty_kv = torch.empty(0, dtype=self.kv_dtype)
        self._cg: dict[int, dict[int, Any]] = {}  # captured bs -> window_left -> graph-bound decode wrapper
        self._cg_rpi: torch.Tensor | None = None
        self._cg_seq_lens: torch.Tensor | None = None
        self._fill_layer: int | None = None  # the layer whose attention writes a captured decode's page ids
        self._replayed: tuple[int, list[int], int] | None = None  # the last replay: bs, padded lengths, real rows
        self._ahead: tuple[int, list[int]] | None = None  # the plan made after it for the step expected next

    def _decode_wrappers(self, bs: int | None = None) -> dict[int, Any]:
        """One decode wrapper per window; bound to the graph buffers of batch size `bs` when given."""
        graph = {} if bs is None else {
            "use_cuda_graph": True, "paged_kv_indptr_buffer": self._cg_indptr[:bs + 1],
            "paged_kv_indices_buffer": self._cg_indices, "paged_kv_last_page_len_buffer": self._cg_last[:bs]}
        return {w: flashinfer.BatchDecodeWithPagedKVCacheWrapper(self.workspace, "NHD",
                                                                 use_tensor_cores=self.tensor_cores,
                                                                 backend="fa2", **graph)
                for w in self.windows}

    # ---------------------------------------------------------------- planning
    def _plan_decode(self, wrappers: dict[int, Any], rows: torch.Tensor, seq_lens: list[int],
                     out_indices: torch.Tensor | None = None) -> None:
        indptr, indices, last = page_table(self.req_to_token, rows, seq_lens, self.page_size, out_indices)
        for w, wrapper in wrappers.items():
            wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
                         window_left=w, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype,
                         sm_scale=self.sm_scale)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        if forward_batch.batch_size == 0:  # an idle rank: no attention runs
            self.plan = None
            return
        if forward_batch.seq_lens_cpu is None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens.tolist()
        lens = forward_batch.seq_lens_cpu
        if mode.is_decode():
            self._plan_decode(self.decode, forward_batch.req_pool_indices, lens)
            self.plan = _Plan(True, self.decode)
            return
        ext = forward_batch.extend_seq_lens_cpu
        if ext is None:
            raise ValueError("an extend ForwardBatch needs extend_seq_lens_cpu")
        qo_indptr = torch.zeros(len(ext) + 1, dtype=torch.int32)
        qo_indptr[1:] = torch.cumsum(torch.tensor(ext, dtype=torch.int32), 0)
        ragged = self.ragged is not None and int(qo_indptr[-1]) >= self.ragged_min_tokens
        paged_lens = lens  # what the paged kernel reads of each request: all of it, or its cached prefix
        if ragged:
            self.ragged.plan(qo_indptr, qo_indptr, self.num_heads, self.num_kv_heads, self.head_dim, causal=True,
                             q_data_type=self.q_dtype, kv_data_type=self.kv_dtype, sm_scale=self.sm_scale)
            paged_lens = [n - e for n, e in zip(lens, ext, strict=True)]
            if not any(paged_lens):
                self.plan = _Plan(False, {}, ragged=self.ragged)
                return
        indptr, indices, last = page_table(self.req_to_token, forward_batch.req_pool_indices, paged_lens,
                                           self.page_size)
        for w, wrapper in self.prefill.items():  # causal over the whole request, or all of its cached prefix
            wrapper.plan(qo_indptr, indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim,
                         self.page_size, causal=not ragged, window_left=w, q_data_type=self.q_dtype,
                         kv_data_type=self.kv_dtype, sm_scale=self.sm_scale)
        self.plan = _Plan(False, self.prefill, ragged=self.ragged if ragged else None)

    # ---------------------------------------------------------------- CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be positive; got {max_bs}")
        self.cg_max_bs = max_bs
        self._cg_rpi = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._cg_seq_lens = torch.ones(max_bs, dtype=torch.int64, device=self.device)
        max_pages = self.req_to_token.shape[1] // self.page_size + 1
        # kv_indptr and last_page_len side by side: a replay sends both up in one copy
        self._cg_meta = torch.zeros(2 * max_bs + 1, dtype=torch.int32, device=self.device)
        self._cg_indptr, self._cg_last = self._cg_meta[:max_bs + 1], self._cg_meta[max_bs + 1:]
        self._cg_indices = torch.zeros(max_bs * max_pages, dtype=torch.int32, device=self.device)
        # pinned staging for a replay's kv_indptr / last_page_len, three in turn, each with the event of its last copy
        self._cg_ring = []
        for _ in range(3):
            buf = torch.zeros(2 * max_bs + 1, dtype=torch.int32, pin_memory=True)
            self._cg_ring.append((buf, buf.numpy(), torch.cuda.Event()))
        self._cg_turn = 0
        self._cg_planned: dict[int, torch.cuda.Event] = {}

    def cuda_graph_input_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._cg_rpi is None or self._cg_seq_lens is None:
            return None
        return self._cg_rpi, self._cg_seq_lens

    def _load(self, bs: int, rpi: torch.Tensor, seq_lens: torch.Tensor,
              seq_lens_cpu: list[int] | None = None) -> list[int]:
        if self._cg_rpi is None or self._cg_seq_lens is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) before capturing or replaying a CUDA graph")
        if rpi.data_ptr() != self._cg_rpi.data_ptr():
            self._cg_rpi[:bs].copy_(rpi[:bs])
        if seq_lens.data_ptr() != self._cg_seq_lens.data_ptr():
            self._cg_seq_lens[:bs].copy_(seq_lens[:bs])
        if seq_lens_cpu is not None and len(seq_lens_cpu) <= bs:  # the padding rows hold the fill value
            return list(seq_lens_cpu) + [self.get_cuda_graph_seq_len_fill_value()] * (bs - len(seq_lens_cpu))
        return self._cg_seq_lens[:bs].tolist()  # the plan is made on the host (FlashInfer's scheduler): a sync

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        lens = self._load(bs, req_pool_indices, seq_lens)
        wrappers = self._decode_wrappers(bs)
        self._cg[bs] = wrappers
        self._plan_decode(wrappers, self._cg_rpi[:bs], lens)
        self.plan = _Plan(True, wrappers, graph=True)
        self._fill_layer = self._replayed = self._ahead = None
        if self.fast_plan:
            self._check_fast_plan(bs, lens)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                seq_lens_cpu: list[int] | None = None) -> None:
        lens = self._load(bs, req_pool_indices, seq_lens, seq_lens_cpu)
        ahead, self._ahead = self._ahead, None
        self._replayed = (bs, lens, len(seq_lens_cpu) if seq_lens_cpu is not None else bs)
        if ahead is not None and ahead[0] == bs and ahead[1] == lens:
            return  # planned while the GPU ran the previous step
        if self.fast_plan:
            self._replay_plan(bs, lens)
        else:
            self._plan_graph(bs, lens)

    def after_replay_cuda_graph(self, bs: int) -> None:
        """Plan the step expected next (the same rows, each one token longer) while the GPU runs this one. Only
        when this replay's plan copies have already run, i.e. the GPU had caught up with the host: a host that runs
        ahead of the GPU (overlap scheduling) plans at the next replay as before and never waits here."""
        last = self._replayed
        planned = self._cg_planned.get(bs)
        if not self.fast_plan or last is None or last[0] != bs or planned is None or not planned.query():
            return
        _, lens, real = last
        expected = [n + 1 for n in lens[:real]] + lens[real:]
        self._replay_plan(bs, expected)
        self._ahead = (bs, expected)

    def _plan_graph(self, bs: int, lens: list[int]) -> None:
        """A replay's plan through plan(): kv_indptr and last_page_len from the host lengths; the page ids are the
        graph's own (its first layer writes them), so plan() is handed the graph's index buffer as they are."""
        _, indptr, last = host_page_meta(lens, self.page_size)
        indices = self._cg_indices[:int(indptr[-1])]
        for w, wrapper in self._cg[bs].items():
            wrapper.plan(indptr, indices, last, self.num_heads, self.num_kv_heads, self.head_dim, self.page_size,
                         window_left=w, q_data_type=self.q_dtype, kv_data_type=self.kv_dtype,
                         sm_scale=self.sm_scale)

    # A replay's plan without FlashInfer's plan(): its Python re-checks the arguments, re-copies the page table and
    # looks its module up on every call (~0.5 ms a step at batch 1, ~1.4 ms at 160, measured). A graph-bound wrapper
    # only needs its device buffers refilled and its module's scheduler run on the new lengths, which is what this
    # does: kv_indptr and last_page_len go up in one copy (the graph's first layer writes the page ids from them,
    # `fill_page_indices`), and each window's wrapper gets the plan of the module that its first plan() loaded.
    # At every capture the result is checked against plan()'s; a mismatch turns this path off with a warning.
    def _replay_plan(self, bs: int, lens: list[int]) -> None:
        p, top = self.page_size, self.cg_max_bs + 1
        buf, arr, sent = self._cg_ring[self._cg_turn]
        self._cg_turn = (self._cg_turn + 1) % len(self._cg_ring)
        sent.synchronize()  # the copy that last read this pinned buffer is done (returns at once when it is)
        lens_np = np.asarray(lens, dtype=np.int64)
        pages = (lens_np + p - 1) // p
        arr[0] = 0
        np.cumsum(pages, out=arr[1:bs + 1])
        arr[top:top + bs] = np.where(pages > 0, lens_np - (pages - 1) * p, 0)
        self._cg_meta[:top + bs].copy_(buf[:top + bs], non_blocking=True)
        sent.record()
        indptr_host, kv_lens = buf[:bs + 1], torch.from_numpy(lens_np.astype(np.int32))
        qo = self._qo_host.get(bs)
        if qo is None:
            qo = self._qo_host[bs] = torch.arange(bs + 1, dtype=torch.int32)
        # each module plan fills its wrapper's pinned buffer and queues a copy from it: the previous replay's copy
        # must have run before that buffer is written again (with overlap the host plans a step ahead)
        planned = self._cg_planned.get(bs)
        if planned is None:
            planned = self._cg_planned[bs] = torch.cuda.Event()
        else:
            planned.synchronize()
        for w, wrapper in self._cg[bs].items():
            ws = (wrapper._float_workspace_buffer, wrapper._int_workspace_buffer,
                  wrapper._pin_memory_int_workspace_buffer)
            if self.tensor_cores:  # the prefill module's scheduler over one-token queries
                wrapper._plan_info = wrapper._cached_module.plan(
                    *ws, qo, indptr_host, kv_lens, bs, bs, self.num_heads, self.num_kv_heads, p, True,
                    self.head_dim, self.head_dim, False, w, -1, False, 0)
            else:
                wrapper._plan_info = wrapper._cached_module.plan(
                    *ws, indptr_host, bs, self.num_heads, self.num_kv_heads, p, True, w, 0.0, self.head_dim,
                    self.head_dim, self._empty_q, self._empty_kv)
        planned.record()

    def _check_fast_plan(self, bs: int, lens: list[int]) -> None:
        wrappers = self._cg[bs]
        indices = self._cg_indices[:int(self._cg_indptr[bs])].clone()
        try:
            want = {w: list(wrapper._plan_info) for w, wrapper in wrappers.items()}
            self._replay_plan(bs, lens)
            self._fill_indices(bs)
            got = {w: list(wrapper._plan_info) for w, wrapper in wrappers.items()}
            same = got == want and torch.equal(indices, self._cg_indices[:indices.numel()])
        except Exception as exc:  # noqa: BLE001  (another FlashInfer release: private names or signatures differ)
            logger.warning("flashinfer: replays plan through plan() (the direct plan failed: %s: %s)",
                           type(exc).__name__, str(exc).splitlines()[0][:200] if str(exc) else "")
            same = None
        if same is False:
            logger.warning("flashinfer: replays plan through plan() (the direct plan differs from it)")
        if not same:
            self.fast_plan = False
            self._plan_decode(wrappers, self._cg_rpi[:bs], lens)

    def _fill_indices(self, bs: int) -> None:
        fill_page_indices(self.req_to_token, self._cg_rpi[:bs], self._cg_indptr, self._cg_indices, self.page_size)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---------------------------------------------------------------- forward
    def _paged(self, forward_batch: ForwardBatch, layer_id: int) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer_id)
        p = self.page_size
        return (k_buf.view(-1, p, self.num_kv_heads, self.head_dim),
                v_buf.view(-1, p, self.num_kv_heads, self.head_dim))

    def _run(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
             forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        if self.plan is None:
            raise RuntimeError("init_forward_metadata must run before the attention layers")
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(
                layer.layer_id, forward_batch.out_cache_loc, k.reshape(-1, layer.tp_k_head_num, layer.head_dim),
                v.reshape(-1, layer.tp_v_head_num, layer.head_dim), *kv_scales(layer))
        if self.plan.graph:  # a captured decode: the first layer writes the page ids the graph's plan points at
            if self._fill_layer is None:
                self._fill_layer = layer.layer_id
            if layer.layer_id == self._fill_layer:
                self._fill_indices(forward_batch.batch_size)
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
        if self.plan.ragged is not None:
            o = self._run_ragged(q3, k, v, layer, forward_batch)
        else:
            w = sliding_window(layer)
            wrapper = self.plan.wrappers[w - 1 if w > 0 else -1]
            o = wrapper.run(q3, self._paged(forward_batch, layer.layer_id), enable_pdl=self.pdl)
        return o.reshape(-1, layer.tp_q_head_num * layer.head_dim)

    def _run_ragged(self, q3: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                    forward_batch: ForwardBatch) -> torch.Tensor:
        """The new tokens' attention among themselves (causal) merged with their attention to the cached prefixes."""
        k3 = k.reshape(-1, layer.tp_k_head_num, layer.head_dim).to(self.kv_dtype)
        v3 = v.reshape(-1, layer.tp_v_head_num, layer.head_dim).to(self.kv_dtype)
        if not self.plan.prefix:
            return self.plan.ragged.run(q3, k3, v3, enable_pdl=self.pdl)
        o_new, s_new = self.plan.ragged.run(q3, k3, v3, return_lse=True, enable_pdl=self.pdl)
        o_pre, s_pre = self.plan.wrappers[-1].run(q3, self._paged(forward_batch, layer.layer_id), return_lse=True,
                                                  enable_pdl=self.pdl)
        return merge_attn_states(o_new, s_new, o_pre, s_pre)

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        return self._run(q, k, v, layer, forward_batch, save_kv_cache)
