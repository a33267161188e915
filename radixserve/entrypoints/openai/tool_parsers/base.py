"""What every tool-call parser shares: a scan of the model's text into content and (possibly partial) calls, and
the small JSON scanner the scans are built on.

A parser's `scan(text, final)` looks at the whole text generated so far and returns the content the user may see
(never a half-written start marker) and the calls found, each with its name once known and the raw text of its
arguments so far. Streaming diffs one scan against the previous one (content and arguments only grow), so the
streamed deltas and the final message come from the same code. With `final=True` only complete calls whose
arguments are a JSON object count; anything else stays content. Per request, the parser also knows the functions
offered (`tool_names`: a call to another one is malformed) and their parameter schemas (`tool_params`: formats that
write argument values as text convert them to the schema's types).
"""

from __future__ import annotations

import json
import uuid
from dataclasses import dataclass, field
from typing import Any

_WS = " \t\r\n"


@dataclass
class PartialCall:
    name: str | None = None
    args: str = ""  # raw JSON text of the arguments so far (exact once `done`)
    done: bool = False  # the call's JSON is complete
    args_is_string: bool = False  # the model wrote the arguments as a JSON string holding JSON

    def final_arguments(self) -> str | None:
        """The arguments as a JSON object text, or None when they are not one."""
        text = self.args.strip() or "{}"
        try:
            value = json.loads(text)
            if self.args_is_string and isinstance(value, str):
                text, value = value, json.loads(value)
        except (ValueError, TypeError):
            return None
        return text if isinstance(value, dict) else None


@dataclass
class ScanResult:
    content: str = ""
    calls: list[PartialCall] = field(default_factory=list)


def skip_ws(text: str, i: int) -> int:
    while i < len(text) and text[i] in _WS:
        i += 1
    return i


def value_end(text: str, i: int) -> int | None:
    """Index just past the JSON value that starts at text[i], or None when the text ends first."""
    if i >= len(text):
        return None
    c = text[i]
    if c == '"':
        j = i + 1
        while j < len(text):
            if text[j] == "\\":
                j += 2
                continue
            if text[j] == '"':
                return j + 1
            j += 1
        return None
    if c in "{[":
        depth, j, in_str = 0, i, False
        while j < len(text):
            ch = text[j]
            if in_str:
                if ch == "\\":
                    j += 1
                elif ch == '"':
                    in_str = False
            elif ch == '"':
                in_str = True
            elif ch in "{[":
                depth += 1
            elif ch in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(text) and text[j] not in ",}] \t\r\n;":
        j += 1
    return j if j < len(text) else None  # a number or literal is complete only once something follows it


def scan_call_object(text: str, i: int, args_keys: tuple[str, ...], names: frozenset[str] | None = None
                     ) -> tuple[PartialCall | None, int | None]:
    """Scan `{"name": ..., "<args key>": {...}}` starting at text[i] == '{'. Returns (the call so far, the index
    just past the object when complete); (None, None) when the text is not such an object, or (with `names`) calls
    another function."""
    if i >= len(text) or text[i] != "{":
        return None, None
    call = PartialCall()
    j = skip_ws(text, i + 1)
    seen_key = False
    while True:
        if j >= len(text):
            return call, None
        if text[j] == "}" and not seen_key:
            return None, None  # an empty object is not a call
        if text[j] != '"':
            return None, None
        key_end = value_end(text, j)
        if key_end is None:
            return call, None
        try:
            key = json.loads(text[j:key_end])
        except ValueError:
            return None, None
        j = skip_ws(text, key_end)
        if j >= len(text):
            return call, None
        if text[j] != ":":
            return None, None
        j = skip_ws(text, j + 1)
        if j >= len(text):
            return call, None
        end = value_end(text, j)
        if key == "name":
            if text[j] != '"':
                return None, None
            if end is None:
                return call, None
            try:
                call.name = json.loads(text[j:end])
            except ValueError:
                return None, None
            if names is not None and call.name not in names:
                return None, None
        elif key in args_keys:
            call.args_is_string = text[j] == '"'
            if not call.args_is_string:
                if text[j] not in "{[":
                    return None, None
                call.args = text[j:end] if end is not None else text[j:]
            if end is None:
                return call, None
            if call.args_is_string:
                call.args = text[j:end]
        elif end is None:
            return call, None
        seen_key = True
        j = skip_ws(text, end)
        if j >= len(text):
            return call, None
        if text[j] == "}":
            if call.name is None:
                return None, None
            call.done = True
            return call, j + 1
        if text[j] != ",":
            return None, None
        j = skip_ws(text, j + 1)


def held_back(text: str, marker: str) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of `marker` (kept back while streaming)."""
    for n in range(min(len(marker) - 1, len(text)), 0, -1):
        if text.endswith(marker[:n]):
            return n
    return 0


def scan_call_list(text: str, i: int, args_keys: tuple[str, ...], *, array: bool, separators: str = ",",
                   names: frozenset[str] | None = None) -> tuple[list[PartialCall], int | None, bool]:
    """Scan call objects from text[i]: a JSON array `[{...}, ...]` (array=True) or objects separated by one of
    `separators`. Returns (calls, index past the last complete part, ok): ok is False when the text is not calls."""
    calls: list[PartialCall] = []
    j = i
    if array:
        if j >= len(text) or text[j] != "[":
            return [], None, False
        j = skip_ws(text, j + 1)
    while True:
        if j >= len(text):
            return calls, None, True
        call, end = scan_call_object(text, j, args_keys, names)
        if call is None:
            return calls, None, False
        calls.append(call)
        if end is None:
            return calls, None, True
        j = skip_ws(text, end)
        if j >= len(text):
            return calls, (None if array else end), True
        if array and text[j] == "]":
            return calls, j + 1, True
        if text[j] in separators:
            j = skip_ws(text, j + 1)
            continue
        return calls, (None if array else end), not array


class ToolParser:
    """One model family's tool-call format. Subclasses set `name` and implement `scan`."""

    name = "base"
    # a marker that, when the chat template contains it, identifies this family
    template_markers: tuple[str, ...] = ()
    # the functions a request offers (set per request): a call to another one is not a call, as if malformed
    tool_names: frozenset[str] | None = None
    # the functions' parameter schemas (name -> JSON schema, set per request): formats that write argument values
    # as text (XML-like tags) convert them to the types the schema gives
    tool_params: dict[str, dict[str, Any]] | None = None
    # reads markers that are special tokens: the output keeps them (serving_chat), and the content never shows them
    needs_special_tokens = False
    # the marker texts this format reads (kept in the output when special tokens are; other special tokens are not)
    special_markers: tuple[str, ...] = ()

    def scan(self, text: str, final: bool) -> ScanResult:
        raise NotImplementedError

    def matches_template(self, chat_template: str) -> bool:
        """True when the chat template shows this family's format."""
        return any(m in chat_template for m in self.template_markers)

    def param_schema(self, function: str, param: str) -> dict[str, Any] | None:
        """The JSON schema of one parameter of one of the request's functions, when known."""
        props = ((self.tool_params or {}).get(function) or {}).get("properties")
        schema = props.get(param) if isinstance(props, dict) else None
        return schema if isinstance(schema, dict) else None

    def call_id(self, name: str | None = None, index: int = 0) -> str:
        """A new tool call id (for the `index`-th call of an answer, to `name`), in the form this family's chat
        templates accept when the call comes back."""
        return "call_" + uuid.uuid4().hex[:24]

    def parse(self, text: str) -> tuple[str, list[tuple[str, str]]]:
        """The complete output -> (content, [(name, arguments JSON text)]). Malformed calls stay in the content;
        next to calls the content is stripped (here, not in `scan`: the stream cannot take back what it sent)."""
        res = self.scan(text, final=True)
        calls = [(c.name, c.final_arguments()) for c in res.calls]
        calls = [(n, a) for n, a in calls if n is not None and a is not None]
        return (res.content.strip() if calls else res.content), calls

    def format_instructions(self, tools: list[dict[str, Any]]) -> str:
        """A system-prompt paragraph describing the tools and this format, for chat templates that do not render
        `tools` themselves."""
        specs = "\n".join(json.dumps(t.get("function", t), ensure_ascii=False) for t in tools)
        return ("You can call these functions (JSON schemas):\n" + specs + "\n" + self.call_format_hint())

    def call_format_hint(self) -> str:
        return ""

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        """Past calls [(name, arguments JSON)] written the way this family writes them, for chat templates that do
        not render an assistant message's `tool_calls` themselves."""
        raise NotImplementedError


def finish_scan(text: str, res: ScanResult) -> ScanResult:
    """The final-mode rule every parser applies: if any call is malformed (incomplete, no name, or arguments that
    are not a JSON object), the whole text is content and there are no calls."""
    if any(not c.done or c.name is None or c.final_arguments() is None for c in res.calls):
        return ScanResult(text, [])
    return res


def call_json(name: str, arguments: str, args_key: str = "arguments") -> str:
    """`{"name": ..., "<args_key>": {...}}` with the arguments text kept as given."""
    return '{"name": ' + json.dumps(name, ensure_ascii=False) + f', "{args_key}": ' + (arguments or "{}") + "}"
