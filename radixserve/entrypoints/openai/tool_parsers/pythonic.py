"""Pythonic tool calls (Llama 3.2 small models, Llama 4): the answer is a Python list of calls with keyword
arguments, `[get_weather(city="Paris", days=[1, 2]), get_time()]`; Llama 4 may wrap it in `<|python_start|>` /
`<|python_end|>`, with content before the wrapped list (and after it).

The calls are read with Python's `ast`, never evaluated: argument values must be literals (strings, numbers,
True/False/None (or true/false/null), lists, tuples, dicts); anything else makes the answer content. An unwrapped
list counts only at the very start of the answer and only when nothing but whitespace follows it. While
streaming, a call is announced once its name and `(` are read, and its arguments are sent once its `)` is."""

from __future__ import annotations

import ast
import json
import re
from typing import Any

from radixserve.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    ScanResult,
    ToolParser,
    finish_scan,
    held_back,
    skip_ws,
)

START, END = "<|python_start|>", "<|python_end|>"
_NAME = re.compile(r"[A-Za-z_][\w.]*")
_OPEN, _CLOSE = "([{", ")]}"
_JSON_NAMES = {"true": True, "false": False, "null": None, "True": True, "False": False, "None": None}


def _call_end(text: str, i: int) -> int | None:
    """Index just past the `)` matching the `(` at text[i]; None when the text ends first, -1 when unbalanced."""
    stack: list[str] = []
    quote = ""
    j = i
    while j < len(text):
        ch = text[j]
        if quote:
            if ch == "\\":
                j += 1
            elif ch == quote:
                quote = ""
        elif ch in "\"'":
            quote = ch
        elif ch in _OPEN:
            stack.append(_CLOSE[_OPEN.index(ch)])
        elif ch in _CLOSE:
            if not stack or stack.pop() != ch:
                return -1
            if not stack:
                return j + 1
        j += 1
    return None


def _literal(node: ast.AST) -> Any:
    """A literal's value (ValueError for anything else)."""
    if isinstance(node, ast.Constant) and (node.value is None or isinstance(node.value, str | int | float | bool)):
        return node.value
    if isinstance(node, ast.Name) and node.id in _JSON_NAMES:
        return _JSON_NAMES[node.id]
    if isinstance(node, ast.UnaryOp) and isinstance(node.op, ast.USub | ast.UAdd):
        value = _literal(node.operand)
        if isinstance(value, int | float) and not isinstance(value, bool):
            return -value if isinstance(node.op, ast.USub) else value
    if isinstance(node, ast.List | ast.Tuple):
        return [_literal(e) for e in node.elts]
    if isinstance(node, ast.Dict) and all(k is not None for k in node.keys):
        keys = [_literal(k) for k in node.keys if k is not None]
        if all(isinstance(k, str | int | float | bool) or k is None for k in keys):
            return {json.dumps(k) if not isinstance(k, str) else k: _literal(v)
                    for k, v in zip(keys, node.values, strict=True)}
    raise ValueError("not a literal")


def call_arguments(source: str) -> dict[str, Any] | None:
    """`name(k=v, ...)` -> {k: v}, or None when it is not a call with literal keyword arguments only."""
    try:
        node = ast.parse(source.strip(), mode="eval").body
        if not isinstance(node, ast.Call) or node.args or any(kw.arg is None for kw in node.keywords):
            return None
        return {kw.arg: _literal(kw.value) for kw in node.keywords if kw.arg is not None}
    except (SyntaxError, ValueError, RecursionError, MemoryError):
        return None


class PythonicToolParser(ToolParser):
    name = "pythonic"
    # Llama 4's marker; the call format Meta's prompt (and vLLM's pythonic templates) spell out
    template_markers = (START, "[func_name1(")
    needs_special_tokens = True
    special_markers = (START, END)

    def scan(self, text: str, final: bool) -> ScanResult:
        s = text.find(START)
        if s >= 0:
            content, j, wrapped = text[:s], s + len(START), True
        else:
            j = skip_ws(text, 0)
            if j >= len(text) or text[j] != "[":
                if not final and j >= len(text):
                    return ScanResult("", [])  # only whitespace so far: a list may follow
                return ScanResult(text if final else text[: len(text) - held_back(text, START)], [])
            content, wrapped = "", False
        calls, end, state = self._read_list(text, j, final, wrapped)
        if state == "bad" or (final and state == "open"):
            if final:
                return ScanResult(text, [])
            if not calls and not wrapped:  # not a call list after all: plain content
                return ScanResult(text[: len(text) - held_back(text, START)], [])
            return ScanResult(content, calls)
        if state == "open" or end is None:
            return ScanResult(content, calls)
        k = skip_ws(text, end)
        if wrapped:
            if text.startswith(END, k):
                k += len(END)
            elif not final and END.startswith(text[k:]):
                return ScanResult(content, calls)  # the end marker may be arriving
            else:
                k = end
            tail = text[k:]
            content += tail if final else tail[: len(tail) - held_back(tail, START)]
        elif k < len(text):  # something after an unwrapped list: not a call list
            return ScanResult(text, []) if final else ScanResult(content, calls)
        res = ScanResult(content, calls)
        return finish_scan(text, res) if final else res

    def _read_list(self, text: str, j: int, final: bool, wrapped: bool
                   ) -> tuple[list[PartialCall], int | None, str]:
        """(calls so far, index past the list, state "ok" | "open" | "bad"); wrapped, the brackets are optional."""
        calls: list[PartialCall] = []
        j = skip_ws(text, j)
        if j >= len(text):
            return calls, None, "open"
        bracket = text[j] == "["
        if not bracket and not wrapped:
            return calls, None, "bad"
        j += 1 if bracket else 0
        while True:
            j = skip_ws(text, j)
            if j >= len(text):
                return calls, None, "open"
            if bracket and calls and text[j] == "]":  # after a trailing comma
                return calls, j + 1, "ok"
            m = _NAME.match(text, j)
            if m is None:
                return calls, None, "bad"
            k = m.end()
            if k >= len(text):
                return calls, None, "open"
            if text[k] != "(" or (self.tool_names is not None and m.group() not in self.tool_names):
                return calls, None, "bad"
            call = PartialCall(name=m.group())
            calls.append(call)
            close = _call_end(text, k)
            if close is None:
                return calls, None, "open"
            args = call_arguments(text[j:close]) if close > 0 else None
            if args is None:
                return calls, None, "bad"
            call.args, call.done = json.dumps(args, ensure_ascii=False), True
            j = skip_ws(text, close)
            if j >= len(text):
                return (calls, close, "ok") if final and not bracket else (calls, None, "open")
            if text[j] == ",":
                j += 1
            elif bracket and text[j] == "]":
                return calls, j + 1, "ok"
            elif not bracket:
                return calls, close, "ok"
            else:
                return calls, None, "bad"

    def call_format_hint(self) -> str:
        return ("To call functions, answer only with a Python list of calls with keyword arguments: "
                "[func_name1(param1=value1, param2=value2), func_name2(param=value)]")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        parts = []
        for n, a in calls:
            args = json.loads(a or "{}")
            parts.append(f"{n}(" + ", ".join(f"{k}={v!r}" for k, v in args.items()) + ")")
        return "[" + ", ".join(parts) + "]"
