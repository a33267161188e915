"""Pure-PyTorch attention: scaled_dot_product_attention over each request's gathered KV. Runs anywhere; the
reference the other backends are tested against."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers.attention.base_attn_backend import AttentionBackend

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner


class TorchNativeAttnBackend(AttentionBackend):
    def __init__(self, model_runner: ModelRunner) -> None:
        self.device = model_runner.device

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        if forward_batch.seq_lens_cpu is None:
            forward_batch.seq_lens_cpu = forward_batch.seq_lens.tolist()

    def _attend(self, q: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch,
                q_lens: list[int], prefix_lens: list[int]) -> torch.Tensor:
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        q = q.view(-1, layer.tp_q_head_num, layer.head_dim)
        out = torch.empty_like(q)
        rows = forward_batch.req_pool_indices.tolist()
        gqa = layer.tp_q_head_num // layer.tp_k_head_num
        start = 0
        for i, (q_len, pre) in enumerate(zip(q_lens, prefix_lens, strict=True)):
            if q_len == 0:
                continue
            kv_len = pre + q_len
            slots = req_to_token[rows[i], :kv_len].long()
            k = k_buf[slots].to(q.dtype).transpose(0, 1)  # [Hkv, L, D]
            v = v_buf[slots].to(q.dtype).transpose(0, 1)
            qi = q[start:start + q_len].transpose(0, 1)  # [H, q_len, D]
            if gqa > 1:
                k = k.repeat_interleave(gqa, dim=0)
                v = v.repeat_interleave(gqa, dim=0)
            mask = None
            if q_len > 1:
                # query j (absolute position pre + j) sees keys 0 .. pre + j
                mask = torch.ones(q_len, kv_len, dtype=torch.bool, device=q.device).tril(diagonal=pre)
            o = F.scaled_dot_product_attention(qi.unsqueeze(0), k.unsqueeze(0), v.unsqueeze(0), attn_mask=mask,
                                               scale=layer.scaling)
            out[start:start + q_len] = o.squeeze(0).transpose(0, 1)
            start += q_len
        return out.view(-1, layer.tp_q_head_num * layer.head_dim)

    def _save(self, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch) -> None:
        forward_batch.token_to_kv_pool.set_kv_buffer(
            layer.layer_id, forward_batch.out_cache_loc,
            k.view(-1, layer.tp_k_head_num, layer.head_dim), v.view(-1, layer.tp_v_head_num, layer.head_dim))

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        return self._attend(q, layer, forward_batch, forward_batch.extend_seq_lens_cpu,
                            forward_batch.extend_prefix_lens_cpu)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        bs = forward_batch.batch_size
        return self._attend(q, layer, forward_batch, [1] * bs, [s - 1 for s in forward_batch.seq_lens_cpu])
