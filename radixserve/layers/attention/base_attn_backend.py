"""The interface every attention backend implements. RadixAttention only calls `forward`."""

from __future__ import annotations

from abc import ABC, abstractmethod
from typing import TYPE_CHECKING, Any

import torch
import torch.nn.functional as F

if TYPE_CHECKING:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.forward_batch_info import ForwardBatch


class AttentionBackend(ABC):
    """Required: init_forward_metadata, forward_extend, forward_decode. Optional, for CUDA graphs (decode): a backend
    that sets `supports_cuda_graph` implements init_cuda_graph_state and the capture / replay hooks; the model runner
    checks the flag at start and runs decode eagerly for a backend without it. cuda_graph_input_buffers,
    after_replay_cuda_graph, get_cuda_graph_seq_len_fill_value and cuda_graph_max_seq_len have defaults."""

    # whether decode can be captured in a CUDA graph (the init_*_cuda_graph hooks below are implemented, and the
    # decode forward never reads device values on the host)
    supports_cuda_graph: bool = False
    supports_logit_cap: bool = False  # attention scores soft-capped per layer (RadixAttention.logit_cap)
    supports_sinks: bool = False  # GPT-OSS's per-head sink logits (RadixAttention.sinks)
    supports_chunked_attention: bool = False  # Llama 4: RadixAttention.attention_chunk_size
    # whether a one-request extend can be captured (model_executor/prefill_graph_runner.py): the extend forward
    # reads the request's lengths from the device only, after an init_forward_metadata made at capture time
    supports_prefill_cuda_graph: bool = False
    # whether init_forward_metadata_replay_cuda_graph reads the graph's input buffers on the device (copies or plans
    # from them) when they are the backend's own (cuda_graph_input_buffers): if not, the graph runner loads a decode
    # batch inside the graph itself, after the hook (model_executor/cuda_graph_runner.py)
    replay_reads_graph_inputs: bool = True
    # whether init_forward_metadata_replay_cuda_graph does nothing but load req_pool_indices / seq_lens into the
    # buffers cuda_graph_input_buffers names: the graph runner, filling those very buffers, then skips the call
    replay_hook_only_loads_inputs: bool = False

    @abstractmethod
    def init_forward_metadata(self, forward_batch: ForwardBatch) -> None:
        """Build whatever per-batch metadata the kernels need (called once per forward, before the layers)."""

    # ---------------------------------------------------------------- CUDA graphs (decode)
    def init_cuda_graph_state(self, max_bs: int) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def cuda_graph_input_buffers(self) -> tuple[torch.Tensor, torch.Tensor] | None:
        """The static int64 [max_bs] (req_pool_indices, seq_lens) buffers the captured kernels read, if the backend
        keeps its own: a graph runner that loads batches straight into them spares the replay hook its copies."""
        return None

    def init_forward_metadata_capture_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                 seq_lens: torch.Tensor) -> None:
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def init_forward_metadata_replay_cuda_graph(self, bs: int, req_pool_indices: torch.Tensor,
                                                seq_lens: torch.Tensor, seq_lens_sum: int,
                                                seq_lens_cpu: list[int] | None = None) -> None:
        """Before a replay of the graph of (padded) batch size bs: its inputs are in the buffers given. seq_lens_cpu,
        where the caller has it: the batch's own lengths on the host (its real rows only; the padding rows after them
        hold `get_cuda_graph_seq_len_fill_value()`), so a backend that plans on the host need not read them back."""
        raise NotImplementedError(f"{type(self).__name__} does not support CUDA graphs")

    def after_replay_cuda_graph(self, bs: int) -> None:
        """Right after the graph of batch size bs was launched (the GPU runs it now): a backend that plans on the host
        may prepare the likely next replay here, where a synchronous host would only wait. Nothing by default."""
        return None

    def get_cuda_graph_seq_len_fill_value(self) -> int:
        """seq_len written into the padded rows of a replayed graph."""
        return 1

    def cuda_graph_max_seq_len(self) -> int | None:
        """The longest sequence a captured decode serves (None: any); a batch with a longer one runs eagerly."""
        return None

    # ---------------------------------------------------------------- forward
    def forward(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor:
        """q: [T, H*D], k/v: [T, Hkv*D]; returns [T, H*D]."""
        if forward_batch.forward_mode.is_decode():
            return self.forward_decode(q, k, v, layer, forward_batch, save_kv_cache)
        return self.forward_extend(q, k, v, layer, forward_batch, save_kv_cache)

    @abstractmethod
    def forward_extend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor: ...

    @abstractmethod
    def forward_decode(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, layer: RadixAttention,
                       forward_batch: ForwardBatch, save_kv_cache: bool = True) -> torch.Tensor: ...


def kv_scales(layer: object) -> tuple[float, float]:
    """(k_scale, v_scale) of an fp8 KV cache for this attention layer (1.0 for a layer that sets none)."""
    return getattr(layer, "k_scale", 1.0), getattr(layer, "v_scale", 1.0)


def logit_cap(layer: object) -> float:
    """The layer's soft-cap of its scaled attention scores (cap * tanh(s / cap)), or 0.0 for none."""
    return getattr(layer, "logit_cap", 0.0)


def sinks(layer: object) -> torch.Tensor | None:
    """The layer's per-head attention sink logits (GPT-OSS), float32 [this rank's query heads], or None for none.
    Each query's softmax over its visible scaled scores takes the sink as one more logit, whose probability goes to
    no value: out = out_without_sink * sigmoid(lse - sink[h]), lse the natural-log log-sum-exp of those scores."""
    t = getattr(layer, "sinks", None)
    return None if t is None else t.float()  # (the parameter itself when it is float32, as RadixAttention keeps it)


def scale_by_sinks(out: torch.Tensor, lse: torch.Tensor, sink: torch.Tensor) -> torch.Tensor:
    """out [..., H, L, Dv] of a softmax without sinks, lse [..., H, L] its natural-log log-sum-exps (-inf for a
    query that saw nothing): the output with sink [H] in each softmax, sigmoid(lse - sink) times out, in out's
    dtype (a query that saw nothing gives zeros, not NaN)."""
    gate = torch.sigmoid(lse.float() - sink.view(-1, 1))
    gate = torch.where(torch.isneginf(lse), 0.0, gate)
    return (out.float() * gate.unsqueeze(-1)).to(out.dtype)


def capped_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None, scale: float,
                     cap: float, is_causal: bool = False, sink: torch.Tensor | None = None) -> torch.Tensor:
    """scaled_dot_product_attention (q [..., H, Lq, D], k / v [..., H, Lk, D], a boolean mask: True attends), with the
    scores soft-capped when cap > 0 and the per-head sink logits sink [H] (float32) taken into each softmax when
    given (written out: SDPA has neither option)."""
    if cap <= 0 and sink is None:
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, is_causal=is_causal, scale=scale)
    s = torch.matmul(q.float(), k.float().transpose(-1, -2)) * scale
    if cap > 0:
        s = torch.tanh(s / cap) * cap
    if is_causal:
        mask = torch.ones(q.shape[-2], k.shape[-2], dtype=torch.bool, device=q.device).tril()
    if mask is not None:
        s = s.masked_fill(~mask, float("-inf"))
    if sink is None:
        return torch.matmul(torch.softmax(s, dim=-1), v.float()).to(q.dtype)
    lse = torch.logsumexp(s, dim=-1)  # [..., H, Lq]; -inf where a query sees nothing
    p = torch.exp(s - torch.where(torch.isneginf(lse), 0.0, lse).unsqueeze(-1))
    return scale_by_sinks(torch.matmul(p, v.float()), lse, sink).to(q.dtype)


def attention_layers(model_runner: Any) -> list[Any]:
    """The loaded model's attention layers (RadixAttention modules); none before a model is loaded."""
    from radixserve.layers.radix_attention import RadixAttention

    model = getattr(model_runner, "model", None)
    return [m for m in model.modules() if isinstance(m, RadixAttention)] if model is not None else []


def sliding_window(layer: object) -> int:
    """The layer's attention window in tokens, or -1 for full attention (also for a layer that sets none)."""
    return getattr(layer, "sliding_window_size", -1)


def attention_chunk(layer: object) -> int:
    """The layer's attention chunk in tokens (a query sees the keys of its own chunk up to itself), or -1."""
    return getattr(layer, "attention_chunk_size", -1)


def local_window(layer: object) -> int:
    """The layer's sliding window (> 0) or attention chunk as a negative number (-C), or 0 for full attention:
    the one `window` argument of the Triton kernels (`triton_ops.common.first_visible`)."""
    window, chunk = sliding_window(layer), attention_chunk(layer)
    return window if window > 0 else -chunk if chunk > 0 else 0


def first_key(pos: Any, window: int) -> Any:
    """The first key position a query at `pos` (an int or a tensor of them) sees under `window` as `local_window`
    gives it: pos - W + 1 for a sliding window of W (may be negative: no key is before 0), the start of its chunk
    (pos // C) * C for chunks of C, 0 for full attention."""
    if window > 0:
        return pos - window + 1
    if window < 0:
        return pos // -window * -window
    return pos * 0


def value_head_dim(layer: object) -> int:
    """The value / output head dim of an attention layer (MLA's is smaller than its key dim); head_dim for a layer
    that names none."""
    return getattr(layer, "v_head_dim", None) or layer.head_dim  # type: ignore[attr-defined]
