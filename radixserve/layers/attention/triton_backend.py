"""Triton attention backend: an extend kernel (cached prefix read through req_to_token + causal new tokens) and a
split-KV decode kernel, both reading the KV pool in place.

Decode never syncs with the host: the kernels read seq_lens and req_pool_indices on the device and decide there how
many KV splits each request uses, so the launch grid depends only on the batch size and decode is CUDA-graph ready.
Extend sizes its grid from the CPU list of extend lengths that the ForwardBatch carries.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.base_attn_backend import (
    AttentionBackend,
    attention_chunk,
    kv_scales,
    logit_cap,
    sinks,
    sliding_window,
)
from radixserve.layers.attention.triton_ops.decode_attention import (
    ONE_LAUNCH,
    PROGRAMS_PER_SM,
    decode_attention_fwd,
    is_interpreted,
    kv_split_cap,
    new_decode_counters,
    one_launch_pays,
    split_capacity,
)
from radixserve.layers.attention.triton_ops.extend_attention import extend_attention_fwd
from radixserve.layers.triton_ops import use_fused
from radixserve.layers.triton_ops.kv_store import store_kv
from radixserve.layers.triton_ops.launch import LaunchPlan, recording

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner


def one_token_tail(extend_lens: list[int]) -> int:
    """How many requests at the end of an extend batch add one token each (a MIXED batch's decodes; a prompt's last
    single-token chunk is the same computation)."""
    n = 0
    for length in reversed(extend_lens):
        if length != 1:
            break
        n += 1
    return n


@dataclass
class TritonForwardMetadata:
    # decode
    req_pool_indices: torch.Tensor | None = None
    seq_lens: torch.Tensor | None = None
    num_kv_splits: int = 1  # splits launched per request (the kernels use fewer for short sequences)
    mid_o: torch.Tensor | None = None  # flat float32 scratch for the partial outputs (split_capacity slots each)
    mid_lse: torch.Tensor | None = None  # flat float32 scratch for the partial log-sum-exps
    counters: torch.Tensor | None = None  # int32 [>= bs, heads], all zero: merge the splits in one launch (or None)
    cuda_graph: bool = False  # the scratch and index buffers are static: never reallocate them
    # extend (over the first requests of the batch, all of them unless some are decodes at its tail)
    max_extend_len: int = 0
    extend_prefix_lens: torch.Tensor | None = None
    extend_seq_lens: torch.Tensor | None = None
    extend_start_loc: torch.Tensor | None = None
    # an extend batch whose last `tail_decodes` requests add one token each (a MIXED batch's decodes): their rows
    # run the split-KV decode kernel over the pool (req_pool_indices / seq_lens / num_kv_splits / mid_* above are
    # theirs), which reads each KV head once for its query heads where the extend kernel reads it once per head
    tail_decodes: int = 0
    tail_req_pool_indices: torch.Tensor | None = None
    tail_seq_lens: torch.Tensor | None = None
    # an extend's attention launches, recorded at its first layer and replayed by the layers after it that have the
    # same shapes and attention parameters (LaunchPlan): the same batch, so the same grids and metadata
    plans: dict = field(default_factory=dict)


class TritonAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_logit_cap = True
    supports_sinks = True  # the kernels add exp(sink - max) to the softmax sum where each output is normalised
    supports_chunked_attention = True  # a negative `window` in the kernels (triton_ops.common.first_visible)
    supports_prefill_cuda_graph = True
    replay_reads_graph_inputs = False  # its replay hook copies only buffers that are not its own
    replay_hook_only_loads_inputs = True  # and does nothing else (the kernels read the lengths on the device)

    def __init__(self, model_runner: ModelRunner, max_kv_splits: int = 64) -> None:
        self.device = torch.device(model_runner.device)
        if self.device.type != "cuda" and not is_interpreted():
            raise ValueError("the triton attention backend needs a CUDA device (or TRITON_INTERPRET=1 set before "
                             "triton kernels are imported, for tests on the CPU)")
        if max_kv_splits < 1:
            raise ValueError(f"max_kv_splits must be positive; got {max_kv_splits}")
        cfg = model_runner.model_config
        tp_size = getattr(model_runner, "attn_tp_size", None) or getattr(model_runner, "tp_size", 1) or 1
        # MLA (DeepSeek): multi-query attention over the latent pool, value/output dim = the latent rank
        self.is_mla = bool(getattr(cfg, "is_mla", False))
        if self.is_mla:
            self.num_heads, self.num_kv_heads, self.head_dim, self.v_head_dim = cfg.attention_shape(tp_size)
        else:
            self.num_heads = cfg.num_attention_heads // tp_size
            self.num_kv_heads = max(1, cfg.num_key_value_heads // tp_size)  # KV heads are replicated past tp_size
            self.head_dim = self.v_head_dim = cfg.head_dim
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.max_kv_splits = max_kv_splits
        # Tunables (plain attributes so tests can force many small splits; set them before init_cuda_graph_state).
        self.min_split_len = 64  # a request uses at most cdiv(seq_len, min_split_len) splits
        # split a small batch until stage 1 has this many programs per SM (the interpreter: 8, many splits in tests)
        self.programs_per_sm = PROGRAMS_PER_SM if self.device.type == "cuda" else 8
        if self.is_mla:  # an MLA program holds every head of the layer and the whole latent
            from radixserve.layers.attention.triton_ops import mla_attention
            self.programs_per_sm = mla_attention.PROGRAMS_PER_SM
        self.decode_block_n: int | None = None  # None: the kernel's default
        self.decode_use_dot: bool | None = None  # None: tl.dot; False: elementwise (MHA only, slower on GPUs)
        # merge a split batch's partials in stage 1's launch (counters): None where that paid (`_one_launch`),
        # True whenever there are several splits, False never
        self.decode_one_launch: bool | None = None if ONE_LAUNCH else False
        if self.device.type == "cuda":
            self.num_sms = torch.cuda.get_device_properties(self.device).multi_processor_count
        else:
            self.num_sms = 8  # the interpreter: a few splits, so tests exercise them without crawling
        self.forward_metadata: TritonForwardMetadata | None = None
        self._mid_o: torch.Tensor | None = None
        self._mid_lse: torch.Tensor | None = None
        self._cg_max_bs = 0
        self._cg_req_pool_indices: torch.Tensor | None = None
        self._cg_seq_lens: torch.Tensor | None = None
        self._cg_mid_o: torch.Tensor | None = None
        self._cg_mid_lse: torch.Tensor | None = None
        self._counters: torch.Tensor | None = None
        self._cg_counters: torch.Tensor | None = None

    # ---------------------------------------------------------------- metadata
    def _kv_split_cap(self, bs: int) -> int:
        return kv_split_cap(bs, self.num_heads, self.num_kv_heads, self.num_sms, self.max_kv_splits,
                            self.programs_per_sm, self.decode_use_dot)

    @staticmethod
    def _scratch_numel(bs: int, num_heads: int, head_dim: int, splits: int) -> tuple[int, int]:
        cap = split_capacity(splits)  # padded: the same strides for every split count (no kernel recompiles)
        return bs * num_heads * cap * head_dim, bs * num_heads * cap

    def _ensure_eager_scratch(self, bs: int, num_heads: int, head_dim: int,
                              splits: int) -> tuple[torch.Tensor, torch.Tensor]:
        n_o, n_lse = self._scratch_numel(bs, num_heads, head_dim, splits)
        mid_o, mid_lse = self._mid_o, self._mid_lse
        if mid_o is None or mid_o.numel() < n_o or mid_lse is None or mid_lse.numel() < n_lse:
            # headroom, so that a slowly growing batch does not reallocate every step
            n_o, n_lse = 2 * n_o, 2 * n_lse
            mid_o = self._mid_o = torch.empty(n_o, dtype=torch.float32, device=self.device)
            mid_lse = self._mid_lse = torch.empty(n_lse, dtype=torch.float32, device=self.device)
        return mid_o, mid_lse

    def _one_launch(self, splits: int) -> bool:
        """Whether a decode of `splits` splits a request merges them in stage 1's launch: by default only MHA / GQA
        shapes where that measured faster than stage 2 (`one_launch_pays`; never MLA, whose one program a request
        merging 16 heads of 512 took twice stage 2's time)."""
        if self.decode_one_launch is None:
            return not self.is_mla and one_launch_pays(self.num_heads // self.num_kv_heads, splits)
        return self.decode_one_launch

    def _eager_counters(self, bs: int, splits: int) -> torch.Tensor | None:
        """The one-launch counters for an eager decode of bs requests (None when it launches stage 2); zeroed
        once, and every decode launch leaves them zero."""
        if not self._one_launch(splits):
            return None
        if self._counters is None or self._counters.shape[0] < bs:
            self._counters = new_decode_counters(2 * bs, self.num_heads, self.device)  # headroom, as the scratch
        return self._counters

    def _decode_scratch(self, meta: TritonForwardMetadata, bs: int, num_heads: int,
                        head_dim: int) -> tuple[torch.Tensor, torch.Tensor]:
        """The split-KV partials (mid_o [bs, heads, cap, head_dim], mid_lse [bs, heads, cap]) for a decode layer:
        views of the batch's scratch (the CUDA-graph state's, which must be large enough, or the eager one)."""
        splits = meta.num_kv_splits
        n_o, n_lse = self._scratch_numel(bs, num_heads, head_dim, splits)
        if meta.mid_o is None or meta.mid_lse is None or meta.mid_o.numel() < n_o or meta.mid_lse.numel() < n_lse:
            if meta.cuda_graph:
                raise RuntimeError("decode scratch of the CUDA-graph state is too small for this layer")
            meta.mid_o, meta.mid_lse = self._ensure_eager_scratch(bs, num_heads, head_dim, splits)
        cap = split_capacity(splits)
        return meta.mid_o[:n_o].view(bs, num_heads, cap, head_dim), meta.mid_lse[:n_lse].view(bs, num_heads, cap)

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        mode = forward_batch.forward_mode
        bs = forward_batch.batch_size
        if mode.is_decode():
            splits = self._kv_split_cap(bs)
            mid_o, mid_lse = self._ensure_eager_scratch(bs, self.num_heads, self.v_head_dim, splits)
            self.forward_metadata = TritonForwardMetadata(
                req_pool_indices=forward_batch.req_pool_indices, seq_lens=forward_batch.seq_lens,
                num_kv_splits=splits, mid_o=mid_o, mid_lse=mid_lse, counters=self._eager_counters(bs, splits))
            return
        if bs == 0 or not mode.is_extend():
            self.forward_metadata = TritonForwardMetadata()
            return
        if forward_batch.extend_seq_lens_cpu is None or forward_batch.extend_seq_lens is None \
                or forward_batch.extend_prefix_lens is None or forward_batch.extend_start_loc is None:
            raise ValueError("an extend ForwardBatch needs extend_seq_lens(_cpu), extend_prefix_lens and "
                             "extend_start_loc")
        lens = forward_batch.extend_seq_lens_cpu
        tail = 0 if self.is_mla or mode.is_target_verify() else one_token_tail(lens)
        head = bs - tail
        meta = TritonForwardMetadata(
            req_pool_indices=forward_batch.req_pool_indices[:head], seq_lens=forward_batch.seq_lens[:head],
            max_extend_len=max(lens[:head], default=0),
            extend_prefix_lens=forward_batch.extend_prefix_lens[:head],
            extend_seq_lens=forward_batch.extend_seq_lens[:head],
            extend_start_loc=forward_batch.extend_start_loc[:head], tail_decodes=tail)
        if tail:
            # copies, not views: a view starting at an odd index is not 16-byte aligned, and the decode kernel would
            # compile a variant of its own for it the first time (Triton specialises on pointer alignment)
            meta.tail_req_pool_indices = forward_batch.req_pool_indices[head:].clone()
            meta.tail_seq_lens = forward_batch.seq_lens[head:].clone()
            meta.num_kv_splits = self._kv_split_cap(tail)
            meta.mid_o, meta.mid_lse = self._ensure_eager_scratch(tail, self.num_heads, self.v_head_dim,
                                                                  meta.num_kv_splits)
            meta.counters = self._eager_counters(tail, meta.num_kv_splits)
        self.forward_metadata = meta

    # ---------------------------------------------------------------- CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int) -> None:
        if max_bs < 1:
            raise ValueError(f"max_bs must be positive; got {max_bs}")
        self._cg_max_bs = max_bs
        self._cg_req_pool_indices = torch.zeros(max_bs, dtype=torch.int64, device=self.device)
        self._cg_seq_lens = torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(), dtype=torch.int64,
                                       device=self.device)
        # every captured batch size shares one scratch, sized for the largest bs * splits among them
        worst = max(bs * split_capacity(self._kv_split_cap(bs)) for bs in range(1, max_bs + 1))
        n_o, n_lse = worst * self.num_heads * self.v_head_dim, worst * self.num_heads
        self._cg_mid_o = torch.empty(n_o, dtype=torch.float32, device=self.device)
        self._cg_mid_lse = torch.empty(n_lse, dtype=torch.float32, device=self.device)
        # the graphs' own counters: never reallocated (the eager ones grow with the batch)
        self._cg_counters = new_decode_counters(max_bs, self.num_heads, self.device)

    def cuda_graph_input_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        if self._cg_req_pool_indices is None or self._cg_seq_lens is None:
            return None
        return self._cg_req_pool_indices, self._cg_seq_lens

    def _load_cuda_graph_inputs(self, bs: int, req_pool_indices: torch.Tensor,
                                seq_lens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        rpi, sl = self._cg_req_pool_indices, self._cg_seq_lens
        if rpi is None or sl is None:
            raise RuntimeError("call init_cuda_graph_state(max_bs) before capturing or replaying a CUDA graph")
        if not 1 <= bs <= self._cg_max_bs:
            raise ValueError(f"CUDA-graph batch size {bs} is outside 1..{self._cg_max_bs}")
        # Copy into buffers this backend owns, so the captured kernels read the same addresses at every replay
        # whatever tensors the caller hands in. Rows the caller does not give are padding.
        n = min(bs, req_pool_indices.shape[0], seq_lens.shape[0])
        if req_pool_indices.data_ptr() != rpi.data_ptr():  # the runner may have filled these very buffers
            rpi[:n].copy_(req_pool_indices[:n], non_blocking=True)
        if seq_lens.data_ptr() != sl.data_ptr():
            sl[:n].copy_(seq_lens[:n], non_blocking=True)
        if n < bs:
            rpi[n:bs].zero_()
            sl[n:bs].fill_(self.get_cuda_graph_seq_len_fill_value())
        return rpi, sl

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        rpi, sl = self._load_cuda_graph_inputs(bs, req_pool_indices, seq_lens)
        splits = self._kv_split_cap(bs)
        self.forward_metadata = TritonForwardMetadata(
            req_pool_indices=rpi[:bs], seq_lens=sl[:bs], num_kv_splits=splits, mid_o=self._cg_mid_o,
            mid_lse=self._cg_mid_lse, counters=self._cg_counters if self._one_launch(splits) else None,
            cuda_graph=True)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                seq_lens_cpu: list[int] | None = None) -> None:
        """`bs` is the captured graph's (padded) batch size; the graph itself reads the buffers filled here."""
        self._load_cuda_graph_inputs(bs, req_pool_indices, seq_lens)

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        return 1

    # ---------------------------------------------------------------- forward
    def _metadata(self) -> TritonForwardMetadata:
        if self.forward_metadata is None:
            raise RuntimeError("init_forward_metadata must run before the attention layers")
        return self.forward_metadata

    @staticmethod
    def _heads(t: torch.Tensor, num_heads: int, head_dim: int) -> torch.Tensor:
        t = t.reshape(-1, num_heads, head_dim)
        return t if t.stride(-1) == 1 else t.contiguous()

    def _save_kv(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                 forward_batch: ForwardBatch) -> None:
        if use_fused(k):  # one kernel for K and V, reading them through their strides
            k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            store_kv(k_buf, v_buf, forward_batch.out_cache_loc, k, v, *kv_scales(layer))
            return
        forward_batch.token_to_kv_pool.set_kv_buffer(
            layer.layer_id, forward_batch.out_cache_loc,
            k.reshape(-1, layer.tp_k_head_num, layer.head_dim), v.reshape(-1, layer.tp_v_head_num, layer.head_dim),
            *kv_scales(layer))

    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        meta = self._metadata()
        if self.is_mla:
            return self._mla_extend(q, k, layer, forward_batch, meta, save_kv_cache)
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        if save_kv_cache:
            self._save_kv(k, v, layer, forward_batch)
        q3 = self._heads(q, num_heads, head_dim)
        k3 = self._heads(k, layer.tp_k_head_num, head_dim)
        v3 = self._heads(v, layer.tp_v_head_num, head_dim)
        o = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        rows = q3.shape[0] - meta.tail_decodes  # the extend requests' rows come first
        sk = sinks(layer)  # (a parameter: each layer's own, swapped in by a replayed plan as the other tensors)
        tensors = (q3[:rows], k3[:rows], v3[:rows], o[:rows], q3[rows:], o[rows:], k_buf, v_buf) + (
            () if sk is None else (sk,))
        # what decides the launches besides those tensors' addresses: a layer that matches an earlier layer of this
        # batch replays its launches (the host work of a layer's attention is several times its GPU time for a
        # small batch, and eager attention runs between the pieces of a piecewise graph)
        key = (q3.shape, q3.stride(), k3.shape, k3.stride(), v3.stride(), q.dtype, k_buf.dtype, k_buf.stride(),
               v_buf.stride(), layer.scaling, kv_scales(layer), sliding_window(layer), attention_chunk(layer),
               logit_cap(layer), sk is None)
        plan = meta.plans.get(key)
        if plan is not None:
            plan.replay(tensors)
            return o.view(-1, num_heads * head_dim)
        with recording() as launches:
            if rows > 0 and meta.max_extend_len > 0:
                extend_attention_fwd(
                    tensors[0], tensors[1], tensors[2], tensors[3], k_buf, v_buf, self.req_to_token,
                    meta.req_pool_indices, meta.extend_prefix_lens, meta.extend_seq_lens, meta.extend_start_loc,
                    meta.max_extend_len, layer.scaling, k_scale=kv_scales(layer)[0], v_scale=kv_scales(layer)[1],
                    sliding_window=sliding_window(layer), logit_cap=logit_cap(layer), sinks=sk,
                    attention_chunk=attention_chunk(layer))
            if meta.tail_decodes:  # their K/V went into the pool above (or before, when save_kv_cache is off)
                self._decode_rows(tensors[4], tensors[5], layer, forward_batch, meta, meta.tail_req_pool_indices,
                                  meta.tail_seq_lens, sk)
        meta.plans[key] = LaunchPlan(launches, tensors)
        return o.view(-1, num_heads * head_dim)

    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        meta = self._metadata()
        if meta.seq_lens is None or meta.req_pool_indices is None:
            raise RuntimeError("decode metadata missing: was init_forward_metadata called for a decode batch?")
        num_heads, head_dim = layer.tp_q_head_num, layer.head_dim
        if self.is_mla:
            return self._mla_decode(q, k, layer, forward_batch, meta, save_kv_cache)
        if save_kv_cache:
            self._save_kv(k, v, layer, forward_batch)
        q3 = self._heads(q, num_heads, head_dim)
        bs = q3.shape[0]
        if bs != meta.seq_lens.shape[0]:
            raise ValueError(f"decode got {bs} query rows for a batch of {meta.seq_lens.shape[0]}")
        o = torch.empty(q3.shape, dtype=q.dtype, device=q.device)
        self._decode_rows(q3, o, layer, forward_batch, meta, meta.req_pool_indices, meta.seq_lens, sinks(layer))
        return o.view(-1, num_heads * head_dim)

    def _decode_rows(self, q3: torch.Tensor, o: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch,
                     meta: TritonForwardMetadata, req_pool_indices: torch.Tensor, seq_lens: torch.Tensor,
                     sk: torch.Tensor | None) -> None:
        """Split-KV decode of one query row per request over the pool, into `o` [bs, H, D] (with the layer's
        attention sinks `sk`, if any)."""
        mid_o, mid_lse = self._decode_scratch(meta, q3.shape[0], layer.tp_q_head_num, layer.head_dim)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        decode_attention_fwd(
            q3, k_buf, v_buf, o, self.req_to_token, req_pool_indices, seq_lens, mid_o, mid_lse,
            layer.scaling, min_split_len=self.min_split_len, block_n=self.decode_block_n,
            use_dot=self.decode_use_dot, num_kv_splits=meta.num_kv_splits, k_scale=kv_scales(layer)[0],
            v_scale=kv_scales(layer)[1], sliding_window=sliding_window(layer), counters=meta.counters,
            logit_cap=logit_cap(layer), sinks=sk, attention_chunk=attention_chunk(layer))

    # ---------------------------------------------------------------- MLA (latent pool)
    def _mla_store(self, k: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> None:
        forward_batch.token_to_kv_pool.set_kv_buffer(layer.layer_id, forward_batch.out_cache_loc,
                                                     k.reshape(-1, 1, layer.head_dim), None)

    def _mla_extend(self, q: torch.Tensor, k: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch,
                    meta: TritonForwardMetadata, save_kv_cache: bool) -> torch.Tensor:
        from radixserve.layers.attention.triton_ops.mla_attention import mla_extend_fwd

        _no_mla_sinks(layer)

        if save_kv_cache:  # the kernel reads the new tokens' latents from the pool, with the prefix's
            self._mla_store(k, layer, forward_batch)
        q3 = self._heads(q, layer.tp_q_head_num, layer.head_dim)
        o = torch.empty((q3.shape[0], layer.tp_q_head_num, layer.v_head_dim), dtype=q.dtype, device=q.device)
        if q3.shape[0] and meta.max_extend_len:
            kv_buf, _ = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
            mla_extend_fwd(q3, kv_buf, o, self.req_to_token, meta.req_pool_indices, meta.extend_prefix_lens,
                           meta.extend_seq_lens, meta.extend_start_loc, meta.max_extend_len, layer.scaling,
                           layer.v_head_dim)
        return o.view(-1, layer.tp_q_head_num * layer.v_head_dim)

    def _mla_decode(self, q: torch.Tensor, k: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch,
                    meta: TritonForwardMetadata, save_kv_cache: bool) -> torch.Tensor:
        from radixserve.layers.attention.triton_ops.mla_attention import mla_decode_fwd

        _no_mla_sinks(layer)

        if save_kv_cache:
            self._mla_store(k, layer, forward_batch)
        num_heads, dv = layer.tp_q_head_num, layer.v_head_dim
        q3 = self._heads(q, num_heads, layer.head_dim)
        bs = q3.shape[0]
        o = torch.empty((bs, num_heads, dv), dtype=q.dtype, device=q.device)
        splits = meta.num_kv_splits
        mid_o, mid_lse = self._decode_scratch(meta, bs, num_heads, dv)
        kv_buf, _ = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        mla_decode_fwd(q3, kv_buf, o, self.req_to_token, meta.req_pool_indices, meta.seq_lens, mid_o, mid_lse,
                       layer.scaling, dv, splits, min_split_len=self.min_split_len, counters=meta.counters)
        return o.view(-1, num_heads * dv)


def _no_mla_sinks(layer: RadixAttention) -> None:
    if sinks(layer) is not None:
        raise ValueError("the triton backend's MLA kernels take no attention sinks (no MLA model has them)")
