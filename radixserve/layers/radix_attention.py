"""RadixAttention: the attention layer the models hold. It knows its shapes; the backend does the work."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
from torch import nn

from radixserve.model_executor.piecewise_graph_runner import active_capture
from radixserve.model_executor.torch_compile import compiled_attention, register_attention_layer

if TYPE_CHECKING:
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class RadixAttention(nn.Module):
    def __init__(self, num_heads: int, head_dim: int, scaling: float, num_kv_heads: int, layer_id: int,
                 v_head_dim: int | None = None, sliding_window_size: int = -1, logit_cap: float = 0.0,
                 sinks: bool = False, first_head: int = 0, total_heads: int | None = None,
                 attention_chunk_size: int = -1) -> None:
        """`first_head` / `total_heads`: where this rank's query heads sit among the model's (tensor parallelism),
        for the checkpoint's per-head sinks, which each rank loads its slice of."""
        super().__init__()
        if sliding_window_size == 0 or sliding_window_size < -1:
            raise ValueError(f"sliding_window_size must be -1 (full attention) or positive; got {sliding_window_size}")
        if attention_chunk_size == 0 or attention_chunk_size < -1:
            raise ValueError(f"attention_chunk_size must be -1 (none) or positive; got {attention_chunk_size}")
        if attention_chunk_size > 0 and sliding_window_size > 0:
            raise ValueError("a layer attends within a sliding window or within chunks, not both")
        if not logit_cap >= 0:
            raise ValueError(f"logit_cap must be >= 0 (0: none); got {logit_cap}")
        # Gemma 2's soft-capping of the scaled scores, cap * tanh(s / cap); 0: none (backends that support it set
        # `supports_logit_cap`; the model runner refuses the others)
        self.logit_cap = float(logit_cap)
        # GPT-OSS's attention sinks: one learned logit a query head (this rank's heads), in the softmax of every
        # query with its scaled scores and dropped after it, so that part of the probability goes to no value. Kept
        # float32 whatever the model's dtype (explicit dtype: the loader's default dtype does not apply; backends
        # that support them set `supports_sinks` and read them through `base_attn_backend.sinks`); None: none
        self.sinks: nn.Parameter | None = None
        self.sink_heads = (first_head, num_heads if total_heads is None else total_heads)
        if not 0 <= first_head <= self.sink_heads[1] - num_heads:
            raise ValueError(f"query heads [{first_head}, {first_head + num_heads}) are outside the model's "
                             f"{self.sink_heads[1]}")
        if sinks:
            self.sinks = nn.Parameter(torch.zeros(num_heads, dtype=torch.float32), requires_grad=False)
            self.sinks.weight_loader = self.load_sinks
        self.tp_q_head_num = num_heads
        self.tp_k_head_num = num_kv_heads
        self.tp_v_head_num = num_kv_heads
        self.head_dim = head_dim  # of q and k
        self.v_head_dim = v_head_dim or head_dim  # of v and the output (MLA: the latent rank, smaller than k's)
        self.scaling = scaling
        self.layer_id = layer_id
        # -1: full causal attention; W > 0: a query at position p sees the keys at positions p - W + 1 .. p
        self.sliding_window_size = sliding_window_size
        # -1: none; C > 0 (Llama 4's chunked local attention): a query at position p sees the keys at positions
        # (p // C) * C .. p, those of its own C-token chunk (backends that support it set
        # `supports_chunked_attention`; the model runner refuses the others)
        self.attention_chunk_size = attention_chunk_size
        # per-tensor scales of an fp8 KV cache: the pool holds k / k_scale (the checkpoint's k_scale / v_scale when
        # it has them, else 1.0); ignored by a 16/32-bit pool
        self.k_scale = 1.0
        self.v_scale = 1.0
        self.compile_key = register_attention_layer(self)  # how a compiled graph's attention op finds this layer

    def load_sinks(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The checkpoint's sinks of all query heads: this rank's slice."""
        first, total = self.sink_heads
        if tuple(loaded.shape) != (total,):
            raise ValueError(f"attention sinks of shape {tuple(loaded.shape)}; expected ({total},) (one a query head)")
        param.data.copy_(loaded.narrow(0, first, param.shape[0]))

    def checkpoint_shape(self, leaf: str) -> tuple[int, ...]:
        """The checkpoint tensor's shape of the sinks (dummy weights generate it whole, then take this rank's
        slice)."""
        return (self.sink_heads[1],)

    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, forward_batch: ForwardBatch,
                save_kv_cache: bool = True) -> torch.Tensor:
        if torch.compiler.is_compiling():  # one opaque op in the compiled graph (model_executor/torch_compile.py)
            return compiled_attention(q, k, v, self, save_kv_cache)
        capture = active_capture()
        if capture is not None:  # a piecewise CUDA graph ends here; attention runs eagerly (piecewise_graph_runner)
            return capture.attention(self, q, k, v, forward_batch, save_kv_cache)
        return forward_batch.attn_backend.forward(q, k, v, self, forward_batch, save_kv_cache)
