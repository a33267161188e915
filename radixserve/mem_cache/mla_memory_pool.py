"""The KV pool of multi-head latent attention (DeepSeek-V2/V3).

MLA caches one vector per token per layer: the compressed KV latent (kv_lora_rank values, already RMS-normalised)
followed by the rotated shared key part (qk_rope_head_dim values), for all heads at once. Attention runs on it as
multi-query attention after weight absorption: the key is the whole vector, the value its first kv_lora_rank
values. So `get_kv_buffer` returns the buffer [buffer_rows, 1, kv_lora_rank + rope] as K and a view of its
latent part as V, and `set_kv_buffer` stores K only (V is part of it).

The allocator (free slots on the CPU, slot 0 the padding slot) is TokenToKVPool's; only the device buffers differ.
At DeepSeek-V2-Lite's shape (27 layers, 16 heads of 192/128 dims, kv_lora_rank 512, rope 64) a token costs
27 * 576 values against 27 * 16 * (192 + 128) for the same model's expanded K and V: 8.9x fewer.
"""

from __future__ import annotations

import torch

from radixserve.mem_cache.memory_pool import TokenToKVPool


class MLATokenToKVPool(TokenToKVPool):
    def __init__(self, size: int, dtype: torch.dtype, kv_lora_rank: int, qk_rope_head_dim: int, num_layers: int,
                 device: str, debug_checks: bool = True, page_size: int = 1) -> None:
        if size <= 0:
            raise ValueError(f"MLATokenToKVPool needs a positive size; got {size}")
        self._init_pages(size, page_size)
        if dtype.itemsize == 1:
            raise ValueError("--kv-cache-dtype fp8 is not supported for MLA models (the latent pool holds the "
                             "model dtype)")
        self.dtype = dtype
        self.device = device
        self.kv_lora_rank = kv_lora_rank
        self.qk_rope_head_dim = qk_rope_head_dim
        self.num_kv_heads = 1
        self.head_dim = kv_lora_rank + qk_rope_head_dim
        self.num_layers = num_layers
        self.kv_buffer = [torch.zeros((self.buffer_rows, 1, self.head_dim), dtype=dtype, device=device)
                          for _ in range(num_layers)]
        self.k_buffer = self.kv_buffer
        self.v_buffer = [buf[..., :kv_lora_rank] for buf in self.kv_buffer]
        self.debug_checks = debug_checks
        self.clear()

    def set_kv_buffer(self, layer_id: int, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor | None,
                      k_scale: float = 1.0, v_scale: float = 1.0) -> None:
        """k: [T, 1, kv_lora_rank + rope] (latent then rotated key); v is its latent part and is not stored again."""
        self.kv_buffer[layer_id][loc] = k.to(self.dtype)

    def bytes_per_token(self) -> int:
        return self.num_layers * self.head_dim * torch.finfo(self.dtype).bits // 8

    @staticmethod
    def cell_bytes(kv_lora_rank: int, qk_rope_head_dim: int, num_layers: int, dtype: torch.dtype) -> int:
        return num_layers * (kv_lora_rank + qk_rope_head_dim) * torch.finfo(dtype).bits // 8
