"""From a chat choice's generated text to OpenAI's message (and stream deltas): the thinking split off by the
reasoning parser, then tool calls taken out of the rest by the tool parser (or by the constrained scanner when
`tool_choice` forced a call).

The stream is built from the same scans as the final message: each step re-scans the whole text and sends what
grew (reasoning, content, a call's id and name once known, then its argument fragments)."""

from __future__ import annotations

import functools
import json
import re
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from radixserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser
from radixserve.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    ScanResult,
    ToolParser,
    finish_scan,
    scan_call_list,
    skip_ws,
)


def new_call_id(name: str | None = None, index: int = 0) -> str:
    return "call_" + uuid.uuid4().hex[:24]


class ForcedCallScanner(ToolParser):
    """Reads the output of a constrained request: with a named function the whole output is its arguments; with
    `required` it is a JSON array `[{"name": ..., "parameters": {...}}, ...]` (the grammar's shape). Output cut off
    by max_tokens (finish_reason "length") gives every call begun, the last one's arguments as far as they got, as
    OpenAI returns a cut call and as the stream has sent it; the grammar's own text is never content."""

    name = "forced"

    def __init__(self, function: str | None) -> None:
        self.function = function

    def scan(self, text: str, final: bool) -> ScanResult:
        if self.function is not None:
            call = PartialCall(name=self.function, args=text, done=final)
            if final and call.final_arguments() is None:  # cut off: the arguments so far
                call.done = False
                return ScanResult("", [call])
            res = ScanResult("", [call])
        else:
            calls, end, ok = scan_call_list(text, skip_ws(text, 0), ("parameters",), array=True)
            if not ok:  # not the grammar's shape (no grammar ran): plain content
                return ScanResult(text, []) if final else ScanResult("", calls)
            if final and end is None:  # cut off: the calls begun (a name read), the last one unfinished
                return ScanResult("", [c for c in calls if c.name is not None])
            res = ScanResult("", calls)
        return finish_scan(text, res) if final else res

    def parse(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """(content, [(name, arguments)]): complete calls' arguments as JSON object text, a cut one's as far as
        they got."""
        res = self.scan(text, final=True)
        calls = [(c.name, c.final_arguments() if c.done else c.args) for c in res.calls if c.name is not None]
        return res.content, [(n, a) for n, a in calls if a is not None]


@functools.lru_cache(maxsize=16)
def _hidden_pattern(tokens: tuple[str, ...]) -> re.Pattern[str]:
    """One pattern for all the hidden tokens (a tokenizer may have hundreds), longest first."""
    return re.compile("|".join(re.escape(t) for t in sorted(tokens, key=len, reverse=True)))


@dataclass
class OutputConfig:
    """How one chat request's output is read; shared by its choices."""

    reasoning: ReasoningParser | None = None
    prompt_opens_reasoning: bool = False
    tools: ToolParser | None = None  # None: no tool parsing (no tools, or tool_choice "none")
    max_calls: int | None = None  # parallel_tool_calls false: only the first call counts
    call_id: Callable[[str | None, int], str] = new_call_id  # the model family's id form (ToolParser.call_id)
    keep_special_tokens: bool = False  # the parsers read special-token markers: not skipped in the output
    # special tokens' texts taken out of the kept output before it is read (all but the parsers' own markers, as
    # skip_special_tokens would: the stop token, ...); each comes whole from the detokenizer, so streaming is safe
    hidden_tokens: tuple[str, ...] = ()


@dataclass
class ChoiceOutput:
    """One choice's reader: `message(text)` for a complete answer, `deltas(text, final)` while streaming."""

    cfg: OutputConfig
    sent_reasoning: int = 0
    sent_content: int = 0
    calls: list[list[Any]] = field(default_factory=list)  # per announced call: [id, arguments sent]

    def _split(self, text: str, final: bool) -> tuple[str, str]:
        if self.cfg.hidden_tokens:
            text = _hidden_pattern(self.cfg.hidden_tokens).sub("", text)
        if self.cfg.reasoning is None:
            return "", text
        return self.cfg.reasoning.split(text, final, self.cfg.prompt_opens_reasoning)

    def message(self, text: str) -> dict[str, Any]:
        reasoning, rest = self._split(text, True)
        msg: dict[str, Any] = {"role": "assistant", "content": rest, "refusal": None}
        if self.cfg.reasoning is not None:
            msg["reasoning_content"] = reasoning or None
        if self.cfg.tools is not None:
            content, calls = self.cfg.tools.parse(rest)
            calls = calls[: self.cfg.max_calls]
            if calls or isinstance(self.cfg.tools, ForcedCallScanner):  # (a forced call's text is never content)
                msg["content"] = content or None
                msg["tool_calls"] = [{"id": self.cfg.call_id(n, k), "type": "function",
                                      "function": {"name": n, "arguments": a}} for k, (n, a) in enumerate(calls)]
                self.calls = [[c["id"], len(c["function"]["arguments"])] for c in msg["tool_calls"]]
            else:  # the text itself when it holds no call, except where the format's markers are taken out
                msg["content"] = content
        return msg

    @property
    def has_tool_calls(self) -> bool:
        return bool(self.calls)

    def deltas(self, text: str, final: bool) -> list[dict[str, Any]]:
        """The deltas that bring the client from the last call's text to `text` (in order)."""
        out: list[dict[str, Any]] = []
        reasoning, rest = self._split(text, final)
        if len(reasoning) > self.sent_reasoning:
            out.append({"reasoning_content": reasoning[self.sent_reasoning:]})
            self.sent_reasoning = len(reasoning)
        if self.cfg.tools is None:
            res = ScanResult(rest, [])
        else:
            res = self.cfg.tools.scan(rest, final)
            if final and not res.calls and self.calls:
                res = self.cfg.tools.scan(rest, False)  # malformed at the end: what was sent stays, nothing added
        if len(res.content) > self.sent_content:
            out.append({"content": res.content[self.sent_content:]})
            self.sent_content = len(res.content)
        for k, call in enumerate(res.calls[: self.cfg.max_calls]):
            if call.name is None:
                break
            if k >= len(self.calls):
                self.calls.append([self.cfg.call_id(call.name, k), 0])
                out.append({"tool_calls": [{"index": k, "id": self.calls[k][0], "type": "function",
                                            "function": {"name": call.name, "arguments": ""}}]})
            args = call.args
            if call.args_is_string:
                args = (call.final_arguments() or "") if call.done else ""
            elif call.done and not args.strip():
                args += "{}"  # a call without arguments: `{}`, as the final message has it
            if len(args) > self.calls[k][1]:
                out.append({"tool_calls": [{"index": k, "function": {"arguments": args[self.calls[k][1]:]}}]})
                self.calls[k][1] = len(args)
        return out


def rebase_refs(schema: Any, base: str) -> Any:
    """`schema` with its document-local `$ref`s ("#", "#/$defs/...") pointing into it where it is placed, at the
    JSON pointer `base` of a larger schema (a function's parameters inside the `required` array)."""
    if isinstance(schema, dict):
        return {k: base + v[1:] if k == "$ref" and isinstance(v, str) and v.startswith("#") else rebase_refs(v, base)
                for k, v in schema.items()}
    if isinstance(schema, list):
        return [rebase_refs(v, base) for v in schema]
    return schema


def forced_call_schema(tools: list[dict[str, Any]], function: str | None, parallel: bool) -> str:
    """The JSON schema that a constrained tool choice generates: a named function's parameters, or (required) an
    array of one or more `{"name", "parameters"}` objects, each branch one tool's schema."""
    params = {t["function"]["name"]: t["function"].get("parameters") or {"type": "object", "properties": {}}
              for t in tools}
    if function is not None:
        return json.dumps(params[function])
    where = ["#/items/properties/parameters"] if len(params) == 1 else \
        [f"#/items/anyOf/{k}/properties/parameters" for k in range(len(params))]
    branches = [{"type": "object", "properties": {"name": {"type": "string", "enum": [name]},
                                                  "parameters": rebase_refs(schema, base)},
                 "required": ["name", "parameters"], "additionalProperties": False}
                for (name, schema), base in zip(params.items(), where, strict=True)]
    schema: dict[str, Any] = {"type": "array", "minItems": 1,
                              "items": branches[0] if len(branches) == 1 else {"anyOf": branches}}
    if not parallel:
        schema["maxItems"] = 1
    return json.dumps(schema)
