"""Encoder-only embedding models: BERT (`BertModel`: bge-large-en-v1.5, e5, gte-base, all-MiniLM) and RoBERTa /
XLM-RoBERTa (`RobertaModel`, `XLMRobertaModel`: bge-m3, multilingual-e5), also from their masked-LM checkpoints
(`*ForMaskedLM`, whose encoder weights sit under `bert.` / `roberta.`; the MLM head is not loaded).

word + absolute position + token-type embeddings (type 0, unless a subclass passes per-token types: the
cross-encoders of models/bert_rerank.py) and a LayerNorm, then post-LN layers: h =
LN(h + dense(attention(h))), h = LN(h + dense(act(dense(h)))). The attention is bidirectional over each request's
own tokens: this model computes it itself (scaled_dot_product_attention over each sequence; a batch of sequences of
different lengths is padded, the padding masked out as keys and its query rows dropped), without RadixAttention and
without touching the KV pool. The engine keeps encoder requests whole (no chunked prefill, no cached prefix, no
decode: configs/encoder.py), and this forward refuses a batch that breaks that.

RoBERTa / XLM-R count positions from padding_idx + 1, skipping padding tokens (transformers'
create_position_ids_from_input_ids); BERT from 0. The forward returns the pooled rows (forward_batch.pooling, per
request: "cls" the first token's final hidden state, "last" the last one's, "mean" the sum over the request's
tokens, which the scheduler divides by their count) and no logits (the worker then skips the sampler)."""

from __future__ import annotations

from collections.abc import Iterable
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.configs.encoder import position_offset
from radixserve.layers.linear import ColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.layers.vocab_parallel_embedding import VocabParallelEmbedding
from radixserve.models.llama import load_plain

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

_ACTIVATIONS = {"gelu": lambda x: F.gelu(x), "gelu_new": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_pytorch_tanh": lambda x: F.gelu(x, approximate="tanh"),
                "gelu_fast": lambda x: F.gelu(x, approximate="tanh"), "relu": F.relu}
_POOL_KINDS = {"cls": 0, "last": 1, "mean": 2}
# checkpoint names -> ours: q/k/v stacked into one projection
_STACKED = (("attention.self.query.", "attention.qkv_proj.", "q"), ("attention.self.key.", "attention.qkv_proj.", "k"),
            ("attention.self.value.", "attention.qkv_proj.", "v"))
_PREFIXES = ("bert.", "roberta.")
_SKIPPED = ("cls.", "lm_head.", "pooler.")  # the MLM head and BERT's pooler (sentence-transformers pools itself)


class BiasLayerNorm(nn.Module):
    """nn.LayerNorm with its weight and bias as non-trainable parameters (in the model's dtype, as transformers')."""

    def __init__(self, hidden_size: int, eps: float) -> None:
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(hidden_size), requires_grad=False)
        self.bias = nn.Parameter(torch.zeros(hidden_size), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.layer_norm(x, (x.shape[-1],), self.weight, self.bias, self.eps)


class BertEmbeddings(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        hidden = config.hidden_size
        self.word_embeddings = VocabParallelEmbedding(config.vocab_size, hidden, tp_rank, tp_size)
        self.position_embeddings = nn.Module()
        self.position_embeddings.weight = nn.Parameter(torch.empty(config.max_position_embeddings, hidden),
                                                       requires_grad=False)
        self.token_type_embeddings = nn.Module()
        self.token_type_embeddings.weight = nn.Parameter(torch.empty(max(1, getattr(config, "type_vocab_size", 2)),
                                                                     hidden), requires_grad=False)
        self.LayerNorm = BiasLayerNorm(hidden, config.layer_norm_eps)

    def forward(self, input_ids: torch.Tensor, position_ids: torch.Tensor,
                token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        h = self.word_embeddings(input_ids) + F.embedding(position_ids, self.position_embeddings.weight)
        types = self.token_type_embeddings.weight
        return self.LayerNorm(h + (types[0] if token_type_ids is None else F.embedding(token_type_ids, types)))


class DenseNorm(nn.Module):
    """LN(residual + dense(x)): the attention's and the feed-forward's output blocks."""

    def __init__(self, in_features: int, hidden_size: int, eps: float, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.dense = RowParallelLinear(in_features, hidden_size, True, tp_rank, tp_size)
        self.LayerNorm = BiasLayerNorm(hidden_size, eps)

    def forward(self, x: torch.Tensor, residual: torch.Tensor) -> torch.Tensor:
        return self.LayerNorm(self.dense(x) + residual)


class SequenceLayout:
    """How a forward's requests lie in its flat token rows, for attention within each request: one [bs, L] view
    when all have the same length, else gathered into [bs, max L] with a key mask (the padding rows are dropped),
    unless padding would more than double the rows (a long input among short ones): then one request at a time."""

    def __init__(self, lens: list[int], device: torch.device) -> None:
        self.lens, self.bs, self.max_len = lens, len(lens), max(lens)
        self.uniform = all(n == self.max_len for n in lens)
        self.one_by_one = not self.uniform and self.bs * self.max_len > 2 * sum(lens)
        self.index = self.valid = self.mask = None
        if not self.uniform and not self.one_by_one:
            n = torch.tensor(lens, dtype=torch.int64, device=device)
            starts = torch.cumsum(n, 0) - n
            cols = torch.arange(self.max_len, dtype=torch.int64, device=device)
            self.valid = cols.unsqueeze(0) < n.unsqueeze(1)  # [bs, L]
            self.index = starts.unsqueeze(1) + torch.minimum(cols.unsqueeze(0), (n - 1).unsqueeze(1))
            self.mask = self.valid[:, None, None, :]  # keys of each request only

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
        """q, k, v [T, heads * head_dim] -> softmax(q k^T / sqrt(d)) v within each request, [T, heads * head_dim]."""
        if self.one_by_one:
            return torch.cat([SequenceLayout([len(a)], q.device).attend(a, b, c, heads, head_dim) for a, b, c in zip(
                q.split(self.lens), k.split(self.lens), v.split(self.lens), strict=True)])

        def split(x: torch.Tensor) -> torch.Tensor:
            x = x.reshape(self.bs, self.max_len, heads, head_dim) if self.uniform else \
                x[self.index].view(self.bs, self.max_len, heads, head_dim)
            return x.transpose(1, 2)

        out = F.scaled_dot_product_attention(split(q), split(k), split(v), attn_mask=self.mask)
        out = out.transpose(1, 2).reshape(self.bs, self.max_len, heads * head_dim)
        return out.reshape(-1, heads * head_dim) if self.uniform else out[self.valid]


class BertAttention(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        heads = config.num_attention_heads
        if config.hidden_size % heads:
            raise ValueError(f"hidden_size {config.hidden_size} is not divisible by num_attention_heads {heads}")
        self.head_dim = config.hidden_size // heads
        self.qkv_proj = QKVParallelLinear(config.hidden_size, self.head_dim, heads, heads, True, tp_rank, tp_size)
        self.num_heads = self.qkv_proj.num_heads  # this rank's
        self.width = self.num_heads * self.head_dim
        self.output = DenseNorm(heads * self.head_dim, config.hidden_size, config.layer_norm_eps, tp_rank, tp_size)

    def forward(self, hidden: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        q, k, v = self.qkv_proj(hidden).split([self.width] * 3, dim=-1)
        return self.output(layout.attend(q, k, v, self.num_heads, self.head_dim), hidden)


class BertIntermediate(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        act = getattr(config, "hidden_act", "gelu")
        if act not in _ACTIVATIONS:
            raise ValueError(f"hidden_act {act!r} is not supported (supported: {', '.join(_ACTIVATIONS)})")
        self.act = _ACTIVATIONS[act]
        self.dense = ColumnParallelLinear(config.hidden_size, config.intermediate_size, True, tp_rank, tp_size)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.act(self.dense(x))


class BertLayer(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.attention = BertAttention(config, tp_rank, tp_size)
        self.intermediate = BertIntermediate(config, tp_rank, tp_size)
        self.output = DenseNorm(config.intermediate_size, config.hidden_size, config.layer_norm_eps, tp_rank, tp_size)

    def forward(self, hidden: torch.Tensor, layout: SequenceLayout) -> torch.Tensor:
        hidden = self.attention(hidden, layout)
        return self.output(self.intermediate(hidden), hidden)


class BertEncoder(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int, tp_size: int) -> None:
        super().__init__()
        self.layer = nn.ModuleList(BertLayer(config, tp_rank, tp_size) for _ in range(config.num_hidden_layers))


def roberta_positions(input_ids: torch.Tensor, lens: torch.Tensor, padding_idx: int) -> torch.Tensor:
    """RoBERTa's position ids of a flat batch (`lens` tokens per request): within each request, padding_idx + the
    count of non-padding tokens up to and including this one; padding tokens get padding_idx."""
    mask = (input_ids != padding_idx).to(torch.int64)
    total = torch.cumsum(mask, 0)
    starts = torch.cumsum(lens, 0) - lens
    before = torch.repeat_interleave((total - mask)[starts], lens)  # non-padding tokens of earlier requests
    return (total - before) * mask + padding_idx


def pool_rows(hidden: torch.Tensor, lens: torch.Tensor, pooling: list[str | None]) -> torch.Tensor:
    """[bs, hidden] float32: per request its first ("cls"), its last ("last") token's row, or the sum of its rows
    ("mean"; None: zeros)."""
    kinds = [_POOL_KINDS.get(p or "", -1) for p in pooling]
    unknown = sorted({p for p, k in zip(pooling, kinds, strict=True) if k < 0 and p is not None})
    if unknown:
        raise ValueError(f"pooling {unknown} is not supported by this encoder (cls, last or mean)")
    h = hidden.float()
    starts = torch.cumsum(lens, 0) - lens
    kind = torch.tensor(kinds, device=hidden.device).unsqueeze(1)
    out = torch.where(kind == 0, h[starts], h[starts + lens - 1])
    if 2 in kinds:
        seg = torch.repeat_interleave(torch.arange(len(kinds), device=hidden.device), lens)
        sums = torch.zeros_like(out).index_add_(0, seg, h)
        out = torch.where(kind == 2, sums, out)
    return torch.where(kind < 0, torch.zeros_like(out), out)


class BertModel(nn.Module):
    """The encoder with its embeddings; `forward` takes the engine's flat batch (see the module docstring)."""

    skipped_weights: tuple[str, ...] = _SKIPPED  # checkpoint names (after the bert. / roberta. prefix) not loaded

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        self.config = config
        self.embeddings = BertEmbeddings(config, tp_rank, tp_size)
        self.encoder = BertEncoder(config, tp_rank, tp_size)
        self.offset = position_offset(config)  # 0, or RoBERTa's padding_idx + 1
        self.padding_idx = int(getattr(config, "pad_token_id", 1) or 0) if self.offset else -1

    def encode(self, input_ids: torch.Tensor, lens: list[int],
               token_type_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Final hidden states [T, hidden] of requests of `lens` tokens laid end to end in `input_ids` (token types
        [T], or None: all 0)."""
        n = torch.tensor(lens, dtype=torch.int64, device=input_ids.device)
        if self.offset:
            position_ids = roberta_positions(input_ids, n, self.padding_idx)
        else:
            starts = torch.repeat_interleave(torch.cumsum(n, 0) - n, n)
            position_ids = torch.arange(len(input_ids), device=input_ids.device) - starts
        hidden = self.embeddings(input_ids, position_ids, token_type_ids)
        layout = SequenceLayout(lens, input_ids.device)
        for layer in self.encoder.layer:
            hidden = layer(hidden, layout)
        return hidden

    def forward(self, input_ids: torch.Tensor, positions: torch.Tensor,
                forward_batch: ForwardBatch) -> LogitsProcessorOutput:
        mode = forward_batch.forward_mode
        if not mode.is_extend() or mode.is_mixed() or mode.is_target_verify():
            raise RuntimeError(f"{type(self).__name__} is an encoder: it runs whole prompts only, not {mode.name}")
        lens = list(forward_batch.extend_seq_lens_cpu)
        if any(forward_batch.extend_prefix_lens_cpu or []):
            raise RuntimeError(f"{type(self).__name__} is an encoder: a request cannot extend a cached prefix or an "
                               "earlier prefill chunk (radix cache and chunked prefill must be off)")
        types = self.token_types(input_ids, forward_batch.extend_seq_lens)
        hidden = self.encode(input_ids, lens) if types is None else self.encode(input_ids, lens, types)
        out = LogitsProcessorOutput(next_token_logits=None)  # no logits: the worker samples nothing
        if forward_batch.pooling is not None:
            out.pooled_hidden = self.pool(hidden, forward_batch.extend_seq_lens, forward_batch.pooling)
        return out

    def token_types(self, input_ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        """Per-token type ids of the flat batch, or None (all 0: an embedding model encodes one text)."""
        return None

    def pool(self, hidden: torch.Tensor, lens: torch.Tensor, pooling: list[str | None]) -> torch.Tensor:
        """The pooled rows [bs, n] float32 the scheduler turns into each request's output vector."""
        return pool_rows(hidden, lens, pooling)

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        params = dict(self.named_parameters())
        loaded: set[str] = set()
        for name, tensor in weights:
            for prefix in _PREFIXES:
                name = name.removeprefix(prefix)
            if name.startswith(self.skipped_weights) or name.endswith(("position_ids", "token_type_ids")):
                continue
            if ".LayerNorm." in name:  # older checkpoints: TensorFlow's names
                name = name.replace(".gamma", ".weight").replace(".beta", ".bias")
            for theirs, ours, shard in _STACKED:
                if theirs in name:
                    target = name.replace(theirs, ours)
                    if target not in params:
                        raise ValueError(f"weight {name!r} has no parameter {target!r} in {type(self).__name__}")
                    params[target].weight_loader(params[target], tensor, shard)
                    break
            else:
                target = name
                if target not in params:
                    raise ValueError(f"unexpected weight {name!r} for {type(self).__name__}")
                load_plain(params[target], target, tensor)
            loaded.add(target)
        missing = sorted(set(params) - loaded)
        if missing:
            raise ValueError(f"checkpoint is missing {len(missing)} weight(s), e.g. {', '.join(missing[:5])}")


class BertForMaskedLM(BertModel):
    pass


class RobertaModel(BertModel):
    pass


class RobertaForMaskedLM(BertModel):
    pass


class XLMRobertaModel(BertModel):
    pass


class XLMRobertaForMaskedLM(BertModel):
    pass
