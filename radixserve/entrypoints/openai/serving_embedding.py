"""POST /v1/embeddings (OpenAI) and POST /encode (native) on a server started with --is-embedding.

A causal model used as an encoder: each input runs as a prefill-only request through the same scheduler (and radix
cache) as generation; its final hidden states are pooled (the last token's, or the mean over all tokens) and
L2-normalised. An encoder-only model (BERT, XLM-R: models/bert.py) runs the same way, each input whole, without the
radix cache (configs/encoder.py), and may also pool its first token ("cls"). The pooling comes from
--pooling-method, else the model folder's sentence-transformers `1_Pooling/config.json`, else "last"; the vectors
are normalised unless the folder's `modules.json` lists no Normalize module. `dimensions` is honoured when the
model says it was trained for shortened embeddings (`matryoshka_dimensions` or `is_matryoshka` in its config.json):
the vector is cut and normalised again; otherwise only the full size is accepted."""

from __future__ import annotations

import base64
import json
import math
import os
from typing import Any, Literal

from fastapi import Request
from fastapi.responses import Response
from pydantic import Field

from radixserve.configs.encoder import is_classifier
from radixserve.entrypoints.http_utils import json_response, parse_model, until_disconnected
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.protocol import _Strict
from radixserve.entrypoints.openai.serving_base import OpenAIServingBase
from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import RequestError

POOLING_METHODS = ("last", "mean", "cls")
MAX_INPUTS = 2048  # OpenAI's limit on inputs per request


class EmbeddingRequest(_Strict):
    input: str | list[str] | list[int] | list[list[int]]
    model: str | None = None
    encoding_format: Literal["float", "base64"] | None = None
    dimensions: int | None = Field(default=None, ge=1)
    user: str | None = None  # changes nothing (as on the other routes)
    lora_path: str | None = None  # SGLang extension: a LoRA adapter's name (or say it in `model`)


class EncodeRequest(_Strict):
    """POST /encode (SGLang's native shape)."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    rid: str | list[str] | None = None
    lora_path: str | None = None  # a LoRA adapter's name


def model_pooling(model_path: str | None, override: str | None, encoder: bool = False) -> str:
    """The pooling of an embedding model: the flag, else the sentence-transformers Pooling config, else "last".
    "cls" (the first token) only for an encoder: a causal model's first token sees nothing after it."""
    pooling = _model_pooling(model_path, override)
    if pooling == "cls" and not encoder:
        raise ValueError("CLS pooling needs an encoder-only model (BERT, XLM-R); this causal model can pool the last "
                         "token or the mean: choose one with --pooling-method")
    return pooling


def _model_pooling(model_path: str | None, override: str | None) -> str:
    if override is not None:
        return override
    if model_path and os.path.isdir(model_path):
        folder = "1_Pooling"
        modules = os.path.join(model_path, "modules.json")
        if os.path.isfile(modules):
            with open(modules, encoding="utf-8") as f:
                for m in json.load(f):
                    if str(m.get("type", "")).endswith("Pooling"):
                        folder = m.get("path") or folder
        cfg_path = os.path.join(model_path, folder, "config.json")
        if os.path.isfile(cfg_path):
            with open(cfg_path, encoding="utf-8") as f:
                cfg = json.load(f)
            if cfg.get("pooling_mode_lasttoken"):
                return "last"
            if cfg.get("pooling_mode_mean_tokens"):
                return "mean"
            if cfg.get("pooling_mode_cls_token"):
                return "cls"
            modes = sorted(k for k, v in cfg.items() if k.startswith("pooling_mode_") and v)
            raise ValueError(f"{cfg_path}: pooling {', '.join(modes) or 'none'} is not supported (last token, mean "
                             "or CLS only); choose one with --pooling-method")
    return "last"


def _matryoshka(hf_config: Any) -> list[int] | bool:
    dims = getattr(hf_config, "matryoshka_dimensions", None)
    if dims:
        return [int(d) for d in dims]
    return bool(getattr(hf_config, "is_matryoshka", False))


def _cut(vec: list[float], dims: int) -> list[float]:
    v = vec[:dims]
    norm = math.sqrt(sum(x * x for x in v))
    return [x / norm for x in v] if norm > 0 else v


def _b64(vec: list[float]) -> str:
    import numpy as np

    return base64.b64encode(np.asarray(vec, dtype="<f4").tobytes()).decode("ascii")


class OpenAIServingEmbedding(OpenAIServingBase):
    object_prefix = "embd"

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        mc = getattr(self.tm, "model_config", None)
        # a cross-encoder (reranker) serves /v1/rerank and /v1/score (serving_score.py): its head's scores on the
        # first token come back as each pair's "embedding" (/encode gives them raw; /v1/embeddings refuses it)
        self.cross_encoder = is_classifier(getattr(mc, "architectures", None))
        self.num_labels = int(getattr(getattr(mc, "hf_config", None), "num_labels", 1) or 1)
        self.pooling = "cls" if self.cross_encoder else model_pooling(
            getattr(mc, "model_path", None), getattr(self.tm.server_args, "pooling_method", None),
            getattr(mc, "is_encoder", False))
        self.hidden_size = int(getattr(mc, "hidden_size", 0) or 0)
        self.matryoshka = _matryoshka(getattr(mc, "hf_config", None))

    def _check_dimensions(self, dims: int | None) -> None:
        if dims is None or dims == self.hidden_size:
            return
        ok = dims <= self.hidden_size and (self.matryoshka is True or (isinstance(self.matryoshka, list)
                                                                      and dims in self.matryoshka))
        if not ok:
            allowed = (f"one of {self.matryoshka}" if isinstance(self.matryoshka, list) else
                       f"1..{self.hidden_size}" if self.matryoshka else f"only {self.hidden_size} (the model was not "
                       "trained for shortened embeddings)")
            raise APIError(f"dimensions: {dims} is not supported by this model: {allowed}", 400, "dimensions",
                           "invalid_value")

    async def _inputs(self, value: Any, param: str) -> list[list[int]]:
        if isinstance(value, str):
            items: list[Any] = [value]
        elif not value:
            raise APIError(f"{param}: must not be empty", 400, param, "invalid_value")
        elif isinstance(value[0], int):
            items = [value]
        else:
            items = list(value)
        if len(items) > MAX_INPUTS:
            raise APIError(f"{param}: at most {MAX_INPUTS} inputs per request, got {len(items)}", 400, param,
                           "invalid_value")
        out = []
        for i, item in enumerate(items):
            where = param if len(items) == 1 else f"{param}[{i}]"
            if not item:
                raise APIError(f"{where}: must not be empty", 400, param, "invalid_value")
            ids = await self.tokenize(item, param) if isinstance(item, str) else list(item)
            if len(ids) > self.tm.context_len:  # (no token is generated: a prompt may fill the context)
                raise APIError(f"{where}: {len(ids)} tokens; this model's maximum context length is "
                               f"{self.tm.context_len} tokens", 400, param, "context_length_exceeded")
            out.append(ids)
        return out

    async def embed(self, request: Request, ids: list[list[int]], rid: str | list[str] | None,
                    param: str, lora: str | None = None) -> list[dict[str, Any]]:
        """Run the inputs as prefill-only requests; their outputs (meta_info["embedding"]), in input order."""
        obj = io.GenerateReqInput(input_ids=ids[0] if len(ids) == 1 else ids, rid=rid, pooling=self.pooling,
                                  lora_path=lora)

        async def run() -> list[dict[str, Any]]:
            return [o async for o in self.tm.generate_request(obj)]

        try:
            outs = await until_disconnected(request, run())
        except RequestError as e:
            raise from_request_error(e, prompt_param=param, openai=True) from None
        outs.sort(key=lambda o: o.get("index", 0))
        for o in outs:
            if "embedding" not in o["meta_info"]:  # aborted (e.g. the server is shutting down)
                reason = o["meta_info"].get("finish_reason") or {}
                raise APIError(f"the request did not finish: {reason.get('message', reason)}", 503, None,
                               "aborted")
        return outs

    def _check_embedder(self) -> None:
        if self.cross_encoder:
            raise APIError("this model is a cross-encoder (reranker): it scores text pairs through /v1/rerank or "
                           "/v1/score, not embeddings", 400, "model", "wrong_server_kind")

    async def create(self, request: Request, body: dict[str, Any]) -> Response:
        self._check_embedder()
        req = parse_model(EmbeddingRequest, body)
        lora = self.resolve_lora(req.model, req.lora_path)  # an adapter's name selects it, as on the other routes
        self._check_dimensions(req.dimensions)
        ids = await self._inputs(req.input, "input")
        outs = await self.embed(request, ids, None, "input", lora)
        data = []
        for i, out in enumerate(outs):
            vec = out["meta_info"]["embedding"]
            if req.dimensions is not None and req.dimensions != len(vec):
                vec = _cut(vec, req.dimensions)
            data.append({"object": "embedding", "index": i,
                         "embedding": _b64(vec) if req.encoding_format == "base64" else vec})
        n = sum(len(x) for x in ids)
        return json_response({"object": "list", "data": data, "model": self.response_model(req),
                              "usage": {"prompt_tokens": n, "total_tokens": n}})

    async def encode(self, request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(EncodeRequest, body)
        if (req.text is None) == (req.input_ids is None):
            raise APIError("give exactly one of text and input_ids", 400, "text", "invalid_value")
        param = "text" if req.text is not None else "input_ids"
        value = req.text if req.text is not None else req.input_ids
        batch = isinstance(value, list) and bool(value) and not isinstance(value[0], int)
        ids = await self._inputs(value, param)
        if batch and isinstance(req.rid, str):
            raise APIError("rid: a batched request needs a list of rids (one per input)", 400, "rid",
                           "invalid_value")
        outs = await self.embed(request, ids, req.rid, param, self.resolve_lora(None, req.lora_path))
        result = [{"embedding": o["meta_info"]["embedding"], "meta_info": {
            k: v for k, v in o["meta_info"].items() if k != "embedding"}} for o in outs]
        return json_response(result if batch else result[0])
