"""Double sparsity: decode attends exactly over the few cached tokens that matter, found cheaply.

Token sparsity: a decode query needs only the tokens that get most of its attention weight. Channel sparsity: which
tokens those are can be estimated from a handful of each head's channels, because a few "heavy" channels carry most
of q . k. Which channels are heavy is a property of the model, found offline (`python -m
radixserve.calibrate_double_sparsity`), and written to a JSON channel file: per layer and KV head, every channel,
most important first.

- Label cache: beside the KV pool, for every KV slot and KV head, the key's values on the head's first
  `--ds-heavy-channel-num` channels, written whenever K is stored (extend and decode).
- Decode: each request longer than `--ds-sparse-decode-threshold` tokens scores all its tokens on the labels (one
  score per KV head: the best over the query heads sharing it), keeps the `--ds-heavy-token-num` best of each KV
  head (the first KEEP_FIRST and last KEEP_LAST positions always among them), and attends exactly (full head_dim,
  softmax over the kept tokens) over those. Shorter requests attend over
  everything. Layers with a sliding window attend densely (their window is the sparsity).
- Extend (prefill, chunked prefill, mixed batches) is the dense backend's, unchanged.

On CUDA the scoring and the sparse attention are Triton kernels (`triton_ops/double_sparsity.py`) and the dense
parts are the Triton backend's; on the CPU the same algorithm runs in PyTorch next to the CPU backend. A decode batch
whose requests are all at most the threshold replays the dense backend's CUDA graphs; a longer one decodes
sparsely without them (how many positions are scored depends on its longest request).
"""

from __future__ import annotations

import dataclasses
import json
import os
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import torch

from radixserve.layers.attention.base_attn_backend import AttentionBackend, kv_scales, sliding_window
from radixserve.mem_cache.memory_pool import load_kv_values

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner

CHANNEL_FILE_FORMAT = "radixserve-double-sparsity/1"
DEFAULT_HEAVY_CHANNEL_NUM = 16
DEFAULT_HEAVY_TOKEN_NUM = 1024
DEFAULT_SPARSE_DECODE_THRESHOLD = 4096
TOPK_MAX_CHUNKS = 1  # chunked top-k measured slower on the H200 (docs/perf-log.md): off
# the top-k of the Triton path: "threshold" (histogram rounds on the scores' bits, triton_ops/topk_select.py) or
# "torch" (torch.topk: a multi-kernel radix select). H200, 8B shape, 64K context (docs/PERFORMANCE.md): 8 rows (batch
# 1) 23 us against 53, 64 rows (batch 8) 100 us against 95. Scores per program: THRESHOLD_BLOCK, or
# THRESHOLD_BLOCK_FEW_ROWS for at most FEW_ROWS rows (the whole sparse decode of a layer at 64K, 2026-12-01: batch 1
# 35.5 us against 37.1 with the smaller block, batch 8 184 against 194 with the larger)
TOPK_METHOD = "threshold"
THRESHOLD_BLOCK, THRESHOLD_BLOCK_FEW_ROWS, FEW_ROWS = 4096, 2048, 16


def threshold_block(rows: int) -> int:
    """Scores per program of the threshold top-k over `rows` score rows."""
    return THRESHOLD_BLOCK_FEW_ROWS if rows <= FEW_ROWS else THRESHOLD_BLOCK


# Always among the kept tokens (within --ds-heavy-token-num): the first few (attention sinks) and the most recent ones,
# whose weight the heavy channels underestimate (RoPE's fast-turning channels, which favour nearby tokens, are
# rarely heavy). At most a quarter / half of the kept tokens.
KEEP_FIRST, KEEP_LAST = 4, 64


def kept_ends(heavy_token_num: int) -> tuple[int, int]:
    """(first, last) positions always kept for a top-k of heavy_token_num tokens."""
    return min(KEEP_FIRST, heavy_token_num // 4), min(KEEP_LAST, heavy_token_num // 2)


def load_channel_file(path: str, num_layers: int, num_kv_heads: int, head_dim: int) -> list[list[list[int]]]:
    """channels[layer][kv_head]: the head's channels, most important first (from `calibrate_double_sparsity`).
    Checked against the model's shape; a file for another model is a ValueError."""
    if not os.path.isfile(path):
        raise ValueError(f"double-sparsity channel file {path!r} does not exist")
    try:
        with open(path, encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, json.JSONDecodeError) as e:
        raise ValueError(f"double-sparsity channel file {path!r} is not readable JSON: {e}") from e
    if not isinstance(data, dict) or data.get("format") != CHANNEL_FILE_FORMAT:
        raise ValueError(f"{path!r} is not a double-sparsity channel file (format {CHANNEL_FILE_FORMAT!r}); write "
                         "one with python -m radixserve.calibrate_double_sparsity")
    want = (num_layers, num_kv_heads, head_dim)
    got = (data.get("num_layers"), data.get("num_kv_heads"), data.get("head_dim"))
    if got != want:
        raise ValueError(f"{path!r} was calibrated for (layers, KV heads, head_dim) = {got}; this model has {want}")
    channels = data.get("channels")
    ok = isinstance(channels, list) and len(channels) == num_layers and all(
        isinstance(layer, list) and len(layer) == num_kv_heads and all(
            isinstance(head, list) and sorted(head) == list(range(head_dim)) for head in layer)
        for layer in channels)
    if not ok:
        raise ValueError(f"{path!r}: 'channels' must hold, per layer and KV head, a permutation of 0..{head_dim - 1}")
    return channels


def resolve_settings(server_args: Any) -> tuple[str | None, int, int, int]:
    """(channel file, heavy channels, heavy tokens, sparse-decode threshold) from ServerArgs, defaults filled."""
    def pick(name: str, default: int) -> int:
        v = getattr(server_args, name, None)
        return default if v is None else v

    return (getattr(server_args, "ds_channel_config_path", None),
            pick("ds_heavy_channel_num", DEFAULT_HEAVY_CHANNEL_NUM),
            pick("ds_heavy_token_num", DEFAULT_HEAVY_TOKEN_NUM),
            pick("ds_sparse_decode_threshold", DEFAULT_SPARSE_DECODE_THRESHOLD))


def label_bytes_per_token(model_config: Any, server_args: Any, dtype: torch.dtype, tp_size: int = 1) -> int:
    """Device bytes of the label cache per KV slot (the model runner sizes the pool with it)."""
    heavy_channels = resolve_settings(server_args)[1]
    num_kv_heads = max(1, model_config.num_key_value_heads // tp_size)
    return model_config.num_hidden_layers * num_kv_heads * heavy_channels * torch.finfo(dtype).bits // 8


@dataclass
class DoubleSparseMetadata:
    sparse: bool = False  # decode with at least one request past the threshold
    max_len: int = 0  # the batch's longest request (columns scored)
    # MIXED: its decodes riding along, as a decode batch of their own (None where there are none)
    decodes: ForwardBatch | None = None


class DoubleSparseAttnBackend(AttentionBackend):
    # decode batches whose longest request is at most the threshold are dense: they replay the dense backend's CUDA
    # graphs (label writes included); longer ones decode sparsely, eagerly (`cuda_graph_max_seq_len`)
    supports_cuda_graph = True

    def __init__(self, model_runner: ModelRunner, channel_config_path: str | None = None,
                 heavy_channel_num: int | None = None, heavy_token_num: int | None = None,
                 sparse_decode_threshold: int | None = None, kernels: str | None = None) -> None:
        path, hc, k, thr = resolve_settings(getattr(model_runner, "server_args", None))
        path = channel_config_path or path
        hc = heavy_channel_num if heavy_channel_num is not None else hc
        k = heavy_token_num if heavy_token_num is not None else k
        thr = sparse_decode_threshold if sparse_decode_threshold is not None else thr
        cfg = model_runner.model_config
        if getattr(cfg, "is_mla", False):
            raise ValueError("double sparsity needs per-head keys; MLA models (a latent KV cache) are not supported")
        if path is None:
            raise ValueError("the double_sparsity backend needs --ds-channel-config-path (write one with python -m "
                             "radixserve.calibrate_double_sparsity)")
        tp_size = getattr(model_runner, "attn_tp_size", None) or getattr(model_runner, "tp_size", 1) or 1
        tp_rank = getattr(model_runner, "tp_rank", 0) or 0
        if cfg.num_key_value_heads % tp_size:
            raise ValueError(f"double sparsity needs the {cfg.num_key_value_heads} KV heads split evenly over "
                             f"--tp-size {tp_size}")
        self.num_heads = cfg.num_attention_heads // tp_size
        self.num_kv_heads = cfg.num_key_value_heads // tp_size
        self.head_dim = cfg.head_dim
        if not 1 <= hc <= self.head_dim:
            raise ValueError(f"--ds-heavy-channel-num must be in 1..{self.head_dim} (head_dim); got {hc}")
        if k < 1 or thr < 0:
            raise ValueError(f"--ds-heavy-token-num must be >= 1 and --ds-sparse-decode-threshold >= 0; got {k}, "
                             f"{thr}")
        self.heavy_channel_num, self.heavy_token_num, self.threshold = hc, k, thr
        self.device = torch.device(model_runner.device)
        self.kernels = kernels or ("triton" if self.device.type == "cuda" else "torch")
        if self.kernels not in ("triton", "torch"):
            raise ValueError(f"kernels must be 'triton' or 'torch'; got {self.kernels!r}")

        # the dense half: extend, short contexts, sliding-window layers
        if self.kernels == "triton":
            from radixserve.layers.attention.triton_backend import TritonAttnBackend

            self.dense: AttentionBackend = TritonAttnBackend(model_runner)
        elif self.device.type == "cpu":
            from radixserve.layers.attention.cpu_backend import CpuAttnBackend

            self.dense = CpuAttnBackend(model_runner)
        else:
            from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

            self.dense = TorchNativeAttnBackend(model_runner)

        table = load_channel_file(path, cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim)
        group = self.num_heads // self.num_kv_heads
        first = tp_rank * self.num_kv_heads
        # per layer: [Hkv, hc] channels of each KV head, and [H, hc] the same repeated for its query heads
        self.k_channels = [torch.tensor([head[:hc] for head in layer[first:first + self.num_kv_heads]],
                                        dtype=torch.int64, device=self.device) for layer in table]
        self.q_channels = [c.repeat_interleave(group, dim=0) for c in self.k_channels]

        pool = model_runner.token_to_kv_pool
        self.label_dtype = getattr(model_runner, "dtype", None) or pool.dtype
        if self.label_dtype in (torch.float8_e4m3fn, torch.float8_e5m2):
            self.label_dtype = torch.bfloat16
        # the label cache: one row per row of the pool's K buffer (its padding slots included), same slot indices
        rows = pool.get_kv_buffer(0)[0].shape[0]
        self.labels = [torch.zeros((rows, self.num_kv_heads, hc), dtype=self.label_dtype, device=self.device)
                       for _ in range(cfg.num_hidden_layers)]
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.forward_metadata = DoubleSparseMetadata()
        self._topk_scratch: torch.Tensor | None = None  # threshold top-k histograms: all zeros between calls

    # ---------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self.dense.init_forward_metadata(forward_batch)
        meta = DoubleSparseMetadata()
        decodes = forward_batch if forward_batch.forward_mode.is_decode() else mixed_decodes(forward_batch)
        if decodes is not None and decodes.batch_size:
            if decodes.seq_lens_cpu is None:
                decodes.seq_lens_cpu = decodes.seq_lens.tolist()
            meta.max_len = max(decodes.seq_lens_cpu)
            meta.sparse = meta.max_len > self.threshold
            meta.decodes = None if decodes is forward_batch else decodes
        self.forward_metadata = meta

    # ---------------------------------------------------------------- CUDA graphs (dense decode)
    def cuda_graph_max_seq_len(self) -> int | None:
        return self.threshold

    def init_cuda_graph_state(self, max_bs: int) -> None:
        self.dense.init_cuda_graph_state(max_bs)

    def cuda_graph_input_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self.dense.cuda_graph_input_buffers()

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        self.dense.init_forward_metadata_capture_cuda_graph(bs, req_pool_indices, seq_lens)
        self.forward_metadata = DoubleSparseMetadata()  # captured decode is the dense one

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                seq_lens_cpu: list[int] | None = None) -> None:
        self.dense.init_forward_metadata_replay_cuda_graph(bs, req_pool_indices, seq_lens, seq_lens_sum, seq_lens_cpu)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return self.dense.get_cuda_graph_seq_len_fill_value()

    # ---------------------------------------------------------------- label cache
    def store_labels(self, k: torch.Tensor, layer_id: int, loc: torch.Tensor) -> None:
        """Write the heavy channels of new keys k [T, Hkv*D] at KV slots loc."""
        if loc is None or k.numel() == 0:
            return
        k3 = k.reshape(-1, self.num_kv_heads, self.head_dim)
        ch = self.k_channels[layer_id]
        self.labels[layer_id][loc] = k3.gather(2, ch.unsqueeze(0).expand(k3.shape[0], -1, -1)).to(self.label_dtype)

    # ---------------------------------------------------------------- forward
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        # labels are written even when the KV store happened elsewhere (the fused rotary kernel): k is the same
        self.store_labels(k, layer.layer_id, forward_batch.out_cache_loc)
        o = self.dense.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        meta = self.forward_metadata
        if meta.decodes is None or not meta.sparse or sliding_window(layer) > 0:
            return o
        # a MIXED batch's decodes (its last rows, their K/V now stored) decode as they would in a decode batch
        n = meta.decodes.batch_size
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)[-n:]
        sparse = self._sparse_decode_triton if self.kernels == "triton" else self._sparse_decode_torch
        o[-n:] = sparse(q3, layer, meta.decodes).reshape(n, -1)
        return o

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        self.store_labels(k, layer.layer_id, forward_batch.out_cache_loc)
        if not self.forward_metadata.sparse or sliding_window(layer) > 0:
            return self.dense.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache:
            forward_batch.token_to_kv_pool.set_kv_buffer(
                layer.layer_id, forward_batch.out_cache_loc, k.reshape(-1, layer.tp_k_head_num, layer.head_dim),
                v.reshape(-1, layer.tp_v_head_num, layer.head_dim), *kv_scales(layer))
        q3 = q.reshape(-1, layer.tp_q_head_num, layer.head_dim)
        if self.kernels == "triton":
            o = self._sparse_decode_triton(q3, layer, forward_batch)
        else:
            o = self._sparse_decode_torch(q3, layer, forward_batch)
        return o.reshape(-1, layer.tp_q_head_num * layer.head_dim)

    def topk_chunks(self, max_len: int) -> int:
        """Pieces each score row is cut into for the top-k (`topk_positions`): rows of at least 8x the kept tokens
        each, at most TOPK_MAX_CHUNKS (1: one torch.topk over the whole row)."""
        return max(1, min(TOPK_MAX_CHUNKS, max_len // (8 * self.heavy_token_num)))

    def q_labels(self, q3: torch.Tensor, layer_id: int) -> torch.Tensor:
        ch = self.q_channels[layer_id]
        return q3.gather(2, ch.unsqueeze(0).expand(q3.shape[0], -1, -1))

    def _sparse_decode_triton(self, q3: torch.Tensor, layer: RadixAttention,
                              forward_batch: ForwardBatch) -> torch.Tensor:
        from radixserve.layers.attention.triton_ops import double_sparsity as ds_ops
        from radixserve.layers.attention.triton_ops.double_sparsity import (
            ds_score_fwd,
            ds_sparse_decode_fwd,
            topk_positions,
        )

        dense = self.dense
        bs = q3.shape[0]
        meta = self.forward_metadata
        scores = torch.empty((bs, self.num_kv_heads, meta.max_len), dtype=torch.float32, device=q3.device)
        k = min(self.heavy_token_num, meta.max_len)
        ds_score_fwd(q3, self.labels[layer.layer_id], self.req_to_token, forward_batch.req_pool_indices,
                     forward_batch.seq_lens, scores, *kept_ends(self.heavy_token_num),
                     q_channels=self.q_channels[layer.layer_id])
        if TOPK_METHOD == "threshold":  # one scratch, left clean by every call: no memset
            from radixserve.layers.attention.triton_ops.topk_select import new_scratch, threshold_topk

            rows = bs * self.num_kv_heads
            if self._topk_scratch is None or self._topk_scratch.shape[0] < rows:
                self._topk_scratch = new_scratch(rows, q3.device)
            top = threshold_topk(scores, k, scratch=self._topk_scratch, block=threshold_block(rows),
                                 pdl_level=ds_ops.PDL_LEVEL)
        else:
            top = topk_positions(scores, k, self.topk_chunks(meta.max_len))
        splits = dense._kv_split_cap(bs)  # type: ignore[attr-defined]
        mid_o, mid_lse = dense._ensure_eager_scratch(bs, self.num_heads, self.head_dim,  # type: ignore[attr-defined]
                                                     splits)
        from radixserve.layers.attention.triton_ops.decode_attention import split_capacity

        cap = split_capacity(splits)
        o = torch.empty_like(q3)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        ds_sparse_decode_fwd(
            q3, k_buf, v_buf, o, self.req_to_token, forward_batch.req_pool_indices, forward_batch.seq_lens, top,
            self.threshold, mid_o[:bs * self.num_heads * cap * self.head_dim].view(bs, self.num_heads, cap,
                                                                                     self.head_dim),
            mid_lse[:bs * self.num_heads * cap].view(bs, self.num_heads, cap), layer.scaling, splits,
            k_scale=kv_scales(layer)[0], v_scale=kv_scales(layer)[1])
        return o

    def _sparse_decode_torch(self, q3: torch.Tensor, layer: RadixAttention,
                             forward_batch: ForwardBatch) -> torch.Tensor:
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        ks, vs = kv_scales(layer)
        ql = self.q_labels(q3, layer.layer_id)
        rows = forward_batch.req_pool_indices.tolist()
        o = torch.empty_like(q3)
        for i, seq_len in enumerate(forward_batch.seq_lens_cpu):
            slots = self.req_to_token[rows[i], :seq_len].long()
            selected = None
            if seq_len > self.threshold:
                selected = select_heavy_tokens(ql[i], self.labels[layer.layer_id][slots], self.heavy_token_num,
                                               *kept_ends(self.heavy_token_num))
            o[i] = sparse_attention_ref(q3[i], load_kv_values(k_buf[slots], q3.dtype, ks),
                                        load_kv_values(v_buf[slots], q3.dtype, vs), selected, layer.scaling)
        return o


def mixed_decodes(forward_batch: ForwardBatch) -> ForwardBatch | None:
    """The decodes riding along in a MIXED batch (its last num_mixed_decodes requests, one token each) as a decode
    batch of their own; None for any other batch."""
    n = forward_batch.num_mixed_decodes
    if not forward_batch.forward_mode.is_mixed() or n == 0:
        return None
    from radixserve.model_executor.forward_batch_info import ForwardMode

    lens = forward_batch.seq_lens_cpu
    # copies, not views: the Triton kernels specialise on pointer alignment (see TritonAttnBackend)
    return dataclasses.replace(
        forward_batch, forward_mode=ForwardMode.DECODE, batch_size=n,
        input_ids=forward_batch.input_ids[-n:], req_pool_indices=forward_batch.req_pool_indices[-n:].clone(),
        seq_lens=forward_batch.seq_lens[-n:].clone(), out_cache_loc=forward_batch.out_cache_loc[-n:],
        seq_lens_cpu=None if lens is None else list(lens[-n:]), seq_lens_sum=0 if lens is None else sum(lens[-n:]),
        positions=forward_batch.positions[-n:], extend_seq_lens=None, extend_prefix_lens=None,
        extend_start_loc=None, extend_seq_lens_cpu=None, extend_prefix_lens_cpu=None,
        extend_logprob_start_lens_cpu=None, num_mixed_decodes=0)


def select_heavy_tokens(q_label: torch.Tensor, k_labels: torch.Tensor, top_k: int, keep_first: int = 0,
                        keep_last: int = 0) -> torch.Tensor:
    """Positions [Hkv, min(top_k, L)] each KV head keeps: the first `keep_first` and last `keep_last`, then the best
    label scores, a score being the largest q_label[h] . k_label over the query heads h of that KV head.
    q_label [H, C], k_labels [L, Hkv, C]."""
    num_kv_heads = k_labels.shape[1]
    ql = q_label.float().view(num_kv_heads, -1, q_label.shape[-1])  # [Hkv, G, C]
    scores = torch.einsum("kgc,lkc->kgl", ql, k_labels.float()).amax(dim=1)  # [Hkv, L]
    pos = torch.arange(scores.shape[1], device=scores.device)
    scores[:, (pos < keep_first) | (pos >= scores.shape[1] - keep_last)] = float("inf")
    return scores.topk(min(top_k, scores.shape[1]), dim=-1).indices


def sparse_attention_ref(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, selected: torch.Tensor | None,
                         scale: float) -> torch.Tensor:
    """One query's attention over k/v [L, Hkv, D] (float32 math): all L positions when selected is None, else
    selected[g] [K] positions for KV head g. q [H, D] -> [H, D]."""
    num_kv_heads, d = k.shape[1], k.shape[2]
    qg = q.float().view(num_kv_heads, -1, d)  # [Hkv, G, D]
    kk, vv = k.float().transpose(0, 1), v.float().transpose(0, 1)  # [Hkv, L, D]
    if selected is not None:
        idx = selected.unsqueeze(-1).expand(-1, -1, d)
        kk, vv = kk.gather(1, idx), vv.gather(1, idx)
    p = torch.softmax(torch.einsum("kgd,kld->kgl", qg, kk) * scale, dim=-1)
    return torch.einsum("kgl,kld->kgd", p, vv).reshape(q.shape).to(q.dtype)
