"""Tool calling and reasoning for one chat request: what `tools` / `tool_choice` / `parallel_tool_calls` ask for
(checked against the tools given), the constraint a forced call adds, the messages as the chat template gets them,
and the reader (`OutputConfig`) of the answer.

- `tool_choice` "none" (or no tools): the tools are not shown to the model and nothing is parsed.
- "auto" (the default with tools): the model's tool-call format is parsed out of the answer by the family's parser
  (`--tool-call-parser`, else the one whose markers the chat template shows, else hermes).
- "required" or a named function: the answer is constrained by a JSON-schema grammar (xgrammar) so that it always
  parses and its arguments validate: a named function's arguments, or an array of `{"name", "parameters"}` (one
  item when `parallel_tool_calls` is false).

Chat templates that do not render `tools` get them described in the system message (in the parser's format), and
past assistant `tool_calls` written into the content the same way, so any chat model can be offered tools."""

from __future__ import annotations

import json
from collections.abc import Collection
from dataclasses import dataclass
from typing import Any

from radixserve.entrypoints.openai.chat_output import ForcedCallScanner, OutputConfig, forced_call_schema
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.openai.reasoning_parsers import get_reasoning_parser
from radixserve.entrypoints.openai.tool_parsers import DEFAULT_TOOL_PARSER, detect_tool_parser, get_tool_parser
from radixserve.entrypoints.openai.tool_parsers.base import ToolParser

# keys of chat_template_kwargs that would override what the server passes itself
_RESERVED_TEMPLATE_KWARGS = frozenset({"conversation", "messages", "tools", "documents", "add_generation_prompt",
                                       "tokenize", "return_dict", "continue_final_message", "chat_template"})
# the parsers of GPT-OSS's harmony format (reasoning and tool calls)
HARMONY = "gpt-oss"
# JSON-schema types a function's arguments (a JSON object) cannot have
_NOT_OBJECT_TYPES = frozenset({"string", "number", "integer", "boolean", "array", "null"})


@dataclass
class ToolPlan:
    mode: str  # "none" | "auto" | "required" | "named"
    tools: list[dict[str, Any]]  # as plain dicts, for the template
    parser: ToolParser | None  # reads the answer (None: no parsing)
    format_parser: ToolParser  # writes the tool description / past calls for templates without tools
    schema: str | None = None  # the JSON schema of a forced call
    max_calls: int | None = None  # 1 when parallel_tool_calls is false


def model_tool_parser(name: str | None, chat_template: str | None) -> ToolParser:
    return get_tool_parser(name or detect_tool_parser(chat_template) or DEFAULT_TOOL_PARSER)


def check_parameters(tools: list[dict[str, Any]]) -> None:
    """A function's parameters describe its arguments, which are a JSON object: a schema of another type is a 400
    (as OpenAI answers), not calls whose arguments could never be one."""
    for i, t in enumerate(tools):
        kind = (t["function"].get("parameters") or {}).get("type", "object")
        if any(isinstance(k, str) and k in _NOT_OBJECT_TYPES for k in (kind if isinstance(kind, list) else [kind])):
            raise APIError(f"tools[{i}].function.parameters: the schema's type must be 'object' (the arguments are a "
                           f"JSON object), got {json.dumps(kind)}", 400, f"tools[{i}].function.parameters",
                           "invalid_value")


def plan_tools(req: Any, parser_name: str | None, chat_template: str | None, grammar_ok: bool) -> ToolPlan:
    tools = [t.model_dump(exclude_none=True, by_alias=True) for t in (req.tools or [])]
    choice = req.tool_choice
    if choice is None:
        choice = "auto" if tools else "none"
    names = [t["function"]["name"] for t in tools]
    check_parameters(tools)
    if len(set(names)) != len(names):
        dup = sorted({n for n in names if names.count(n) > 1})
        raise APIError(f"tools: function names must be unique, got {', '.join(dup)} more than once", 400, "tools",
                       "invalid_value")
    if not tools and choice != "none":
        raise APIError("tool_choice: needs tools (only 'none' is accepted without them)", 400, "tool_choice",
                       "invalid_value")
    fmt = model_tool_parser(parser_name, chat_template)
    if choice == "none":
        return ToolPlan("none", [], None, fmt)
    parallel = req.parallel_tool_calls is not False
    max_calls = None if parallel else 1
    if choice == "auto":
        strict = [t["function"]["name"] for t in tools if t["function"].get("strict")]
        if strict:
            raise APIError(f"tools: strict schemas ({', '.join(strict)}) are enforced only with tool_choice "
                           "'required' or a named function; with 'auto' send strict false or null", 400,
                           "tools", "unsupported_parameter")
        fmt.tool_names = frozenset(names)
        fmt.tool_params = {t["function"]["name"]: t["function"].get("parameters") or {} for t in tools}
        return ToolPlan("auto", tools, fmt, fmt, max_calls=max_calls)
    if not grammar_ok:
        raise APIError("tool_choice: 'required' and named functions need structured output, which is not available "
                       "on this server (no grammar backend)", 400, "tool_choice", "unsupported_parameter")
    what = "'required'" if isinstance(choice, str) else "naming a function"
    for field in ("response_format", "regex", "json_schema", "ebnf"):
        value = getattr(req, field, None)
        if value is not None and not (field == "response_format" and value.type == "text"):
            raise APIError(f"{field}: cannot be combined with tool_choice {what} (the call's arguments are "
                           "constrained already)", 400, field, "invalid_value")
    if isinstance(choice, str):  # "required"
        return ToolPlan("required", tools, ForcedCallScanner(None), fmt, forced_call_schema(tools, None, parallel),
                        max_calls)
    name = choice.function.name
    if name not in names:
        raise APIError(f"tool_choice.function.name: {name!r} is not one of the tools ({', '.join(names)})", 400,
                       "tool_choice.function.name", "invalid_value")
    return ToolPlan("named", tools, ForcedCallScanner(name), fmt, forced_call_schema(tools, name, parallel), 1)


def template_messages(req: Any, plan: ToolPlan, chat_template: str, flatten: Any) -> list[dict[str, Any]]:
    """The request's messages as the chat template gets them (`flatten(msg, i)` gives a message's text)."""
    renders_tools = "tools" in chat_template
    renders_calls = "tool_calls" in chat_template
    out: list[dict[str, Any]] = []
    for i, m in enumerate(req.messages):
        entry: dict[str, Any] = {"role": "system" if m.role == "developer" else m.role, "content": flatten(m, i)}
        if m.name is not None:
            entry["name"] = m.name
        if m.role == "tool":
            if not m.tool_call_id:
                raise APIError(f"messages[{i}].tool_call_id: required for role 'tool'", 400,
                               f"messages[{i}].tool_call_id", "missing_required_parameter")
            entry["tool_call_id"] = m.tool_call_id
        elif m.tool_call_id is not None:
            raise APIError(f"messages[{i}].tool_call_id: only messages of role 'tool' have one", 400,
                           f"messages[{i}].tool_call_id", "invalid_value")
        if m.tool_calls:
            if m.role != "assistant":
                raise APIError(f"messages[{i}].tool_calls: only assistant messages have tool calls", 400,
                               f"messages[{i}].tool_calls", "invalid_value")
            calls = []
            for j, c in enumerate(m.tool_calls):
                try:
                    args = json.loads(c.function.arguments or "{}")
                except ValueError:
                    args = None
                if not isinstance(args, dict):
                    raise APIError(f"messages[{i}].tool_calls[{j}].function.arguments: must be a JSON object text",
                                   400, f"messages[{i}].tool_calls[{j}].function.arguments", "invalid_value")
                calls.append({"id": c.id, "type": "function",
                              "function": {"name": c.function.name, "arguments": args}})
            if renders_calls:
                entry["tool_calls"] = calls
            else:
                written = plan.format_parser.render_calls(
                    [(c["function"]["name"], json.dumps(c["function"]["arguments"])) for c in calls])
                entry["content"] = (entry["content"] + "\n" if entry["content"] else "") + written
        if m.reasoning_content is not None and m.role == "assistant":
            entry["reasoning_content"] = m.reasoning_content
        out.append(entry)
    if plan.tools and not renders_tools:
        note = plan.format_parser.format_instructions(plan.tools)
        if out and out[0]["role"] == "system":
            out[0] = {**out[0], "content": out[0]["content"] + "\n\n" + note}
        else:
            out.insert(0, {"role": "system", "content": note})
    return out


def template_kwargs(req: Any, plan: ToolPlan, chat_template: str) -> dict[str, Any]:
    kwargs = dict(req.chat_template_kwargs or {})
    bad = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
    if bad:
        raise APIError(f"chat_template_kwargs: {', '.join(bad)} cannot be set here", 400, "chat_template_kwargs",
                       "invalid_value")
    if plan.tools and "tools" in chat_template:
        kwargs["tools"] = plan.tools
    return kwargs


def output_config(req: Any, plan: ToolPlan, reasoning_parser: str | None, prompt_text: str,
                  json_output: bool = False, special_tokens: Collection[str] = ()) -> OutputConfig:
    """`json_output`: a JSON-schema grammar shapes the answer from its first token (a forced call, a JSON
    response_format), so none of it is thinking, even where the prompt opened the thinking block.

    Harmony (GPT-OSS: the `gpt-oss` tool parser, named or detected from the chat template, or the `gpt-oss`
    reasoning parser): the output keeps its special tokens and is always read by the harmony parsers, so that no
    marker reaches the content: the tool parser even without tools (it then finds no call), and the reasoning
    parser even when `--reasoning-parser` is not given (as vLLM and SGLang separate GPT-OSS's reasoning);
    `separate_reasoning: false` leaves the analysis channel out (it cannot be shown inline without its markers).

    Other parsers whose markers may be special tokens (`needs_special_tokens`: DeepSeek's, Kimi's, ...) keep the
    special tokens while they read the output; `special_tokens` (the tokenizer's) other than their markers are
    then taken out of the text before it is read, as skipping them would."""
    chosen = get_reasoning_parser(reasoning_parser) if reasoning_parser is not None else None
    harmony = not json_output and HARMONY in (plan.format_parser.name, chosen.name if chosen is not None else None)
    if harmony and chosen is None:
        chosen = get_reasoning_parser(HARMONY)
    reasoning = chosen if req.separate_reasoning and not json_output else None
    tools = plan.parser
    if harmony and tools is None:
        tools = get_tool_parser(HARMONY)
        tools.tool_names = frozenset()  # no tools offered: a call is not one, its body is content
    hidden: tuple[str, ...] = ()
    readers = [p for p in (reasoning, tools) if p is not None and p.needs_special_tokens]
    keep = harmony or (not json_output and bool(readers))
    if keep and not harmony:
        markers = {m for p in (reasoning, tools) if p is not None for m in p.special_markers}
        hidden = tuple(t for t in special_tokens if t and t not in markers)
    return OutputConfig(reasoning=reasoning,
                        prompt_opens_reasoning=bool(reasoning and reasoning.prompt_opens_reasoning(prompt_text)),
                        tools=tools, max_calls=plan.max_calls, call_id=plan.format_parser.call_id,
                        keep_special_tokens=keep, hidden_tokens=hidden)
