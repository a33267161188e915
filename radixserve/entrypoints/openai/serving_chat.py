"""POST /v1/chat/completions: messages through the tokenizer's chat template, `n`, `logprobs`/`top_logprobs`,
`response_format`, streaming, tool calling and reasoning output (see chat_tools and chat_output)."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from dataclasses import dataclass
from typing import Any

from fastapi import Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response, parse_model, sse_event
from radixserve.entrypoints.openai.chat_output import ChoiceOutput, OutputConfig
from radixserve.entrypoints.openai.chat_prompt import ChatPromptError, encode_pieces, split_prompt
from radixserve.entrypoints.openai.chat_tools import (
    ToolPlan,
    output_config,
    plan_tools,
    template_kwargs,
    template_messages,
)
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
        for other in ("image_url", "input_audio", "file"):  # another kind's payload on a text part: not ignored
            if getattr(part, other) is not None:
                raise APIError(f"messages[{i}].content[{j}].{other}: a text part carries only text", 400,
                               f"messages[{i}].content[{j}].{other}", "invalid_value")
        parts.append(part.text)
    return "".join(parts)


@dataclass
class PreparedChat:
    """A chat request ready to run: the engine request, its id, the prompt's length and the output reader."""

    obj: io.GenerateReqInput
    rid: str
    prompt_len: int
    cfg: OutputConfig


def special_token_texts(tok: Any) -> tuple[str, ...]:
    """The texts of the tokenizer's special tokens (those skip_special_tokens drops)."""
    texts = set(getattr(tok, "all_special_tokens", None) or [])
    for added in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        if getattr(added, "special", False):
            texts.add(str(getattr(added, "content", added)))
    return tuple(sorted(texts))


class OpenAIServingChat(OpenAIServingBase):
    object_prefix = "chatcmpl"
    _special_texts: tuple[str, ...] | None = None

    def special_texts(self) -> tuple[str, ...]:
        if self._special_texts is None:
            tok = self.tm.tokenizer
            self._special_texts = special_token_texts(tok) if tok is not None else ()
        return self._special_texts

    async def apply_chat_template(self, req: ChatCompletionRequest, plan: ToolPlan | None = None
                                  ) -> tuple[list[int], str]:
        """The prompt's token ids and text."""
        tok = self.tm.tokenizer
        if tok is None:
            raise APIError("chat completions need a tokenizer; this server runs with --skip-tokenizer-init", 400,
                           "messages")
        template = getattr(tok, "chat_template", None)
        if not template:
            raise APIError("this model has no chat template: start the server with --chat-template FILE, or use "
                           "/v1/completions", 400, "messages", "no_chat_template")
        template = template if isinstance(template, str) else json.dumps(template)
        try:
            self.tm.check_text_length(sum(len(_flatten_content(m, i)) for i, m in enumerate(req.messages)))
        except RequestError as e:
            raise from_request_error(e, prompt_param="messages", openai=True) from None
        plan = plan or self.plan_tools(req)
        messages = template_messages(req, plan, template, _flatten_content)
        kwargs = template_kwargs(req, plan, template)
        parse_special = self.tm.server_args.parse_special_tokens_in_messages
        try:
            pieces = split_prompt(tok, messages, parse_special, **kwargs)
            ids = await self.tm.run_on_tokenizer_thread(encode_pieces, tok, pieces)
        except ChatPromptError as e:
            raise APIError(f"messages: {e}", 400, "messages", "invalid_value") from None
        return ids, "".join(text for text, _ in pieces)

    def plan_tools(self, req: ChatCompletionRequest) -> ToolPlan:
        template = getattr(self.tm.tokenizer, "chat_template", None) if self.tm.tokenizer is not None else None
        args = self.tm.server_args
        plan = plan_tools(req, getattr(args, "tool_call_parser", None),
                          template if isinstance(template, str) else None, self.grammar_ok)
        if plan.schema is not None:
            from radixserve.constrained import GrammarError, validate_grammar

            try:
                validate_grammar(args.grammar_backend, "json_schema", plan.schema)
            except GrammarError as e:
                raise APIError(f"tools: a function's parameters are not a usable JSON schema: {e}", 400, "tools",
                               "invalid_value") from None
        return plan

    def _sampling(self, req: ChatCompletionRequest, max_new: int, plan: ToolPlan) -> dict[str, Any]:
        sp = self.sampling_params(req, max_new)  # response_format is handled there (chat and completions)
        if plan.schema is not None:
            sp["json_schema"] = plan.schema
        return sp

    async def prepare(self, req: ChatCompletionRequest) -> PreparedChat:
        """Everything before generation: checks, the prompt, the sampling parameters and the output reader (also
        used by /v1/responses, which builds a chat request)."""
        lora = self.check_common(req)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError("top_logprobs: requires logprobs to be true", 400, "top_logprobs", "invalid_value")
        plan = self.plan_tools(req)
        ids, prompt_text = await self.apply_chat_template(req, plan)
        requested = req.max_completion_tokens if req.max_completion_tokens is not None else req.max_tokens
        if requested is None:
            if len(ids) >= self.tm.context_len:
                self.check_length(len(ids), 0, "messages")
            max_new = self.tm.context_len - len(ids)
        else:
            max_new = requested
            self.check_length(len(ids), max_new, "messages")
        sp = self._sampling(req, max_new, plan)
        cfg = output_config(req, plan, getattr(self.tm.server_args, "reasoning_parser", None), prompt_text,
                            json_output="json_schema" in sp, special_tokens=self.special_texts())
        if cfg.keep_special_tokens:  # the markers are special tokens: the parsers read them, content never
            sp["skip_special_tokens"] = False
            sp["spaces_between_special_tokens"] = False
        rid, _ = self.make_rid(req, 1)
        obj = io.GenerateReqInput(input_ids=ids, sampling_params=sp, rid=rid, stream=req.stream,
                                  return_logprob=bool(req.logprobs), logprob_start_len=-1,
                                  top_logprobs_num=req.top_logprobs or 0, lora_path=lora)
        return PreparedChat(obj, rid, len(ids), cfg)

    async def create(self, request: Request, body: dict[str, Any]) -> Response:
        req = parse_model(ChatCompletionRequest, body)
        prep = await self.prepare(req)
        obj, rid, cfg, prompt_len = prep.obj, prep.rid, prep.cfg, prep.prompt_len
        want_lp = bool(req.logprobs)
        if req.stream:
            return await self.stream(request, obj, "messages",
                                     lambda outs: self._render_stream(req, outs, prompt_len, rid, cfg))
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
            reader = ChoiceOutput(cfg)
            message = reader.message(out["text"])
            choices.append({"index": k, "message": message, "logprobs": logprobs,
                            "finish_reason": _finish(reason, reader.has_tool_calls),
                            "matched_stop": matched_stop(reason)})
            completion_tokens += meta.get("completion_tokens", 0)
        resp = self.base_response(rid, "chat.completion", req)
        resp["choices"] = choices
        resp["usage"] = self.usage(prompt_len, completion_tokens, outs[0]["meta_info"].get("cached_tokens", 0)
                                   if outs else 0)
        resp["system_fingerprint"] = None
        return json_response(resp)

    async def _render_stream(self, req: ChatCompletionRequest, outs: AsyncIterator[dict[str, Any]], prompt_len: int,
                             rid: str, cfg: OutputConfig) -> AsyncIterator[bytes]:
        base = self.base_response(rid, "chat.completion.chunk", req)
        base["system_fingerprint"] = None
        include_usage = bool(req.stream_options and req.stream_options.include_usage)
        continuous = bool(req.stream_options and req.stream_options.continuous_usage_stats)
        want_lp = bool(req.logprobs)
        readers: dict[int, ChoiceOutput] = {}
        sent_lp: dict[int, int] = {}
        completion: dict[int, int] = {}
        cached = 0
        async for out in outs:
            k = out.get("index", 0)
            meta = out["meta_info"]
            first = k not in readers
            reader = readers.setdefault(k, ChoiceOutput(cfg))
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

            def chunk(choice: dict[str, Any], usage: dict[str, Any] | None = usage) -> bytes:
                c = dict(base)
                c["choices"] = [choice]
                if include_usage or continuous:
                    c["usage"] = usage
                return sse_event(c)

            if first:
                yield chunk({"index": k, "delta": {"role": "assistant", "content": ""}, "logprobs": None,
                             "finish_reason": None})
            deltas = reader.deltas(out["text"], reason is not None)
            if not deltas and logprobs is not None:
                deltas = [{"content": ""}]
            for delta in deltas:
                yield chunk({"index": k, "delta": delta, "logprobs": logprobs, "finish_reason": None})
                logprobs = None
            if reason is not None:
                yield chunk({"index": k, "delta": {}, "logprobs": None,
                             "finish_reason": _finish(reason, reader.has_tool_calls),
                             "matched_stop": matched_stop(reason)})
        if include_usage:
            c = dict(base)
            c["choices"] = []
            c["usage"] = self.usage(prompt_len, sum(completion.values()), cached)
            yield sse_event(c)


def _finish(reason: dict[str, Any] | None, has_tool_calls: bool) -> str | None:
    """OpenAI's finish_reason; a complete answer that called tools ends with "tool_calls"."""
    text = finish_reason_str(reason)
    return "tool_calls" if has_tool_calls and text == "stop" else text
