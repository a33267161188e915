"""What /v1/completions and /v1/chat/completions share: model-name checks, OpenAI fields -> engine sampling
parameters, context-length checks, logprob formatting, usage, and running a request (collected or streamed)."""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import AsyncIterator, Callable
from functools import lru_cache
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import (
    SSE_DONE,
    json_response,
    stream_as_sse,
    until_disconnected,
)
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.feature_gates import check_openai_request
from radixserve.entrypoints.openai.protocol import _SamplingFields
from radixserve.managers import io_struct as io
from radixserve.managers.token_bytes import TextOffsets, token_bytes_fn
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager

logger = logging.getLogger(__name__)

# OpenAI field (or extension) -> SamplingParams field, copied when the request sets it.
_DIRECT_FIELDS = ("temperature", "top_p", "top_k", "min_p", "frequency_penalty", "presence_penalty",
                  "repetition_penalty", "logit_bias", "stop", "stop_token_ids", "ignore_eos", "skip_special_tokens",
                  "spaces_between_special_tokens", "no_stop_trim", "seed", "regex", "json_schema", "ebnf", "n")
GRAMMAR_FIELDS = ("regex", "json_schema", "ebnf")


def structured_output_available(grammar_backend: str) -> bool:
    """True once a grammar backend is registered in radixserve.constrained (and not disabled by flag)."""
    if grammar_backend == "none":
        return False
    try:
        import radixserve.constrained as constrained
    except ImportError:
        return False
    if not callable(getattr(constrained, "create_grammar_backend", None)):
        return False
    available = getattr(constrained, "is_backend_available", None)
    return bool(available(grammar_backend)) if callable(available) else True


def finish_reason_str(reason: dict[str, Any] | None) -> str | None:
    """OpenAI's finish_reason values; an aborted request never gets here (it is an error, see `_generate`)."""
    if not reason:
        return None
    kind = reason.get("type")
    return {"stop": "stop", "length": "length", "tool_calls": "tool_calls",
            "content_filter": "content_filter"}.get(kind, "stop")


def matched_stop(reason: dict[str, Any] | None) -> Any:
    if not reason or reason.get("type") != "stop":
        return None
    return reason.get("matched")


class OpenAIServingBase:
    """State and helpers of one OpenAI endpoint family; one instance per server."""

    object_prefix = "cmpl"

    def __init__(self, tokenizer_manager: TokenizerManager, served_model_name: str, model_aliases: tuple[str, ...],
                 grammar_ok: bool) -> None:
        self.tm = tokenizer_manager
        self.model_name = served_model_name
        self.accepted_models = {served_model_name, *model_aliases}
        self.grammar_ok = grammar_ok
        tok = tokenizer_manager.tokenizer

        @lru_cache(maxsize=1 << 16)
        def token_text(tid: int) -> str:
            if tok is None:
                return f"<{tid}>"
            return tok.decode([tid], skip_special_tokens=False)

        self.token_text: Callable[[int], str] = token_text
        self.token_bytes: Callable[[int], bytes] = token_bytes_fn(tok)

    # ------------------------------------------------------------------ validation
    def check_model(self, model: str | None) -> None:
        self.resolve_lora(model, None)

    def resolve_lora(self, model: str | None, lora_path: str | None) -> str | None:
        """The LoRA adapter a request asks for: `model` is the served model, an adapter's name, or
        `<served model>:<adapter>`; SGLang's `lora_path` may name the adapter too. None: the base model."""
        adapter = None
        if model is not None and model not in self.accepted_models:
            names = self.tm.lora_names or set()
            base, sep, tail = model.rpartition(":")
            if model in names:
                adapter = model
            elif sep and base in self.accepted_models and tail in names:
                adapter = tail
            else:
                served = ", ".join(sorted(names))
                raise APIError(f"The model `{model}` does not exist; this server serves `{self.model_name}`"
                               + (f" and the LoRA adapters {served}." if served else "."), 404, "model",
                               "model_not_found")
        if lora_path is not None:
            if adapter is not None and lora_path != adapter:
                raise APIError(f"lora_path {lora_path!r} and model {model!r} name different adapters", 400,
                               "lora_path", "invalid_value")
            try:
                adapter = self.tm.check_lora(lora_path)
            except RequestError as e:
                raise APIError(str(e), e.status_code, "lora_path", "invalid_value") from None
        return adapter

    def check_common(self, req: _SamplingFields) -> str | None:
        """Validate what chat and completions share; returns the LoRA adapter asked for (None: the base model)."""
        lora = self.resolve_lora(req.model, req.lora_path)
        check_openai_request(req)
        if req.rid is not None and any(k == req.rid or k.startswith(req.rid + "-") for k in self.tm.rid_to_state):
            raise APIError(f"rid: {req.rid!r} is already in use by a running request", 400, "rid", "invalid_value")
        if req.stream_options is not None and not req.stream:
            raise APIError("stream_options is only allowed when stream is true", 400, "stream_options")
        if not self.grammar_ok:
            for name in GRAMMAR_FIELDS:
                if getattr(req, name) is not None:
                    raise APIError(f"{name}: structured output is not available on this server (no grammar "
                                   "backend)", 400, name, "unsupported_parameter")
        return lora

    def check_length(self, prompt_len: int, max_new_tokens: int, param: str) -> None:
        ctx = self.tm.context_len
        if prompt_len >= ctx or prompt_len + max_new_tokens > ctx:
            raise APIError(f"This model's maximum context length is {ctx} tokens. However, you requested "
                           f"{prompt_len + max_new_tokens} tokens ({prompt_len} in the {param}, {max_new_tokens} in "
                           f"the completion). Please reduce the length of the {param} or completion.", 400, param,
                           "context_length_exceeded")

    def sampling_params(self, req: _SamplingFields, max_new_tokens: int) -> dict[str, Any]:
        sp: dict[str, Any] = {"max_new_tokens": max_new_tokens}
        for name in _DIRECT_FIELDS:
            value = getattr(req, name)
            if value is not None:
                sp[name] = value
        if req.min_tokens is not None:
            sp["min_new_tokens"] = req.min_tokens
        rf = getattr(req, "response_format", None)
        if rf is not None and rf.type != "json_schema" and rf.json_schema is not None:
            raise APIError(f"response_format.json_schema: only with type 'json_schema' (got type {rf.type!r})", 400,
                           "response_format.json_schema", "invalid_value")
        if rf is not None and rf.type != "text":
            if not self.grammar_ok:
                raise APIError(f"response_format: type {rf.type!r} needs structured output, which is not available "
                               "on this server (no grammar backend)", 400, "response_format",
                               "unsupported_parameter")
            if rf.type == "json_schema" and (rf.json_schema is None or rf.json_schema.schema_ is None):
                raise APIError("response_format.json_schema.schema: required when type is 'json_schema'", 400,
                               "response_format.json_schema.schema", "missing_required_parameter")
            if rf.json_schema is not None and rf.json_schema.description is not None:
                raise APIError("response_format.json_schema.description: not supported (OpenAI shows it to the model; "
                               "this server would not): put the instruction in the messages", 400,
                               "response_format.json_schema.description", "unsupported_parameter")
            schema = rf.json_schema.schema_ if rf.type == "json_schema" and rf.json_schema else None
            if any(k in sp for k in GRAMMAR_FIELDS):
                raise APIError("response_format: give at most one of response_format, regex, json_schema, ebnf", 400,
                               "response_format")
            sp["json_schema"] = json_schema_text(schema)
        return sp

    def make_rid(self, req: _SamplingFields, n_prompts: int) -> tuple[str, str | list[str]]:
        """(the response id, the engine rid(s)): one rid per prompt of a batch."""
        base = req.rid or uuid.uuid4().hex
        return base, (base if n_prompts == 1 else [f"{base}-p{i}" for i in range(n_prompts)])

    async def tokenize(self, text: str, param: str, **kwargs: Any) -> list[int]:
        """Off the event loop (see TokenizerManager.tokenize_async)."""
        try:
            return await self.tm.tokenize_async(text, **kwargs)
        except RequestError as e:
            raise from_request_error(e, prompt_param=param, openai=True) from None

    # ------------------------------------------------------------------ output helpers
    @staticmethod
    def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int) -> dict[str, Any]:
        return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
                "total_tokens": prompt_tokens + completion_tokens,
                "prompt_tokens_details": {"cached_tokens": cached_tokens}}

    def chat_logprob_entries(self, token_lps: list[Any], top_lps: list[Any] | None) -> list[dict[str, Any]]:
        out = []
        for k, (lp, tid) in enumerate((e[0], e[1]) for e in token_lps):
            text = self.token_text(int(tid))
            entry: dict[str, Any] = {"token": text, "logprob": lp, "bytes": list(self.token_bytes(int(tid))),
                                     "top_logprobs": []}
            if top_lps is not None and k < len(top_lps) and top_lps[k]:
                for tlp, ttid in top_lps[k]:
                    ttext = self.token_text(int(ttid))
                    entry["top_logprobs"].append({"token": ttext, "logprob": tlp,
                                                  "bytes": list(self.token_bytes(int(ttid)))})
            out.append(entry)
        return out

    def text_offsets(self, skip_special_tokens: bool | None, echo_ids: list[int] | None = None,
                     echo_text: str | None = None) -> TextOffsets:
        """A `text_offset` counter for one choice (see TextOffsets); `echo_ids`/`echo_text`: the echoed prompt."""
        tok = self.tm.tokenizer
        special = frozenset(getattr(tok, "all_special_ids", None) or [])
        skip = special if skip_special_tokens is not False else frozenset()
        if not echo_ids:
            return TextOffsets(self.token_bytes, skip)
        bos = getattr(tok, "bos_token_id", None)
        bos_text = getattr(tok, "bos_token", None) or ""
        prompt_skip = frozenset({bos}) if bos is not None and not (echo_text or "").startswith(bos_text) else \
            frozenset()
        return TextOffsets(self.token_bytes, skip, len(echo_ids), len(echo_text or ""), prompt_skip)

    def completion_logprobs(self, token_lps: list[Any], top_lps: list[Any] | None, want_top: bool,
                            offsets_of: TextOffsets) -> dict[str, Any]:
        tokens, token_logprobs, tops, offsets = [], [], [], []
        for k, e in enumerate(token_lps):
            lp, tid = e[0], e[1]
            text = self.token_text(int(tid))
            tokens.append(text)
            token_logprobs.append(lp)
            offsets.append(offsets_of.advance(int(tid)))
            if want_top:
                top = top_lps[k] if top_lps is not None and k < len(top_lps) else None
                tops.append({self.token_text(int(t)): v for v, t in top} if top else None)
        return {"tokens": tokens, "token_logprobs": token_logprobs, "top_logprobs": tops if want_top else None,
                "text_offset": offsets}

    # ------------------------------------------------------------------ running
    async def _generate(self, obj: io.GenerateReqInput) -> AsyncIterator[dict[str, Any]]:
        """The engine's outputs; an aborted request (by /abort_request, shutdown, the engine) is an APIError (an
        error response, or an error event in a stream), never a choice with finish_reason "abort"."""
        agen = self.tm.generate_request(obj)
        try:
            async for out in agen:
                reason = out["meta_info"].get("finish_reason")
                if reason and reason.get("type") == "abort":
                    raise APIError(f"the request was aborted: {reason.get('message') or 'aborted'}", 503, None,
                                   "request_aborted")
                yield out
        finally:
            await agen.aclose()

    async def collect(self, request: Request, obj: io.GenerateReqInput, prompt_param: str) -> list[dict[str, Any]]:
        async def run() -> list[dict[str, Any]]:
            return [o async for o in self._generate(obj)]

        try:
            outs = await until_disconnected(request, run())
        except RequestError as e:
            raise from_request_error(e, prompt_param=prompt_param, openai=True) from None
        outs.sort(key=lambda o: o.get("index", 0))
        return outs

    async def stream(self, request: Request, obj: io.GenerateReqInput, prompt_param: str,
                     render: Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[bytes]],
                     error_event: Callable[[APIError], bytes] | None = None, done: bytes | None = SSE_DONE
                     ) -> Response:
        """Start the request and wait for its first output (so bad input and overload are plain HTTP errors),
        then stream `render(outputs)` as server-sent events ending in `done`; a later error is an error event
        (`error_event`: its form, see stream_as_sse)."""
        return await stream_as_sse(request, self.tm, obj, render,
                                   lambda e: from_request_error(e, prompt_param=prompt_param, openai=True),
                                   generate=self._generate, error_event=error_event, done=done)

    def response_model(self, req: Any) -> str:
        """The `model` a response names: the LoRA adapter the request asked for, as it named it (in `model`, or
        SGLang's `lora_path`), else the served model."""
        model = getattr(req, "model", None)
        if model is not None and model not in self.accepted_models:  # an adapter (resolve_lora accepted it)
            return model
        lora = getattr(req, "lora_path", None)
        return lora if lora is not None else self.model_name

    def base_response(self, rid: str, obj_type: str, req: Any = None) -> dict[str, Any]:
        return {"id": f"{self.object_prefix}-{rid}", "object": obj_type, "created": int(time.time()),
                "model": self.response_model(req)}


def json_schema_text(schema: dict[str, Any] | None) -> str:
    return json.dumps(schema if schema is not None else {"type": "object"})


__all__ = ["OpenAIServingBase", "finish_reason_str", "json_response", "matched_stop", "structured_output_available"]
