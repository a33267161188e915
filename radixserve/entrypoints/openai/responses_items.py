"""The Responses API over the chat path: a /v1/responses request as the chat-completions request it runs, and the
chat answer (a message with reasoning and tool calls) as Responses output items and the response object.

- `input` items become chat messages: text messages (parts `input_text` / `output_text` joined), `function_call`
  items the assistant's `tool_calls` (consecutive calls, and a call after an assistant text, share one message),
  `function_call_output` items `tool` messages; `reasoning` items are accepted and left out (chat templates drop
  past thinking). `instructions` is a developer (system) message first.
- Function tools are the flat Responses form mapped to chat tools; `tool_choice` {"type": "function", "name"}
  likewise; `text.format` is chat's `response_format`; `reasoning.effort` reaches chat templates that take
  `reasoning_effort` (GPT-OSS's), and is a 400 elsewhere.
- `reasoning.summary` (or the older `generate_summary`) "auto" / "detailed": there is no summariser model, so the
  reasoning item's summary is its reasoning text itself (`summary: [{"type": "summary_text", "text"}]`);
  "concise" is a 400; null leaves `summary: []`.
- Storage (`store`, `previous_response_id`, GET/DELETE /v1/responses/{id}) is serving_responses' and
  response_store's: here the stored conversation (`history`) is read before `input`, and `input_items` writes the
  items to store. `conversation`, `prompt`, `background`, `include`, `truncation: "auto"`, `max_tool_calls` and
  `top_logprobs` are 400s unless null/default.
- Errors of the chat path name the Responses field (`remap_error`: `tools[0].function.name` -> `tools[0].name`,
  `messages` -> `input`, `response_format` -> `text.format`, `max_tokens` -> `max_output_tokens`)."""

from __future__ import annotations

import json
import re
import uuid
from typing import Any

from pydantic import BaseModel, ValidationError

from radixserve.entrypoints.openai.errors import APIError, from_validation_error
from radixserve.entrypoints.openai.protocol import (
    ResponsesFunctionCallItem,
    ResponsesFunctionCallOutputItem,
    ResponsesFunctionTool,
    ResponsesMessageItem,
    ResponsesReasoningItem,
    ResponsesRequest,
    ResponsesTextPart,
)

_ITEM_MODELS: dict[str, type[BaseModel]] = {
    "message": ResponsesMessageItem, "function_call": ResponsesFunctionCallItem,
    "function_call_output": ResponsesFunctionCallOutputItem, "reasoning": ResponsesReasoningItem,
}
_UNSUPPORTED_PART = {"input_image": "images", "input_file": "files", "input_audio": "audio", "refusal": "refusals"}


def new_item_id(prefix: str) -> str:
    return f"{prefix}_{uuid.uuid4().hex}"


def _unsupported(param: str, what: str) -> APIError:
    return APIError(f"{param}: {what}", 400, param, "unsupported_parameter")


def _invalid(param: str, what: str) -> APIError:
    return APIError(f"{param}: {what}", 400, param, "invalid_value")


# ---------------------------------------------------------------------------------------------- request checks
def check_request(req: ResponsesRequest) -> None:
    """Fields of features this server does not have: null/default values only."""
    if req.conversation is not None:
        raise _unsupported("conversation", "conversations are not stored by this server; send the items in input")
    if req.prompt is not None:
        raise _unsupported("prompt", "stored prompt templates are not supported; send instructions and input")
    if req.background:
        raise _unsupported("background", "background responses are not supported (they need storage); send false")
    if req.include:
        raise _unsupported("include", f"no extra output can be included, got {req.include!r}; send [] or null")
    if req.truncation == "auto":
        raise _unsupported("truncation", "'auto' is not supported: an input too long for the context is a 400; "
                                         "send 'disabled' or null")
    if req.max_tool_calls is not None:
        raise _unsupported("max_tool_calls", "not supported (parallel_tool_calls false allows one call); send null")
    if req.top_logprobs:
        raise _unsupported("top_logprobs", "logprobs are not returned by /v1/responses; send null or 0")
    for name in ("summary", "generate_summary"):
        if req.reasoning is not None and getattr(req.reasoning, name) == "concise":
            raise _unsupported(f"reasoning.{name}", "'concise' is not supported: this server has no summariser, the "
                                                    "summary is the model's reasoning text itself; send 'auto' or "
                                                    "'detailed' (or null for no summary)")
    if req.stream_options is not None:
        if not req.stream:
            raise _invalid("stream_options", "only allowed when stream is true")
        extra = sorted(set(req.stream_options) - {"include_obfuscation"})
        if extra:
            raise APIError(f"unknown parameter(s): {', '.join('stream_options.' + k for k in extra)}", 400,
                           f"stream_options.{extra[0]}", "unknown_parameter")
        value = req.stream_options.get("include_obfuscation")
        if value is not None and not isinstance(value, bool):
            raise _invalid("stream_options.include_obfuscation", f"must be a boolean, got {value!r}")


def wants_summary(req: ResponsesRequest) -> bool:
    """Whether reasoning items carry a summary (`reasoning.summary` or `generate_summary` set; check_request
    refused "concise")."""
    return req.reasoning is not None and (req.reasoning.summary or req.reasoning.generate_summary) is not None


def function_tools(req: ResponsesRequest) -> list[ResponsesFunctionTool]:
    """The request's tools: function tools only (hosted tools, MCP, custom tools are 400s)."""
    out = []
    for i, raw in enumerate(req.tools or []):
        kind = raw.get("type")
        if kind != "function":
            raise _unsupported(f"tools[{i}].type", f"only function tools are supported, got {kind!r}")
        out.append(_parse_item(ResponsesFunctionTool, raw, f"tools[{i}]"))
    return out


# ---------------------------------------------------------------------------------------------- input -> messages
def _parse_item(model: type[BaseModel], raw: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as e:
        err = from_validation_error(e)
    param = f"{where}.{err.param}" if err.param else where
    message = err.message
    head, sep, names = message.partition(": ")
    if head.endswith("parameter(s)"):  # missing / unknown ones: each named in full
        message = head + sep + ", ".join(f"{where}.{n}" for n in names.split(", "))
    elif err.param and message.startswith(err.param + ":"):
        message = param + message[len(err.param):]
    else:
        message = f"{where}: {message}"
    raise APIError(message, 400, param, err.code)


def _parts_text(parts: list[Any], where: str) -> str:
    texts = []
    for j, raw in enumerate(parts):
        kind = raw.get("type") if isinstance(raw, dict) else None
        if kind in _UNSUPPORTED_PART:
            raise _unsupported(f"{where}[{j}].type", f"{_UNSUPPORTED_PART[kind]} are not supported by this server "
                                                     "(text only)")
        if not isinstance(raw, dict):
            raise _invalid(f"{where}[{j}]", f"must be a content part object, got {raw!r}")
        part = _parse_item(ResponsesTextPart, raw, f"{where}[{j}]")
        if part.annotations:
            raise _unsupported(f"{where}[{j}].annotations", "only [] or null is accepted")
        texts.append(part.text)
    return "".join(texts)


def input_messages(inp: str | list[dict[str, Any]], instructions: str | None,
                   history: list[dict[str, Any]] | None = None) -> list[dict[str, Any]]:
    """`instructions`, then `history` (a stored conversation's items, see `input_items`), then `input`, as chat
    messages (dicts in ChatMessage's form). Errors name `input[i]`, counted in `input`."""
    messages: list[dict[str, Any]] = []
    if instructions is not None:
        messages.append({"role": "developer", "content": instructions})
    items = list(history or [])
    skip = len(items)
    if isinstance(inp, str):
        if not items:
            messages.append({"role": "user", "content": inp})
            return messages
        items.append({"role": "user", "content": inp})
    else:
        items += inp
    calls: set[str] = set()
    for i, raw in enumerate(items):
        where = f"input[{i - skip}]" if i >= skip else f"previous_response_id (item {i})"
        kind = raw.get("type") or "message"
        if kind not in _ITEM_MODELS:
            raise _unsupported(f"{where}.type", f"items of type {kind!r} are not supported (message, function_call, "
                                                "function_call_output and reasoning are)")
        item = _parse_item(_ITEM_MODELS[kind], raw, where)
        if kind == "message":
            content = item.content if isinstance(item.content, str) else _parts_text(item.content, f"{where}.content")
            messages.append({"role": item.role, "content": content})
        elif kind == "function_call":
            try:
                args = json.loads(item.arguments or "{}")
            except ValueError:
                args = None
            if not isinstance(args, dict):
                raise _invalid(f"{where}.arguments", "must be a JSON object as text")
            call = {"id": item.call_id, "type": "function",
                    "function": {"name": item.name, "arguments": item.arguments or "{}"}}
            calls.add(item.call_id)
            last = messages[-1] if messages else None
            if last is not None and last["role"] == "assistant":  # one assistant turn: its text and its calls
                last.setdefault("tool_calls", []).append(call)
            else:
                messages.append({"role": "assistant", "content": None, "tool_calls": [call]})
        elif kind == "function_call_output":
            if item.call_id not in calls:
                raise _invalid(f"{where}.call_id", f"no function_call item before it has call_id {item.call_id!r}")
            output = item.output if isinstance(item.output, str) else \
                _parts_text([p.model_dump(exclude_none=True) for p in item.output], f"{where}.output")
            messages.append({"role": "tool", "tool_call_id": item.call_id, "content": output})
        # reasoning: accepted, left out of the prompt
    if not messages:
        raise _invalid("input", "must hold at least one message or function call item (or send instructions)")
    return messages


_ID_PREFIXES = {"message": "msg", "function_call": "fc", "function_call_output": "fco", "reasoning": "rs"}


def input_items(inp: str | list[dict[str, Any]]) -> list[dict[str, Any]]:
    """`input` as the items a stored response keeps (for `previous_response_id` and GET .../input_items): each with
    its `id` (the one sent, else a new one), `type`, `status` ("completed" unless sent) and message text as content
    parts (`input_text`, or `output_text` for the assistant's). `inp` must have passed `input_messages`."""
    raws = [{"role": "user", "content": inp}] if isinstance(inp, str) else inp
    out = []
    for raw in raws:
        kind = raw.get("type") or "message"
        item = _ITEM_MODELS[kind].model_validate(raw).model_dump(by_alias=True, exclude_none=True)
        if kind == "message" and isinstance(item["content"], str):
            part = {"type": "input_text", "text": item["content"]}
            if item["role"] == "assistant":
                part = {"type": "output_text", "text": item["content"], "annotations": []}
            item["content"] = [part]
        item_id = item.pop("id", None) or new_item_id(_ID_PREFIXES[kind])
        out.append({"id": item_id, "type": kind, **item, "status": item.get("status") or "completed"})
    return out


def chat_request_body(req: ResponsesRequest, template: str | None,
                      history: list[dict[str, Any]] | None = None) -> dict[str, Any]:
    """The /v1/chat/completions body that runs `req` (`template`: the chat template, to see what it takes) after
    the stored conversation `history` (items, see `input_items`) of its previous response."""
    body: dict[str, Any] = {"messages": input_messages(req.input, req.instructions, history), "stream": req.stream}
    for name in ("model", "temperature", "top_p", "parallel_tool_calls", "user", "safety_identifier",
                 "prompt_cache_key", "prompt_cache_retention", "service_tier", "rid"):
        value = getattr(req, name)
        if value is not None:
            body[name] = value
    if req.max_output_tokens is not None:
        body["max_completion_tokens"] = req.max_output_tokens
    if req.tools is not None:
        body["tools"] = [{"type": "function", "function": t.model_dump(exclude={"type"}, exclude_none=True)}
                         for t in function_tools(req)]
    choice = req.tool_choice
    if choice == "auto" and not req.tools:  # the default (echoed in every response): no tools, nothing to choose
        choice = None
    if choice is not None:
        body["tool_choice"] = choice if isinstance(choice, str) else \
            {"type": "function", "function": {"name": choice.name}}
    if req.text is not None:
        if req.text.verbosity is not None:
            body["verbosity"] = req.text.verbosity
        fmt = req.text.format
        if fmt is not None:
            rf: dict[str, Any] = {"type": fmt.type}
            if fmt.type == "json_schema":
                if fmt.schema_ is None:
                    raise APIError("text.format.schema: required when type is 'json_schema'", 400,
                                   "text.format.schema", "missing_required_parameter")
                rf["json_schema"] = {k: v for k, v in (("name", fmt.name), ("schema", fmt.schema_),
                                                       ("strict", fmt.strict), ("description", fmt.description))
                                     if v is not None}
            else:
                extra = [k for k in ("name", "schema_", "strict", "description") if getattr(fmt, k) is not None]
                if extra:
                    name = extra[0].rstrip("_")
                    raise _invalid(f"text.format.{name}", f"only with type 'json_schema' (got type {fmt.type!r})")
            body["response_format"] = rf
    effort = req.reasoning.effort if req.reasoning is not None else None
    if effort is not None:
        if not template or "reasoning_effort" not in template:
            raise _unsupported("reasoning.effort", "this model's chat template takes no reasoning effort; send null")
        body["chat_template_kwargs"] = {"reasoning_effort": effort}
    return body


# chat-side parameter names -> the Responses field they came from
_PARAM_MAP: tuple[tuple[re.Pattern[str], str], ...] = (
    (re.compile(r"^messages(\[\d+\])?(\.[\w.\[\]]*)?"), "input"),
    (re.compile(r"^tools\[(\d+)\]\.function\b"), r"tools[\1]"),
    (re.compile(r"^tool_choice\.function\.name"), "tool_choice.name"),
    (re.compile(r"^response_format\.json_schema\b"), "text.format"),
    (re.compile(r"^response_format\b"), "text.format"),
    (re.compile(r"^max_(completion_)?tokens\b"), "max_output_tokens"),
    (re.compile(r"^verbosity\b"), "text.verbosity"),
    (re.compile(r"^chat_template_kwargs\b"), "reasoning.effort"),
)


def _map_param(param: str) -> str:
    for pattern, repl in _PARAM_MAP:
        new, n = pattern.subn(repl, param, count=1)
        if n:
            return new
    return param


def remap_error(err: APIError) -> APIError:
    """An error of the chat path, naming the Responses field instead of the chat one."""
    if err.param is None:
        return err
    param = _map_param(err.param)
    message = err.message
    if message.startswith(err.param):
        message = param + message[len(err.param):]
    message = re.sub(r"\bthe messages\b", "the input", message)
    message = re.sub(r"\bmax_(completion_)?tokens\b", "max_output_tokens", message)
    return APIError(message, err.status_code, param, err.code, err.type)


# ---------------------------------------------------------------------------------------------- output -> items
def reasoning_item(item_id: str, text: str, status: str, summary: bool = False) -> dict[str, Any]:
    """A reasoning item; with `summary`, its summary is the reasoning text itself (there is no summariser)."""
    return {"id": item_id, "type": "reasoning", "summary": [summary_part(text)] if summary else [],
            "content": [{"type": "reasoning_text", "text": text}], "status": status}


def summary_part(text: str) -> dict[str, Any]:
    return {"type": "summary_text", "text": text}


def message_item(item_id: str, text: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "message", "status": status, "role": "assistant",
            "content": [{"type": "output_text", "text": text, "annotations": []}]}


def call_item(item_id: str, call_id: str, name: str, arguments: str, status: str) -> dict[str, Any]:
    return {"id": item_id, "type": "function_call", "status": status, "call_id": call_id, "name": name,
            "arguments": arguments}


def output_items(message: dict[str, Any], cut: bool, summary: bool = False) -> list[dict[str, Any]]:
    """A chat answer (ChoiceOutput.message) as output items: its reasoning (`summary`: with its summary), its text
    (also when empty, unless it called tools) and its calls, in that order; the last one "incomplete" when the
    answer was cut off."""
    items = []
    if message.get("reasoning_content"):
        items.append(reasoning_item(new_item_id("rs"), message["reasoning_content"], "completed", summary))
    calls = message.get("tool_calls") or []
    if message.get("content") or not calls:
        items.append(message_item(new_item_id("msg"), message.get("content") or "", "completed"))
    for c in calls:
        items.append(call_item(new_item_id("fc"), c["id"], c["function"]["name"], c["function"]["arguments"],
                               "completed"))
    if cut:
        items[-1]["status"] = "incomplete"
    return items


def usage(input_tokens: int, output_tokens: int, cached_tokens: int, reasoning_tokens: int) -> dict[str, Any]:
    return {"input_tokens": input_tokens, "input_tokens_details": {"cached_tokens": cached_tokens},
            "output_tokens": output_tokens, "output_tokens_details": {"reasoning_tokens": reasoning_tokens},
            "total_tokens": input_tokens + output_tokens}


def response_object(req: ResponsesRequest, response_id: str, model: str, created_at: int, status: str,
                    output: list[dict[str, Any]], usage: dict[str, Any] | None, store: bool = False
                    ) -> dict[str, Any]:
    """The response object: its output and status, with the request's settings echoed as OpenAI does (`store`:
    whether this response is stored)."""
    fmt = req.text.format if req.text is not None else None
    reasoning = req.reasoning
    choice = req.tool_choice
    return {
        "id": response_id, "object": "response", "created_at": created_at, "status": status, "error": None,
        "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
        "instructions": req.instructions, "max_output_tokens": req.max_output_tokens, "model": model,
        "output": output, "parallel_tool_calls": req.parallel_tool_calls is not False,
        "previous_response_id": req.previous_response_id,
        "reasoning": {"effort": reasoning.effort if reasoning else None,
                      "summary": (reasoning.summary or reasoning.generate_summary) if reasoning else None},
        "store": store, "background": False, "temperature": req.temperature, "top_p": req.top_p,
        "text": {"format": fmt.model_dump(by_alias=True, exclude_none=True) if fmt else {"type": "text"},
                 "verbosity": (req.text.verbosity if req.text else None) or "medium"},
        "tool_choice": (choice if isinstance(choice, str) else choice.model_dump()) if choice is not None
        else "auto",
        "tools": [t.model_dump() for t in function_tools(req)], "truncation": "disabled", "usage": usage,
        "user": req.user, "metadata": req.metadata or {},
    }
