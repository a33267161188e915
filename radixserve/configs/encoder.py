"""Encoder-only embedding models (BERT, RoBERTa, XLM-RoBERTa: bge, e5, gte, all-MiniLM, bge-m3): what the engine must
know about them before the model is built.

An encoder attends bidirectionally over each request's own tokens (models/bert.py computes that attention itself;
nothing goes through the KV pool). So a request's hidden states depend on all of its tokens: an encoder request is
never split over prefill chunks, never takes a cached prefix (a prefix's hidden states change with what follows),
and never decodes. `apply_encoder_args` forces that for the whole server: embeddings on, radix cache off, chunked
prefill off, no CUDA graphs (they capture decode steps) and no speculative decoding."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

# the architectures models/bert.py serves (sentence-transformers folders name the bare models; MLM checkpoints keep
# their weights under a `bert.` / `roberta.` prefix, which the loader strips)
# cross-encoders (rerankers: models/bert_rerank.py): the encoder and a classification head, scoring text pairs
CLASSIFIER_ARCHITECTURES = ("BertForSequenceClassification", "RobertaForSequenceClassification",
                            "XLMRobertaForSequenceClassification")
ENCODER_ARCHITECTURES = ("BertModel", "BertForMaskedLM", "RobertaModel", "RobertaForMaskedLM", "XLMRobertaModel",
                         "XLMRobertaForMaskedLM", *CLASSIFIER_ARCHITECTURES)


def is_encoder(architectures: list[str] | None) -> bool:
    """Whether the first architecture the registry would pick is an encoder."""
    return bool(architectures) and architectures[0] in ENCODER_ARCHITECTURES


def is_classifier(architectures: list[str] | None) -> bool:
    """Whether the model is a cross-encoder: its pooled output is the classification head's scores of a pair."""
    return bool(architectures) and architectures[0] in CLASSIFIER_ARCHITECTURES


def position_offset(hf_config: Any) -> int:
    """The first position id: RoBERTa / XLM-R count positions from padding_idx + 1 (transformers'
    create_position_ids_from_input_ids), BERT from 0."""
    if getattr(hf_config, "model_type", None) in ("roberta", "xlm-roberta"):
        return int(getattr(hf_config, "pad_token_id", 1) or 0) + 1
    return 0


def encoder_max_tokens(hf_config: Any) -> int:
    """The longest input the position table covers: max_position_embeddings less RoBERTa's offset (XLM-R base:
    514 - 2 = 512; bge-m3: 8194 - 2 = 8192)."""
    n = int(getattr(hf_config, "max_position_embeddings", 512)) - position_offset(hf_config)
    if n < 1:
        raise ValueError(f"max_position_embeddings {hf_config.max_position_embeddings} leaves no positions")
    return n


def apply_encoder_args(server_args: Any, model_config: Any) -> None:
    """Set what an encoder needs on `server_args` (in place; a no-op for other models or when already set), with a
    log line for each change; ValueError for what cannot work with an encoder."""
    if not getattr(model_config, "is_encoder", False):
        return
    arch = model_config.architectures[0]
    if server_args.speculative_algorithm is not None:
        raise ValueError(f"{arch} is an encoder (embeddings only): --speculative-algorithm does not apply")
    changes = []
    if not server_args.is_embedding:
        server_args.is_embedding = True
        changes.append("--is-embedding on")
    if not server_args.disable_radix_cache:
        server_args.disable_radix_cache = True
        changes.append("radix cache off (a prefix's hidden states depend on the tokens after it)")
    if server_args.chunked_prefill_size != -1:
        server_args.chunked_prefill_size = -1
        changes.append("chunked prefill off (a request attends to all of its tokens at once)")
    if not server_args.disable_cuda_graph:
        server_args.disable_cuda_graph = True
        changes.append("CUDA graphs off (they capture decode steps; an encoder never decodes)")
    if changes:
        logger.info("%s is an encoder-only model: %s", arch, "; ".join(changes))
    hf = model_config.hf_config
    if is_classifier(model_config.architectures) and not position_offset(hf) and \
            getattr(hf, "type_vocab_size", 2) > 1 and getattr(hf, "sep_token_id", None) is None:
        # a BERT cross-encoder derives a pair's token types from its first [SEP] (models/bert_rerank.py)
        hf.sep_token_id = _tokenizer_sep_id(server_args.tokenizer_path or model_config.tokenizer_path,
                                            server_args.trust_remote_code)


def _tokenizer_sep_id(path: str, trust_remote_code: bool) -> int:
    from transformers import AutoTokenizer

    try:
        sep = AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code).sep_token_id
    except (OSError, ValueError) as e:
        raise ValueError(f"a BERT cross-encoder needs its tokenizer's [SEP] id (token types of a pair): cannot "
                         f"load the tokenizer at {path}: {e}") from e
    if sep is None:
        raise ValueError(f"the tokenizer at {path} has no sep_token: a BERT cross-encoder needs it to find the "
                         "second segment of a pair")
    return int(sep)


def embedding_normalize(model_path: str | None, architectures: list[str] | None = None) -> bool:
    """Whether embeddings are L2-normalised: never for a cross-encoder (its output is the classifier's scores);
    else as the sentence-transformers `modules.json` says (a Normalize module) when the folder has one, else yes
    (OpenAI's embeddings are unit vectors)."""
    if is_classifier(architectures):
        return False
    path = os.path.join(model_path, "modules.json") if model_path and os.path.isdir(model_path) else None
    if path is None or not os.path.isfile(path):
        return True
    try:
        with open(path, encoding="utf-8") as f:
            modules = json.load(f)
    except (OSError, UnicodeDecodeError, json.JSONDecodeError) as e:
        raise ValueError(f"cannot read {path}: {e}") from e
    if not isinstance(modules, list):
        raise ValueError(f"{path}: expected a list of sentence-transformers modules")
    return any(str(m.get("type", "")).endswith("Normalize") for m in modules if isinstance(m, dict))
