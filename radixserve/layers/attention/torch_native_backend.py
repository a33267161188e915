"""Pure-PyTorch attention: scaled_dot_product_attention over each request's gathered KV. Runs anywhere; the
reference the other backends are tested against.

Decode is also captured in CUDA graphs: the captured decode gathers a fixed GRAPH_MAX_SEQ_LEN columns of each row
(masked past its length) in groups of static size, reading nothing on the host; a batch with a longer sequence runs
eagerly (`cuda_graph_max_seq_len`)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch

from radixserve.layers.attention.base_attn_backend import (
    AttentionBackend,
    capped_attention,
    first_key,
    kv_scales,
    local_window,
    logit_cap,
    sinks,
    value_head_dim,
)
from radixserve.mem_cache.memory_pool import gather_kv, load_kv_values

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner


DECODE_GROUP_ELEMENTS = 1 << 22  # padded key positions × KV heads gathered per decode SDPA call
GRAPH_MAX_SEQ_LEN = 4096  # key positions a captured decode reads per row


class TorchNativeAttnBackend(AttentionBackend):
    supports_cuda_graph = True
    supports_logit_cap = True
    supports_sinks = True
    supports_chunked_attention = True

    def __init__(self, model_runner: ModelRunner) -> None:
        self.device = model_runner.device
        self.graph_width = min(GRAPH_MAX_SEQ_LEN, model_runner.req_to_token_pool.req_to_token.shape[1])
        self._static = False  # the forward being run is a graph capture

    # ---------------------------------------------------------------- CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int) -> None:
        self._static = False

    def cuda_graph_max_seq_len(self) -> int | None:
        return self.graph_width

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        self._static = True

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                seq_lens_cpu: list[int] | None = None) -> None:
        pass  # the captured decode reads the graph's own input buffers

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        self._static = False
        if forward_batch.seq_lens_cpu is None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens.tolist()

    def _attend(self, q: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch,
                q_lens: list[int], prefix_lens: list[int]) -> torch.Tensor:
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        out = q.new_empty(q.shape[0], layer.tp_q_head_num, value_head_dim(layer))
        rows = forward_batch.req_pool_indices.tolist()
        gqa = layer.tp_q_head_num // layer.tp_k_head_num
        window = local_window(layer)
        start = 0
        for i, (q_len, pre) in enumerate(zip(q_lens, prefix_lens, strict=True)):
            if q_len == 0:
                continue
            kv_len = pre + q_len
            # with a sliding window or chunks, keys before the first query's first visible key are never read
            first = max(0, first_key(pre, window))
            slots = req_to_token[rows[i], first:kv_len].long()
            ks, vs = kv_scales(layer)
            k = load_kv_values(gather_kv(k_buf, slots), q.dtype, ks).transpose(0, 1)  # [Hkv, L, D]
            v = load_kv_values(gather_kv(v_buf, slots), q.dtype, vs).transpose(0, 1)
            qi = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
            if gqa > 1:
                k = k.repeat_interleave(gqa, dim=0)
                v = v.repeat_interleave(gqa, dim=0)
            mask = None
            if q_len > 1:
                # query j (position pre + j) sees keys first_key(pre + j) .. pre + j (key column c: position first + c)
                qpos = torch.arange(pre, kv_len, device=q.device)[:, None]
                kpos = torch.arange(first, kv_len, device=q.device)[None, :]
                mask = (kpos <= qpos) & (kpos >= first_key(qpos, window))
            o = capped_attention(qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), mask, layer.scaling,
                                 logit_cap(layer), sink=sinks(layer))
            out[start:start + q_len] = o.squeeze(0).transpose(0, 1)
            start += q_len
        return out.view(-1, layer.tp_q_head_num * value_head_dim(layer))

    def _save(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> None:
        forward_batch.token_to_kv_pool.set_kv_buffer(
            layer.layer_id, forward_batch.out_cache_loc,
            k.view(-1, layer.tp_k_head_num, layer.head_dim), v.view(-1, layer.tp_v_head_num, value_head_dim(layer)),
            *kv_scales(layer))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        return self._attend(q, layer, forward_batch, forward_batch.extend_seq_lens_cpu,
                            forward_batch.extend_prefix_lens_cpu)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        """One query per request: requests are attended in groups, each group as one padded SDPA call with a
        key mask (a group holds at most DECODE_GROUP_ELEMENTS padded key positions × heads)."""
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        if self._static:
            return self._decode_static(q, layer, forward_batch)
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        h, hkv, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim, value_head_dim(layer)
        q = q.view(-1, h, d)
        out = q.new_empty(q.shape[0], h, dv)
        lens = forward_batch.seq_lens_cpu
        rows = forward_batch.req_pool_indices
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        window = local_window(layer)
        start = 0
        while start < len(lens):
            end, longest = start, 0
            while end < len(lens) and max(longest, lens[end]) * (end + 1 - start) * hkv <= DECODE_GROUP_ELEMENTS \
                    or end == start:
                longest = max(longest, lens[end])
                end += 1
            slots = req_to_token[rows[start:end], :longest].long()  # [n, L]; columns past a length are ignored
            seq = torch.tensor(lens[start:end], device=q.device)
            cols = torch.arange(longest, device=q.device)[None, :]
            mask = cols < seq[:, None]  # [n, L]
            if window:  # the query (position seq - 1) sees its window's or its chunk's keys only
                mask &= cols >= first_key(seq[:, None] - 1, window)
            pad = ~mask
            kk = load_kv_values(gather_kv(k_buf, slots), q.dtype, kv_scales(layer)[0])  # [n, L, Hkv, D]
            vv = load_kv_values(gather_kv(v_buf, slots), q.dtype, kv_scales(layer)[1])
            if bool(pad.any()):  # whatever sits in the slots past a request's end must not leak in (0 × NaN)
                kk[pad] = 0
                vv[pad] = 0
            kk, vv = kk.permute(0, 2, 1, 3), vv.permute(0, 2, 1, 3)  # [n, Hkv, L, D]
            if h != hkv:
                kk = kk.repeat_interleave(h // hkv, dim=1)
                vv = vv.repeat_interleave(h // hkv, dim=1)
            o = capped_attention(q[start:end].unsqueeze(2), kk, vv, mask[:, None, None, :], layer.scaling,
                                 logit_cap(layer), sink=sinks(layer))  # [n, H, 1, D]
            out[start:end] = o.squeeze(2)
            start = end
        return out.view(-1, h * dv)

    def _decode_static(self, q: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> torch.Tensor:
        """Decode with static shapes and no host reads (captured in CUDA graphs): graph_width columns of every row,
        masked past its length (and before its window), in groups of a size fixed by the batch size."""
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        h, hkv, d, dv = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim, value_head_dim(layer)
        bs, width = forward_batch.batch_size, self.graph_width
        q = q.view(bs, h, d)
        out = q.new_empty(bs, h, dv)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        window = local_window(layer)
        ks, vs = kv_scales(layer)
        cols = torch.arange(width, device=q.device)[None, :]
        group = max(1, DECODE_GROUP_ELEMENTS // (width * hkv))
        for start in range(0, bs, group):
            end = min(bs, start + group)
            seq = forward_batch.seq_lens[start:end, None]
            mask = cols < seq  # [n, width]
            if window:
                mask &= cols >= first_key(seq - 1, window)
            slots = req_to_token[forward_batch.req_pool_indices[start:end], :width].long()
            keep = mask[:, :, None, None]
            kk = torch.where(keep, load_kv_values(gather_kv(k_buf, slots), q.dtype, ks), 0).permute(0, 2, 1, 3)
            vv = torch.where(keep, load_kv_values(gather_kv(v_buf, slots), q.dtype, vs), 0).permute(0, 2, 1, 3)
            if h != hkv:
                kk = kk.repeat_interleave(h // hkv, dim=1)
                vv = vv.repeat_interleave(h // hkv, dim=1)
            o = capped_attention(q[start:end].unsqueeze(2), kk, vv, mask[:, None, None, :], layer.scaling,
                                 logit_cap(layer), sink=sinks(layer))
            out[start:end] = o.squeeze(2)
        return out.view(-1, h * dv)
