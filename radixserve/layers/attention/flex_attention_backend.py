"""FlexAttention (torch.nn.attention.flex_attention) over the paged KV pool, without copying K/V.

The pool's K/V buffers [slots, Hkv, D] are the keys and values of one long "sequence" (viewed [1, Hkv, slots, D]).
A block mask lists, for each block of queries, the KV blocks (runs of `kv_block` physical slots) its requests'
tokens live in, read from the request table (with --page-size a multiple of the block, a request's blocks are its
pages); its mask_mod admits a slot for a query only if the slot really holds a key the query may see:

    kp = slot_pos[slot]                          the position whose KV the slot holds (written with the KV)
    req_to_token[row(q), kp] == slot             ... in the query's own request (another request's slot, a stale
                                                 or free slot in a listed block fails here)
    kp <= pos(q)                                 causal, which also covers the cached prefix
    kp > pos(q) - window                         sliding window (layers that have one)
    kp >= (pos(q) // chunk) * chunk              chunked attention (Llama 4's chunked layers)

Extend flattens all the batch's new tokens into one query sequence (blocks of `q_block` tokens; a block that spans
several requests lists the union of their KV blocks, each request cut to what its queries can see). Decode puts
one request per batch row (query length 1, the KV batch broadcast) and runs a power-of-two number of rows (capped
at the largest captured batch), so a handful of compiled kernels serve every batch size, each split over the GPU
for its row count. Decode runs in CUDA graphs: the first attention layer of the captured forward rebuilds the
graph's block lists from the request table with one Triton kernel (`triton_ops/flex_blocks.py`, loops bounded by the
rows' lengths read on the GPU), so a replay does no host work beyond loading the graph's inputs. Eager decode (past
the largest graph, or on a CPU without the Triton interpreter) builds the same lists with torch ops
(`_fill_decode_meta`, also the kernel's test reference).

On CUDA the calls go through torch.compile (fused Triton kernels; the decode rows take the flex-decoding kernel);
on the CPU flex_attention runs eagerly, which materialises the scores over every slot of the pool (tests only).
"""

from __future__ import annotations

import warnings
from typing import TYPE_CHECKING, Any

import numpy as np
import torch
from torch.nn.attention.flex_attention import BlockMask, flex_attention

try:
    from torch.nn.attention.flex_attention import AuxRequest as _AuxRequest
except ImportError:  # older torch: return_lse=True
    _AuxRequest = None

from radixserve.layers.attention.base_attn_backend import (
    AttentionBackend,
    attention_layers,
    first_key,
    kv_scales,
    local_window,
    logit_cap,
    scale_by_sinks,
    sinks,
    value_head_dim,
)
from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted
from radixserve.mem_cache.memory_pool import is_fp8

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner

# the eager CPU path warns once per process that it is not fused; that is expected here
warnings.filterwarnings("ignore", message=".*flex_attention called without torch.compile")


def _block_mask(num: torch.Tensor, idx: torch.Tensor, block: tuple[int, int], mask_mod: Any,
                lengths: tuple[int, int]) -> BlockMask:
    try:
        return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=lengths,
                                        compute_q_blocks=False)
    except TypeError:  # older torch: no compute_q_blocks
        return BlockMask.from_kv_blocks(num, idx, BLOCK_SIZE=block, mask_mod=mask_mod, seq_lengths=lengths)


class FlexAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_logit_cap = True  # as a score_mod
    supports_sinks = True  # flex's log-sum-exp (natural log) scales the output: out * sigmoid(lse - sink)
    supports_chunked_attention = True
    q_block = 128  # extend: queries per block
    kv_block_extend = 128  # extend: physical slots per KV block
    kv_block_decode = 16  # decode: physical slots per KV block

    def __init__(self, model_runner: ModelRunner) -> None:
        cfg = model_runner.model_config
        if getattr(cfg, "is_mla", False):
            raise ValueError("attention backend 'flex' does not serve MLA models; use triton, torch_native "
                             "or (on the CPU) cpu")
        pool = model_runner.token_to_kv_pool
        if is_fp8(pool.dtype):
            raise ValueError("attention backend 'flex' reads the KV pool in the model dtype; --kv-cache-dtype fp8 "
                             "needs triton, torch_native or (on the CPU) cpu")
        self.device = torch.device(model_runner.device)
        self.is_cuda = self.device.type == "cuda"
        self.req_to_token = model_runner.req_to_token_pool.req_to_token
        self.page_size = pool.page_size
        self.num_slots = pool.k_buffer[0].shape[0]
        kb = max(self.kv_block_decode, self.kv_block_extend)
        # slot -> the position whose KV it holds (-1: never written); padded so every slot of a listed block exists,
        # plus a last entry that takes the writes of padded decode rows
        self.dump = -(-self.num_slots // kb) * kb
        self.slot_pos = torch.full((self.dump + 1,), -1, dtype=torch.int64, device=self.device)
        # the layers' windows as `local_window` gives them (0: full attention, W > 0: sliding, -C: chunks of C),
        # known from the model so that CUDA-graph capture builds a mask for each before any request has run; a
        # window first seen in an extend is added there
        self.windows: set[int] = {0} | {w for w in getattr(cfg, "sliding_windows", None) or () if w > 0} | {
            local_window(m) for m in attention_layers(model_runner)}
        self._flex_extend: Any = flex_attention
        self._flex_decode: Any = flex_attention
        if self.is_cuda:
            import torch._dynamo as dynamo

            for name in ("recompile_limit", "cache_size_limit"):  # eager decode compiles per row bucket
                if hasattr(dynamo.config, name):
                    setattr(dynamo.config, name, max(64, getattr(dynamo.config, name)))
            self._flex_extend = torch.compile(flex_attention, dynamic=True)
            self._flex_decode = torch.compile(flex_attention, dynamic=False)
        else:
            # the unfused reference implementation, called directly (by default each eager call is traced by dynamo
            # first, which costs seconds per new shape on a CPU and buys nothing there)
            import torch.nn.attention.flex_attention as flex_module

            flex_module._FLEX_ATTENTION_DISABLE_COMPILE_DEBUG = True
        self._meta: dict[str, Any] | None = None
        self._cap_mods: dict[float, Any] = {}  # soft-capping score_mods, one per cap (compiled once each)
        # static decode metadata of the captured graphs, one set per row bucket; None: no graphs
        self._graphs: dict[int, dict[str, Any]] | None = None
        self._graph_max_bs = 0
        self._use_graph_meta = False
        self._longest: int | None = None
        # graphs build their block lists inside the graph (a Triton kernel at the forward's first attention layer)
        self._fill_in_graph = self.is_cuda or is_interpreted()
        self._graph_inputs: tuple[torch.Tensor, torch.Tensor] | None = None
        self._fill_layer: int | None = None
        # with the lists built in the graph the replay hook has nothing to do: the graph runner then loads each batch
        # into this backend's own input buffers from inside the graph (its input kernel first) and skips the hook
        self.replay_reads_graph_inputs = not self._fill_in_graph
        self.replay_hook_only_loads_inputs = self._fill_in_graph
        self._cg_inputs: tuple[torch.Tensor, torch.Tensor] | None = None

    # ---------------------------------------------------------------- metadata
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._use_graph_meta = False
        self._meta = None
        if forward_batch.forward_mode.is_decode():
            # built by the first layer if this batch runs eagerly; a graph replay refreshes the graphs' own set and
            # only takes the longest row from here (its hook gets no host lengths)
            lens = forward_batch.seq_lens_cpu
            self._longest = max(lens) if lens else None
            return
        self._meta = self._extend_meta(forward_batch)

    def _eager_decode_meta(self, forward_batch: ForwardBatch) -> dict[str, Any]:
        rows = self._rows(forward_batch.batch_size)
        meta = self._new_decode_meta(rows, self._decode_width(rows))
        longest = self._longest if self._longest is not None else int(forward_batch.seq_lens.max())
        self._fill_decode_meta(meta, forward_batch.req_pool_indices, forward_batch.seq_lens, longest)
        return meta

    def _rows(self, bs: int) -> int:
        """Decode rows run for a batch of bs: the next power of two (capped at the largest captured batch), so a
        handful of compiled kernels serve every batch size, each split over the GPU for its own row count."""
        rows = 1 << (bs - 1).bit_length()
        return min(rows, self._graph_max_bs) if bs <= self._graph_max_bs else rows

    def _decode_width(self, rows: int) -> int:
        """Most KV blocks one decode row may list."""
        kb = self.kv_block_decode
        if self.page_size % kb:  # a row's tokens may each sit in a block of its own (decode interleaves requests)
            return min(self.req_to_token.shape[1], -(-self.num_slots // kb))
        return min(-(-self.req_to_token.shape[1] // kb) + 1, -(-self.num_slots // kb))

    def _new_decode_meta(self, rows: int, width: int) -> dict[str, Any]:
        dev = self.device
        meta: dict[str, Any] = {"rows": rows, "width": width,
                                "row": torch.zeros(rows, dtype=torch.int64, device=dev),
                                "pos": torch.full((rows,), -1, dtype=torch.int64, device=dev), "masks": {}}
        if self._fill_in_graph and self.page_size % self.kv_block_decode:
            # the kernel's per-row block marks (zero between fills)
            meta["bitmap"] = torch.zeros((rows, self.dump // self.kv_block_decode), dtype=torch.int8, device=dev)
        for w in sorted(self.windows):
            self._add_window(meta, w)
        return meta

    def _fill_decode_meta_kernel(self, meta: dict[str, Any], rows: torch.Tensor, seq_lens: torch.Tensor) -> None:
        """`_fill_decode_meta` in one Triton launch per window, with no host work (captured in the graphs)."""
        from radixserve.layers.attention.triton_ops.flex_blocks import fill_decode_blocks

        kb = self.kv_block_decode
        for i, (window, (num, idx, _)) in enumerate(sorted(meta["masks"].items())):
            fill_decode_blocks(rows, seq_lens, self.req_to_token, self.slot_pos, meta["row"], meta["pos"],
                               num.view(-1), idx.view(idx.shape[0], -1), meta.get("bitmap"), window, kb,
                               self.page_size % kb == 0, write_pos=i == 0)

    def _add_window(self, meta: dict[str, Any], window: int) -> None:
        rows, width, dev = meta["rows"], meta["width"], self.device
        num = torch.zeros((rows, 1, 1), dtype=torch.int32, device=dev)
        idx = torch.zeros((rows, 1, 1, width), dtype=torch.int32, device=dev)
        mask_mod = self._decode_mask_mod(meta["row"], meta["pos"], window)
        meta["masks"][window] = (num, idx, _block_mask(num, idx, (self.q_block, self.kv_block_decode), mask_mod,
                                                       (1, self.num_slots)))

    def _decode_mask_mod(self, row: torch.Tensor, pos: torch.Tensor, window: int) -> Any:
        slot_pos, table = self.slot_pos, self.req_to_token

        def mask_mod(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
            kp = slot_pos[kv_idx]
            p = pos[b]
            ok = (kp >= 0) & (kp <= p) & (table[row[b], kp.clamp(min=0)] == kv_idx)
            if window:
                ok = ok & (kp >= first_key(p, window))
            return ok

        return mask_mod

    def _fill_decode_meta(self, meta: dict[str, Any], rows: torch.Tensor, seq_lens: torch.Tensor,
                          longest: int) -> None:
        """Refresh a decode metadata set in place (tensor ops only: also between graph replays). Rows with
        seq_len < 2 are padding (a decode row has at least its prompt token and the new one): they list nothing."""
        bs = rows.numel()
        seq = seq_lens.to(torch.int64)
        real = seq >= 2
        pos = torch.where(real, seq - 1, -1)
        meta["row"][:bs].copy_(rows)
        meta["row"][bs:].zero_()
        meta["pos"][:bs].copy_(pos)
        meta["pos"][bs:].fill_(-1)
        # the new tokens' slots now hold their positions (padding rows write the dump entry)
        new_slot = self.req_to_token[rows, (seq - 1).clamp(min=0)].to(torch.int64)
        self.slot_pos[torch.where(real, new_slot, self.dump)] = pos
        kb = self.kv_block_decode
        for window, (num, idx, _) in meta["masks"].items():
            num[bs:].zero_()
            first = first_key(seq - 1, window).clamp(min=0)  # the first visible position
            if self.page_size % kb == 0:
                # pages are whole blocks: a row's blocks are the blocks of its positions 0, kb, 2kb, ...
                width = min(meta["width"], -(-longest // kb) + 1)
                b0 = first // kb
                n = torch.where(real, (seq + kb - 1) // kb - b0, 0)
                cols = ((b0[:, None] + torch.arange(width, device=self.device)) * kb).clamp(
                    max=self.req_to_token.shape[1] - 1)
                blocks = self.req_to_token[rows[:, None], cols] // kb
                num[:bs, 0, 0] = n.to(torch.int32)
                idx[:bs, 0, 0, :width] = blocks.to(torch.int32)
                continue
            # any other page size: the distinct blocks of each row's slots (sorted, first occurrences compacted)
            length = max(1, min(longest, self.req_to_token.shape[1]))
            cols = torch.arange(length, device=self.device)
            valid = (cols[None, :] < seq[:, None]) & (cols[None, :] >= first[:, None]) & real[:, None]
            big = self.dump // kb + 1
            blocks = torch.where(valid, self.req_to_token[rows[:, None], cols[None, :]].to(torch.int64) // kb, big)
            blocks, _ = blocks.sort(dim=1)
            new = torch.ones_like(blocks, dtype=torch.bool)
            new[:, 1:] = blocks[:, 1:] != blocks[:, :-1]
            new &= blocks != big
            dest = torch.where(new, new.cumsum(1) - 1, length)
            packed = torch.zeros((bs, length + 1), dtype=torch.int64, device=self.device)
            packed.scatter_(1, dest, blocks)
            take = min(length, meta["width"])
            num[:bs, 0, 0] = new.sum(1).to(torch.int32)
            idx[:bs, 0, 0, :take] = packed[:, :take].to(torch.int32)

    def _extend_meta(self, forward_batch: ForwardBatch) -> dict[str, Any]:
        """Extend (and mixed / verify) metadata, built on the host from the request table (one device read)."""
        pre = forward_batch.extend_prefix_lens_cpu
        ext = forward_batch.extend_seq_lens_cpu
        rows_t = forward_batch.req_pool_indices
        total = sum(ext)
        qb, kb = self.q_block, self.kv_block_extend
        n_qblocks = max(1, -(-total // qb))
        padded = n_qblocks * qb
        self.slot_pos[forward_batch.out_cache_loc] = forward_batch.positions
        seq = [p + e for p, e in zip(pre, ext, strict=True)]
        longest = max(seq) if seq else 1
        slots = self.req_to_token[rows_t, :longest].to(torch.int64).cpu().numpy()
        row_of = np.repeat(np.arange(len(ext)), ext)
        starts = np.concatenate([[0], np.cumsum(ext)[:-1]]).astype(np.int64) if ext else np.zeros(0, np.int64)
        q_req = torch.zeros(padded, dtype=torch.int64)
        q_pos = torch.full((padded,), -1, dtype=torch.int64)
        if total:
            q_req[:total] = forward_batch.req_pool_indices.cpu()[torch.from_numpy(row_of)]
            q_pos[:total] = forward_batch.positions.cpu()
        meta: dict[str, Any] = {"row": q_req.to(self.device), "pos": q_pos.to(self.device), "masks": {},
                                "total": total, "padded": padded}
        for window in sorted(self.windows):
            lists: list[np.ndarray] = []
            for j in range(n_qblocks):
                lo, hi = j * qb, min(total, (j + 1) * qb)
                parts = []
                if hi > lo:
                    for i in range(int(row_of[lo]), int(row_of[hi - 1]) + 1):
                        a = pre[i] + max(lo, starts[i]) - starts[i]  # positions of this block's queries of req i
                        b = pre[i] + min(hi, starts[i] + ext[i]) - 1 - starts[i]
                        if b < a:
                            continue
                        first = max(0, first_key(a, window))
                        parts.append(slots[i, first:b + 1] // kb)
                lists.append(np.unique(np.concatenate(parts)) if parts else np.zeros(0, np.int64))
            width = max(1, max(len(x) for x in lists))
            idx = np.zeros((1, 1, n_qblocks, width), dtype=np.int32)
            for j, x in enumerate(lists):
                idx[0, 0, j, :len(x)] = x
            num = torch.tensor([len(x) for x in lists], dtype=torch.int32).view(1, 1, n_qblocks)
            num, idx_t = num.to(self.device), torch.from_numpy(idx).to(self.device)
            mask_mod = self._decode_mask_mod(meta["row"], meta["pos"], window)
            meta["masks"][window] = (num, idx_t, _block_mask(num, idx_t, (qb, kb), _as_query_mask(mask_mod),
                                                             (padded, self.num_slots)))
        return meta

    def _score_mod(self, layer: RadixAttention) -> Any:
        """None, or the soft-capping of a layer with logit_cap (cap * tanh(score / cap), score already scaled)."""
        cap = logit_cap(layer)
        if cap <= 0:
            return None
        if cap not in self._cap_mods:
            def soft_cap(score, b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202 - flex_attention's signature
                return torch.tanh(score / cap) * cap

            self._cap_mods[cap] = soft_cap
        return self._cap_mods[cap]

    # ---------------------------------------------------------------- CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self._graphs, self._graph_max_bs = {}, max_bs
        if self._fill_in_graph:
            self._cg_inputs = (torch.zeros(max_bs, dtype=torch.int64, device=self.device),
                               torch.full((max_bs,), self.get_cuda_graph_seq_len_fill_value(), dtype=torch.int64,
                                          device=self.device))

    def cuda_graph_input_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        return self._cg_inputs

    def _graph_meta(self, bs: int) -> dict[str, Any]:
        if self._graphs is None:
            raise RuntimeError("init_cuda_graph_state must run before a capture or replay")
        rows = self._rows(bs)
        if rows not in self._graphs:
            self._graphs[rows] = self._new_decode_meta(rows, self._decode_width(rows))
        return self._graphs[rows]

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        meta = self._graph_meta(bs)
        self._meta = meta
        self._longest = None
        self._use_graph_meta = True
        if self._fill_in_graph:  # the captured forward's first attention layer fills the lists
            self._graph_inputs = (req_pool_indices, seq_lens)
            self._fill_layer = None
        else:
            self._fill_decode_meta(meta, req_pool_indices, seq_lens, 1)

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                seq_lens_cpu: list[int] | None = None) -> None:
        if self._fill_in_graph:
            return  # the graph rebuilds its block lists itself, from the input buffers it was captured with
        # the batch's longest row (seq_lens_sum bounds it where the host lengths were not given)
        longest = self._longest if self._longest is not None else seq_lens_sum
        self._fill_decode_meta(self._graph_meta(bs), req_pool_indices, seq_lens, longest)

    # ---------------------------------------------------------------- forward
    def _save(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> None:
        forward_batch.token_to_kv_pool.set_kv_buffer(
            layer.layer_id, forward_batch.out_cache_loc, k.view(-1, layer.tp_k_head_num, layer.head_dim),
            v.view(-1, layer.tp_v_head_num, value_head_dim(layer)), *kv_scales(layer))

    def _kv(self, layer: RadixAttention, forward_batch: ForwardBatch) -> tuple[torch.Tensor, torch.Tensor]:
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        return k_buf.permute(1, 0, 2).unsqueeze(0), v_buf.permute(1, 0, 2).unsqueeze(0)  # [1, Hkv, slots, D]

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        window = local_window(layer)
        if window not in self._meta["masks"]:
            self.windows.add(window)
            self._meta = self._extend_meta(forward_batch)
        meta = self._meta
        h, d, dv = layer.tp_q_head_num, layer.head_dim, value_head_dim(layer)
        total, padded = meta["total"], meta["padded"]
        qq = q.view(total, h, d)
        if padded != total:
            qq = torch.cat([qq, qq.new_zeros(padded - total, h, d)])
        kk, vv = self._kv(layer, forward_batch)
        out = _flex_call(self._flex_extend, layer, qq.transpose(0, 1).unsqueeze(0), kk, vv,
                         block_mask=meta["masks"][window][2], scale=layer.scaling,
                         enable_gqa=h != layer.tp_k_head_num, score_mod=self._score_mod(layer))
        return out[0, :, :total].transpose(0, 1).reshape(total, h * dv)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        window = local_window(layer)
        if self._meta is None:
            self._meta = self._eager_decode_meta(forward_batch)
        meta = self._meta
        if self._use_graph_meta and self._graph_inputs is not None:
            if self._fill_layer is None:
                self._fill_layer = layer.layer_id
            if layer.layer_id == self._fill_layer:
                self._fill_decode_meta_kernel(meta, *self._graph_inputs)
        if window not in meta["masks"]:
            if self._use_graph_meta:
                raise RuntimeError(f"flex backend: window {window} was not seen before the capture")
            self.windows.add(window)
            meta = self._meta = self._eager_decode_meta(forward_batch)
        h, d, dv = layer.tp_q_head_num, layer.head_dim, value_head_dim(layer)
        bs, rows = forward_batch.batch_size, meta["rows"]
        if rows == bs:
            qq = q.view(bs, h, 1, d)
        else:  # rows past the batch list no blocks; their queries only need to be finite
            qq = q.new_zeros(rows, h, 1, d)
            qq[:bs] = q.view(bs, h, 1, d)
        kk, vv = self._kv(layer, forward_batch)
        out = _flex_call(self._flex_decode, layer, qq, kk, vv, block_mask=meta["masks"][window][2],
                         scale=layer.scaling, enable_gqa=h != layer.tp_k_head_num, score_mod=self._score_mod(layer))
        return out[:bs, :, 0].reshape(bs, h * dv)


def _as_query_mask(mask_mod: Any) -> Any:
    """The decode mask_mod reads a row's request and position by batch index; extend reads them by query index."""
    def by_query(b, h, q_idx, kv_idx):  # noqa: ANN001, ANN202
        return mask_mod(q_idx, h, q_idx, kv_idx)

    return by_query


def _flex_call(flex: Any, layer: RadixAttention, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
               **kwargs: Any) -> torch.Tensor:
    """flex(q, k, v, **kwargs) [B, H, L, Dv]; for a layer with attention sinks also its log-sum-exps (natural log:
    flex_attention converts its kernels' base-2 statistics), with which each sink joins the softmax afterwards."""
    sink = sinks(layer)
    if sink is None:
        return flex(q, k, v, **kwargs)
    if _AuxRequest is not None:
        out, aux = flex(q, k, v, return_aux=_AuxRequest(lse=True), **kwargs)
        lse = aux.lse
    else:  # older torch
        out, lse = flex(q, k, v, return_lse=True, **kwargs)
    return scale_by_sinks(out, lse, sink)
