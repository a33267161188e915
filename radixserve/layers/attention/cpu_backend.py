"""CPU attention: the default backend on the CPU. Same results as `torch_native` (the readable reference it extends),
without its copies:

- decode: every request of the batch in one call of a paged C kernel (`layers/cpu_ops/paged_decode.c`) that reads each
  request's K/V rows in place from the pool through the request table, once per step — no gather, no padding, no
  repeated KV heads — split over all intra-op threads; its cost grows with the KV bytes read;
- extend: the new tokens' own K/V feed SDPA directly when nothing is cached (no gather from the pool), grouped-query
  attention without repeating heads; with a cached prefix only that request's slots are gathered; requests of a
  mixed batch with one new token go through the decode kernel together.

The decode kernel reads float32, bfloat16 and float8 e4m3 pools (fp8 times the layer's k_scale / v_scale): a smaller
pool is fewer bytes read per step, which is what a long context's decode step costs. Where the kernel cannot run (no
C compiler, an fp8 e5m2 pool) and for extend over a pool of another dtype than the model's, the reference path runs
instead: dequantisation for prefill stays in one place, `torch_native`.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F

from radixserve.layers import cpu_ops
from radixserve.layers.attention.base_attn_backend import first_key, kv_scales, local_window, logit_cap, sinks
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch
    from radixserve.model_executor.model_runner import ModelRunner

KERNEL_POOL_DTYPES = tuple(cpu_ops.PAGED_KV_KINDS)  # float32, bfloat16, float8_e4m3fn


def _is_mla(layer: RadixAttention) -> bool:
    return getattr(layer, "v_head_dim", layer.head_dim) != layer.head_dim


class CpuAttnBackend(TorchNativeAttnBackend):
    supports_cuda_graph = False  # CPU only
    supports_sinks = True  # layers with sinks take the reference path (the C decode kernel has none)
    supports_chunked_attention = True  # chunked layers extend through the reference; decode starts at the chunk

    def __init__(self, model_runner: ModelRunner) -> None:
        super().__init__(model_runner)
        if str(self.device) != "cpu":
            raise ValueError(f"the cpu attention backend runs on the CPU only, not on {self.device}")
        self.kernel = cpu_ops.load() is not None
        self._rows = self._ends = self._zeros = None  # per-forward decode metadata, shared by every layer

    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        super().init_forward_metadata(forward_batch)
        if forward_batch.forward_mode.is_decode():
            self._rows = forward_batch.req_pool_indices.to(torch.int64).contiguous()
            self._ends = forward_batch.seq_lens.to(torch.int64).contiguous()
            self._zeros = torch.zeros_like(self._ends)

    def _kernel_fits(self, layer: RadixAttention, forward_batch: ForwardBatch) -> bool:
        return self.kernel and not _is_mla(layer) and not logit_cap(layer) and sinks(layer) is None \
            and forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)[0].dtype in KERNEL_POOL_DTYPES

    def _decode_kernel(self, q: torch.Tensor, layer: RadixAttention, forward_batch: ForwardBatch,
                       rows: torch.Tensor, ends: torch.Tensor, zeros: torch.Tensor) -> torch.Tensor:
        """q: [n, H*D] one query per request -> [n, H*D]."""
        h, d = layer.tp_q_head_num, layer.head_dim
        k_buf, v_buf = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        window = local_window(layer)  # the query sees its window's or its chunk's keys only
        starts = first_key(ends - 1, window).clamp_(min=0) if window else zeros
        q32 = q.reshape(-1, h, d).to(torch.float32).contiguous()
        scales = kv_scales(layer) if k_buf.dtype == torch.float8_e4m3fn else (1.0, 1.0)
        out = cpu_ops.paged_decode_attention(q32, k_buf, v_buf, forward_batch.req_to_token_pool.req_to_token, rows,
                                             starts, ends, layer.scaling, k_scale=scales[0], v_scale=scales[1])
        return out.view(-1, h * d).to(q.dtype)

    def forward_decode(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        if not self._kernel_fits(layer, forward_batch):
            return super().forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        return self._decode_kernel(q, layer, forward_batch, self._rows, self._ends, self._zeros)

    def forward_extend(self, q, k, v, layer, forward_batch, save_kv_cache=True):  # noqa: ANN001, ANN201
        k_buf, _ = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)
        if local_window(layer) or k_buf.dtype != q.dtype or _is_mla(layer) or logit_cap(layer) \
                or sinks(layer) is not None:
            # windows' and chunks' masks, MLA's latent (value dim != key dim), soft-capping and sinks live in the
            # reference; a pool of another dtype must be read back (rounded) from it
            return super().forward_extend(q, k, v, layer, forward_batch, save_kv_cache)
        if save_kv_cache:
            self._save(k, v, layer, forward_batch)
        h, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
        q3, k3, v3 = q.view(-1, h, d), k.view(-1, hkv, d), v.view(-1, hkv, d)
        out = torch.empty_like(q3)
        q_lens, prefix_lens = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
        rows = forward_batch.req_pool_indices
        req_to_token = forward_batch.req_to_token_pool.req_to_token
        single = [i for i, n in enumerate(q_lens) if n == 1]
        use_kernel = len(single) > 1 and self._kernel_fits(layer, forward_batch)
        starts_of = [0] * len(q_lens)
        for i in range(1, len(q_lens)):
            starts_of[i] = starts_of[i - 1] + q_lens[i - 1]
        for i, (q_len, pre) in enumerate(zip(q_lens, prefix_lens, strict=True)):
            if q_len == 0 or (q_len == 1 and use_kernel):
                continue
            s = starts_of[i]
            qi = q3[s:s + q_len].transpose(0, 1).unsqueeze(0)  # [1, H, q_len, D]
            if pre == 0:  # nothing cached: this request's own new K/V, causal
                ki = k3[s:s + q_len].transpose(0, 1).unsqueeze(0)
                vi = v3[s:s + q_len].transpose(0, 1).unsqueeze(0)
                o = F.scaled_dot_product_attention(qi, ki, vi, is_causal=q_len > 1, scale=layer.scaling,
                                                   enable_gqa=h != hkv)
            else:  # the cached prefix from the pool, then the new tokens (already stored)
                slots = req_to_token[int(rows[i]), :pre + q_len].long()
                ki = k_buf[slots].transpose(0, 1).unsqueeze(0)
                vi = forward_batch.token_to_kv_pool.get_kv_buffer(layer.layer_id)[1][slots].transpose(0, 1)
                mask = None
                if q_len > 1:  # query j (position pre + j) sees keys 0 .. pre + j
                    mask = torch.ones(q_len, pre + q_len, dtype=torch.bool).tril(diagonal=pre)
                o = F.scaled_dot_product_attention(qi, ki, vi.unsqueeze(0), attn_mask=mask, scale=layer.scaling,
                                                   enable_gqa=h != hkv)
            out[s:s + q_len] = o[0].transpose(0, 1)
        if use_kernel:
            idx = torch.tensor(single, dtype=torch.int64)
            tok = torch.tensor([starts_of[i] for i in single], dtype=torch.int64)
            ends = torch.tensor([prefix_lens[i] + 1 for i in single], dtype=torch.int64)
            out[tok] = self._decode_kernel(q3[tok].reshape(len(single), h * d), layer, forward_batch,
                                           rows[idx].to(torch.int64).contiguous(), ends,
                                           torch.zeros_like(ends)).view(-1, h, d)
        return out.view(-1, h * d)
