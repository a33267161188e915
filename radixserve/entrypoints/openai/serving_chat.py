"""POST /v1/chat/completions: messages through the tokenizer's chat template, `n`, `logprobs`/`top_logprobs`,
`response_format`, streaming."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response, parse_model, sse_event
from radixserve.entrypoints.openai.chat_prompt import ChatPromptError, encode_pieces, split_prompt
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, ChatMessage
from radixserve.entrypoints.openai.serving_base import (
    OpenAIServingBase,
    finish_reason_str,
    matched_stop,
)
from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import RequestError


def _flatten_content(msg: ChatMessage, i: int) -> str:
    content = msg.content
    if content is None:
        if msg.role in ("assistant", "tool"):
            return ""
        raise APIError(f"messages[{i}].content: required for role '{msg.role}'", 400, f"messages[{i}].content",
                       "invalid_value")
    if isinstance(content, str):
        return content
    parts = []
    for j, part in enumerate(content):
        if part.type != "text":
            raise APIError(f"messages[{i}].content[{j}].type: only 'text' content parts are supported, got "
                           f"{part.type!r}", 400, f"messages[{i}].content[{j}].type", "unsupported_parameter")
        if part.text is None:
            raise APIError(f"messages[{i}].content[{j}].text: required for a text part", 400,
                           f"messages[{i}].content[{j}].text", "invalid_value")
        parts.append(part.text)
    return "".join(parts)


class OpenAIServingChat(OpenAIServingBase):
    object_prefix = "chatcmpl"

    async def apply_chat_template(self, req: ChatCompletionRequest) -> list[int]:
        tok = self.tm.tokenizer
        if tok is None:
            raise APIError("chat completions need a tokenizer; this server runs with --skip-tokenizer-init", 400,
                           "messages")
        if not getattr(tok, "chat_template", None):
            raise APIError("this model has no chat template: start the server with --chat-template FILE, or use "
                           "/v1/completions", 400, "messages", "no_chat_template")
        messages = []
        try:
            self.tm.check_text_length(sum(len(_flatten_content(m, i)) for i, m in enumerate(req.messages)))
        except RequestError as e:
            raise from_request_error(e, prompt_param="messages", openai=True) from None
        for i, m in enumerate(req.messages):
            entry = {"role": "system" if m.role == "developer" else m.role, "content": _flatten_content(m, i)}
            if m.name is not None:
                entry["name"] = m.name
            messages.append(entry)
        parse_special = self.tm.server_args.parse_special_tokens_in_messages
        try:
            pieces = split_prompt(tok, messages, parse_special)
            return await self.tm.run_on_tokenizer_thread(encode_pieces, tok, pieces)
        except ChatPromptError as e:
            raise APIError(f"messages: {e}", 400, "messages", "invalid_value") from None

    def _sampling(self, req: ChatCompletionRequest, max_new: int) -> dict[str, Any]:
        return self.sampling_params(req, max_new)  # response_format is handled there (chat and completions)

    async def create(self, request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(ChatCompletionRequest, body)
        self.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", 400, "top_logprobs", "invalid_value")
        ids = await self.apply_chat_template(req)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if requested is None:
            if len(ids) >= self.tm.context_len:
                self.check_length(len(ids), 0, "messages")
            max_new = self.tm.context_len - len(ids)
        else:
            max_new = requested
            self.check_length(len(ids), max_new, "messages")
        sp = self._sampling(req, max_new)
        want_lp = bool(req.logprobs)
        top_n = req.top_logprobs or 0
        rid, _ = self.make_rid(req, 1)
        obj = io.GenerateReqInput(input_ids=ids, sampling_params=sp, rid=rid, stream=req.stream,
                                  return_logprob=want_lp, logprob_start_len=-1, top_logprobs_num=top_n)
        if req.stream:
            return await self.stream(request, obj, "messages",
                                     lambda outs: self._render_stream(req, outs, len(ids), rid))
        outs = await self.collect(request, obj, "messages")
        choices = []
        completion_tokens = 0
        for k, out in enumerate(outs):
            meta = out["meta_info"]
            logprobs = None
            if want_lp:
                logprobs = {"content": self.chat_logprob_entries(list(meta.get("output_token_logprobs") or []),
                                                                 list(meta.get("output_top_logprobs") or [])),
                            "refusal": None}
            reason = meta.get("finish_reason")
            choices.append({"index": k, "message": {"role": "assistant", "content": out["text"], "refusal": None},
                            "logprobs": logprobs, "finish_reason": finish_reason_str(reason),
                            "matched_stop": matched_stop(reason)})
            completion_tokens += meta.get("completion_tokens", 0)
        resp = self.base_response(rid, "chat.completion")
        resp["choices"] = choices
        resp["usage"] = self.usage(len(ids), completion_tokens, outs[0]["meta_info"].get("cached_tokens", 0)
                                   if outs else 0)
        resp["system_fingerprint"] = None
        return json_response(resp)

    async def _render_stream(self, req: ChatCompletionRequest, outs: AsyncIterator[dict[str, Any]], prompt_len: int,
                             rid: str) -> AsyncIterator[bytes]:
        base = self.base_response(rid, "chat.completion.chunk")
        base["system_fingerprint"] = None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        want_lp = bool(req.logprobs)
        sent_text: dict[int, int] = {}
        sent_lp: dict[int, int] = {}
        completion: dict[int, int] = {}
        cached = 0
        async for out in outs:
            k = out.get("index", 0)
            meta = out["meta_info"]
            first = k not in sent_text
            text = out["text"]
            delta_text = text[sent_text.get(k, 0):]
            sent_text[k] = len(text)
            completion[k] = meta.get("completion_tokens", 0)
            if k == 0:
                cached = meta.get("cached_tokens", 0)
            logprobs = None
            if want_lp:
                token_lps = list(meta.get("output_token_logprobs") or [])
                top_lps = list(meta.get("output_top_logprobs") or [])
                start = sent_lp.get(k, 0)
                sent_lp[k] = len(token_lps)
                if len(token_lps) > start:
                    logprobs = {"content": self.chat_logprob_entries(token_lps[start:], top_lps[start:]),
                                "refusal": None}
            reason = meta.get("finish_reason")
            usage = self.usage(prompt_len, sum(completion.values()), cached) if continuous else None
            if first:
                chunk = dict(base)
                chunk["choices"] = [{"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                                     "finish_reason": None}]
                if include_usage or continuous:
                    chunk["usage"] = usage
                yield sse_event(chunk)
            if delta_text or logprobs is not None:
                chunk = dict(base)
                chunk["choices"] = [{"index": k, "delta": {"content": delta_text}, "logprobs": logprobs,
                                     "finish_reason": None}]
                if include_usage or continuous:
                    chunk["usage"] = usage
                yield sse_event(chunk)
            if reason is not None:
                chunk = dict(base)
                chunk["choices"] = [{"index": k, "delta": {}, "logprobs": None,
                                     "finish_reason": finish_reason_str(reason), "matched_stop": matched_stop(reason)}]
                if include_usage or continuous:
                    chunk["usage"] = usage
                yield sse_event(chunk)
        if include_usage:
            chunk = dict(base)
            chunk["choices"] = []
            chunk["usage"] = self.usage(prompt_len, sum(completion.values()), cached)
            yield sse_event(chunk)
