"""Cross-encoders (rerankers): `BertForSequenceClassification` (ms-marco MiniLM cross-encoders) and
`XLMRobertaForSequenceClassification` / `RobertaForSequenceClassification` (bge-reranker-base / -large / -v2-m3):
the encoder of models/bert.py and its classification head on the first token's final hidden state, giving
`num_labels` scores (1 for a reranker: its relevance logit).

Heads, as transformers builds them: BERT pools the [CLS] row through `bert.pooler.dense` + tanh, then `classifier`;
RoBERTa / XLM-R take the <s> row through `classifier.dense` + tanh, then `classifier.out_proj` (dropout is off at
inference). Every pooled request of a forward gets the head's scores, whatever its pooling kind (the serving layer
asks for "cls", so the scheduler keeps the row as it is and, for a classifier, does not normalise it).

Token types. A query and a document are encoded as one pair, `[CLS] q [SEP] d [SEP]`, and BERT adds the type-1
embedding to the second segment (d and its [SEP]). Rather than carrying a per-token type array through the request
path (tokenizer manager, scheduler, batch, forward batch), this model derives it from the ids: a token's type is 1
when its request has a [SEP] before it, which is exactly the tokenizer's pair layout (one [SEP] between the
segments). A single text (`[CLS] t [SEP]`) stays all type 0. The [SEP] id comes from `config.sep_token_id`, which
configs/encoder.py fills in from the model's tokenizer when config.json has none (BERT's usually has none). The one
difference from transformers: a literal "[SEP]" typed inside the query would end its segment early. RoBERTa / XLM-R
tokenizers give every token type 0 (`<s> q </s></s> d </s>`; their checkpoints have type_vocab_size 1), so nothing
is derived for them."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.models.bert import BertModel

if TYPE_CHECKING:
    from transformers import PretrainedConfig


class Dense(nn.Module):
    """y = x W^T + b, replicated on every TP rank (the heads are small: hidden x hidden and hidden x num_labels)."""

    def __init__(self, in_features: int, out_features: int) -> None:
        super().__init__()
        self.weight = nn.Parameter(torch.empty(out_features, in_features), requires_grad=False)
        self.bias = nn.Parameter(torch.empty(out_features), requires_grad=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight, self.bias)


def pair_token_types(input_ids: torch.Tensor, lens: torch.Tensor, sep_token_id: int) -> torch.Tensor:
    """Token type ids [T] of requests of `lens` tokens laid end to end: 1 after the first [SEP] of the token's own
    request, else 0 (the tokenizer's pair encoding: [CLS] a [SEP] -> 0, b [SEP] -> 1)."""
    sep = (input_ids == sep_token_id).to(torch.int64)
    total = torch.cumsum(sep, 0)
    starts = torch.cumsum(lens, 0) - lens
    earlier = torch.repeat_interleave((total - sep)[starts], lens)  # [SEP]s of the requests before this one
    return ((total - sep - earlier) > 0).to(torch.int64)


class _CrossEncoder(BertModel):
    skipped_weights = ()  # BERT's pooler is part of the head here; classifier checkpoints have no MLM head

    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self.num_labels = int(config.num_labels)
        if self.num_labels < 1:
            raise ValueError(f"num_labels must be at least 1, got {self.num_labels}")
        self.sep_token_id: int | None = None
        if not self.offset and max(1, getattr(config, "type_vocab_size", 2)) > 1:  # BERT (not RoBERTa / XLM-R)
            sep = getattr(config, "sep_token_id", None)
            if sep is None:
                raise ValueError(f"{type(self).__name__} has {config.type_vocab_size} token types: the second "
                                 "segment of a pair starts after the first [SEP], whose id neither config.json "
                                 "(sep_token_id) nor the tokenizer gives")
            self.sep_token_id = int(sep)

    def token_types(self, input_ids: torch.Tensor, lens: torch.Tensor) -> torch.Tensor | None:
        return None if self.sep_token_id is None else pair_token_types(input_ids, lens, self.sep_token_id)

    def head(self, first: torch.Tensor) -> torch.Tensor:
        raise NotImplementedError

    def pool(self, hidden: torch.Tensor, lens: torch.Tensor, pooling: list[str | None]) -> torch.Tensor:
        """The head's scores [bs, num_labels] (float32) on each request's first token."""
        starts = torch.cumsum(lens, 0) - lens
        return self.head(hidden[starts]).float()


class BertForSequenceClassification(_CrossEncoder):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self.pooler = nn.Module()
        self.pooler.dense = Dense(config.hidden_size, config.hidden_size)
        self.classifier = Dense(config.hidden_size, self.num_labels)

    def head(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier(torch.tanh(self.pooler.dense(first)))


class RobertaForSequenceClassification(_CrossEncoder):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__(config, tp_rank, tp_size)
        self.classifier = nn.Module()
        self.classifier.dense = Dense(config.hidden_size, config.hidden_size)
        self.classifier.out_proj = Dense(config.hidden_size, self.num_labels)

    def head(self, first: torch.Tensor) -> torch.Tensor:
        return self.classifier.out_proj(torch.tanh(self.classifier.dense(first)))


class XLMRobertaForSequenceClassification(RobertaForSequenceClassification):
    pass
