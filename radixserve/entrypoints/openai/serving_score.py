"""POST /v1/rerank (the Cohere / Jina shape SGLang and vLLM accept) and POST /v1/score (vLLM's) on a server whose
model is a cross-encoder (`*ForSequenceClassification`: bge-reranker, ms-marco MiniLM; models/bert_rerank.py).

Each (query, document) pair is tokenized as one pair (`tokenizer(query, document)`: `[CLS] q [SEP] d [SEP]`,
`<s> q </s></s> d </s>`) and runs as a pooled prefill-only request, through the same path as /v1/embeddings: the
classification head's output comes back as the request's (unnormalised) "embedding" vector, [logit] for a
reranker. All pairs of one HTTP request are submitted together, so they share forwards. The score is
sigmoid(logit), as vLLM's score / rerank APIs return for a model with one label (and sentence-transformers'
CrossEncoder for one label); a model with several labels is refused. A pair longer than the model's context is a
400: nothing is truncated.

rerank: {"query", "documents": [str | {"text"}], "top_n"?, "return_documents"? (default true, as SGLang and vLLM)}
-> {"id", "model", "results": [{"index", "relevance_score", "document"?: {"text"}}] by score, best first, "usage"}.
score: {"text_1": str | [str], "text_2": str | [str]} (one against many, or pairwise lists of one length)
-> {"id", "object": "list", "created", "model", "data": [{"index", "object": "score", "score"}], "usage"}."""

from __future__ import annotations

import math
import time
import uuid
from typing import Any

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from radixserve.entrypoints.http_utils import json_response, parse_model
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.protocol import _Strict
from radixserve.managers.tokenizer_manager import RequestError

MAX_PAIRS = 2048  # as /v1/embeddings' inputs per request


class RerankDocument(_Strict):
    text: str


class RerankRequest(_Strict):
    query: str
    documents: list[str | RerankDocument]
    model: str | None = None
    top_n: int | None = Field(default=None, ge=1)
    return_documents: bool = True
    user: str | None = None  # changes nothing (as on the other routes)


class ScoreRequest(_Strict):
    text_1: str | list[str]
    text_2: str | list[str]
    model: str | None = None
    user: str | None = None


class ScoreInputError(ValueError):
    """A request that cannot be scored; `param` names the field (the HTTP layer answers 400)."""

    def __init__(self, message: str, param: str | None) -> None:
        super().__init__(message)
        self.param = param


def score_pairs(text_1: str | list[str], text_2: str | list[str]) -> list[tuple[str, str]]:
    """The (text_1, text_2) pairs of a score request: one text against a list (either side), or two lists of
    the same length paired item by item."""
    first = [text_1] if isinstance(text_1, str) else list(text_1)
    second = [text_2] if isinstance(text_2, str) else list(text_2)
    for name, items in (("text_1", first), ("text_2", second)):
        if not items:
            raise ScoreInputError(f"{name}: must not be empty", name)
    if len(first) == 1:
        first = first * len(second)
    elif len(second) == 1:
        second = second * len(first)
    elif len(first) != len(second):
        raise ScoreInputError(f"text_1 has {len(first)} texts and text_2 {len(second)}: give one text on a side, "
                              "or lists of the same length", "text_2")
    return list(zip(first, second, strict=True))


def rerank_pairs(query: str, documents: list[str]) -> list[tuple[str, str]]:
    if not query:
        raise ScoreInputError("query: must not be empty", "query")
    if not documents:
        raise ScoreInputError("documents: must not be empty", "documents")
    return [(query, d) for d in documents]


def check_pair_count(n: int, param: str) -> None:
    if n > MAX_PAIRS:
        raise ScoreInputError(f"{param}: at most {MAX_PAIRS} pairs per request, got {n}", param)


def check_num_labels(num_labels: int) -> None:
    if num_labels != 1:
        raise ScoreInputError(f"this cross-encoder has {num_labels} labels: rerank and score need a model with one "
                              "relevance score (num_labels 1)", "model")


def sigmoid(x: float) -> float:
    return 1.0 / (1.0 + math.exp(-x)) if x >= 0 else math.exp(x) / (1.0 + math.exp(x))


def relevance_scores(vectors: list[list[float]]) -> list[float]:
    """Each pair's score from the head's output [logit]: sigmoid(logit)."""
    return [sigmoid(float(v[0])) for v in vectors]


def ranked(scores: list[float], documents: list[str], top_n: int | None,
           return_documents: bool) -> list[dict[str, Any]]:
    """Rerank results, best first (ties keep the input order), the first `top_n` of them."""
    if top_n is not None and top_n < 1:
        raise ScoreInputError(f"top_n: must be at least 1, got {top_n}", "top_n")
    order = sorted(range(len(scores)), key=lambda i: -scores[i])[:top_n]
    out = []
    for i in order:
        item: dict[str, Any] = {"index": i, "relevance_score": scores[i]}
        if return_documents:
            item["document"] = {"text": documents[i]}
        out.append(item)
    return out


def _api_error(e: ScoreInputError) -> APIError:
    return APIError(str(e), 400, e.param, "invalid_value")


class OpenAIServingScore:
    """The routes' handlers, on the embedding server's OpenAIServingEmbedding (its tokenizer manager and `embed`)."""

    def __init__(self, embeddings: Any) -> None:
        self.embeddings = embeddings
        self.tm = embeddings.tm

    async def _pair_ids(self, pairs: list[tuple[str, str]], param: str) -> list[list[int]]:
        out = []
        for i, (a, b) in enumerate(pairs):
            where = param if len(pairs) == 1 else f"{param}[{i}]"
            try:
                self.tm.check_text_length(len(a) + len(b), param)
            except RequestError as e:
                raise from_request_error(e, prompt_param=param, openai=True) from None
            ids = await self.embeddings.tokenize(a, param, text_pair=b)
            if len(ids) > self.tm.context_len:
                raise APIError(f"{where}: the pair has {len(ids)} tokens; this model's maximum context length is "
                               f"{self.tm.context_len} tokens", 400, param, "context_length_exceeded")
            out.append(ids)
        return out

    async def _scores(self, request: Request, pairs: list[tuple[str, str]], param: str
                      ) -> tuple[list[float], int]:
        """Each pair's sigmoid score, and the tokens of all pairs."""
        ids = await self._pair_ids(pairs, param)
        outs = await self.embeddings.embed(request, ids, None, param)
        return relevance_scores([o["meta_info"]["embedding"] for o in outs]), sum(len(x) for x in ids)

    async def rerank(self, request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(RerankRequest, body)
        self.embeddings.check_model(req.model)
        docs = [d if isinstance(d, str) else d.text for d in req.documents]
        try:
            check_num_labels(self.embeddings.num_labels)
            pairs = rerank_pairs(req.query, docs)
            check_pair_count(len(pairs), "documents")
        except ScoreInputError as e:
            raise _api_error(e) from None
        scores, n = await self._scores(request, pairs, "documents")
        return json_response({"id": f"rerank-{uuid.uuid4().hex}", "model": self.embeddings.response_model(req),
                              "results": ranked(scores, docs, req.top_n, req.return_documents),
                              "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def score(self, request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(ScoreRequest, body)
        self.embeddings.check_model(req.model)
        try:
            check_num_labels(self.embeddings.num_labels)
            pairs = score_pairs(req.text_1, req.text_2)
            check_pair_count(len(pairs), "text_2")
        except ScoreInputError as e:
            raise _api_error(e) from None
        scores, n = await self._scores(request, pairs, "text_2")
        return json_response({"id": f"score-{uuid.uuid4().hex}", "object": "list", "created": int(time.time()),
                              "model": self.embeddings.response_model(req),
                              "data": [{"index": i, "object": "score", "score": s} for i, s in enumerate(scores)],
                              "usage": {"prompt_tokens": n, "total_tokens": n}})


def score_service(state: Any) -> OpenAIServingScore:
    """The handlers on this server (state: the routes' ServerState), or a 400 when its model is no cross-encoder."""
    emb = state.embeddings
    if emb is None or not getattr(emb, "cross_encoder", False):
        archs = getattr(getattr(state.tm, "model_config", None), "architectures", None) or ["unknown"]
        raise APIError(f"rerank and score need a cross-encoder model (BertForSequenceClassification, "
                       f"XLMRobertaForSequenceClassification: bge-reranker, ms-marco MiniLM); this server's model is "
                       f"a {archs[0]}", 400, "model", "wrong_server_kind")
    return OpenAIServingScore(emb)
