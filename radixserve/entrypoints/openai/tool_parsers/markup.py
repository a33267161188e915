"""Pieces shared by the parsers of marker-delimited formats (DeepSeek, Kimi, GLM, Qwen3-Coder, MiniMax): a driver
that finds the call blocks in the text (content around them), and the conversion of argument values written as
text (XML-like tags) to the types of the function's JSON schema.

A format supplies `read_block(text, i, final) -> (calls, end, ok)`: the calls of the block whose start marker ends
at `i`, the index just past the block when it is complete (None while it is open), and ok=False when the text
there is not calls of this request's (malformed, or a function not offered)."""

from __future__ import annotations

import ast
import json
from collections.abc import Callable
from typing import Any

from radixserve.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    ScanResult,
    finish_scan,
    held_back,
    skip_ws,
    value_end,
)

BlockReader = Callable[[str, int, bool], tuple[list[PartialCall], int | None, bool]]


def scan_blocks(text: str, final: bool, begin: str, read_block: BlockReader) -> ScanResult:
    """Content and calls of a text where call blocks start with `begin` and may have content around them. While
    streaming, a block that turns out not to be calls stops the stream (its text becomes content at the end); with
    `final`, any malformed block makes the whole text content."""
    content: list[str] = []
    calls: list[PartialCall] = []
    pos = 0
    while True:
        i = text.find(begin, pos)
        if i < 0:
            tail = text[pos:]
            content.append(tail if final else tail[: len(tail) - held_back(tail, begin)])
            break
        content.append(text[pos:i])
        got, end, ok = read_block(text, i + len(begin), final)
        if not ok:
            return ScanResult(text, []) if final else ScanResult("".join(content), calls)
        calls.extend(got)
        if end is None:
            break
        pos = end
        while pos < len(text) and text[pos] == "\n":  # the newline between blocks is not content
            pos += 1
    res = ScanResult("".join(content), calls)
    return finish_scan(text, res) if final else res


def at_marker(text: str, j: int, marker: str) -> bool | None:
    """True when `marker` starts at text[j], None when the text ends inside it (or right at j), else False."""
    if text.startswith(marker, j):
        return True
    return None if marker.startswith(text[j:]) else False


def json_args(call: PartialCall, text: str, j: int) -> int | None:
    """Read the JSON object that starts at text[j] (after whitespace) into `call.args`; the index past it, or None
    while it is incomplete. Raises ValueError when something other than an object starts there."""
    j = skip_ws(text, j)
    if j >= len(text):
        return None
    if text[j] != "{":
        raise ValueError("arguments are not a JSON object")
    end = value_end(text, j)
    call.args = text[j:end] if end is not None else text[j:]
    return end


def args_object(params: list[tuple[str, Any]], done: bool) -> str:
    """The arguments JSON text of the parameters read so far: an object that only grows (closed once `done`)."""
    body = ", ".join(json.dumps(k, ensure_ascii=False) + ": " + json.dumps(v, ensure_ascii=False) for k, v in params)
    return "{" + body + ("}" if done else "")


def _schema_types(schema: dict[str, Any]) -> list[str]:
    kind = schema.get("type")
    if isinstance(kind, str):
        return [kind]
    if isinstance(kind, list):
        return [k for k in kind if isinstance(k, str)]
    for key in ("anyOf", "oneOf"):
        if isinstance(schema.get(key), list):
            return [t for branch in schema[key] if isinstance(branch, dict) for t in _schema_types(branch)]
    if isinstance(schema.get("enum"), list) and schema["enum"]:
        names = {bool: "boolean", int: "integer", float: "number", str: "string", type(None): "null"}
        return list(dict.fromkeys(names.get(type(v), "string") for v in schema["enum"]))
    if "properties" in schema:
        return ["object"]
    return []


def _literal(raw: str) -> Any:
    """JSON, else a Python literal (models write `{'a': 1}` too); ValueError when neither."""
    try:
        return json.loads(raw)
    except ValueError:
        pass
    try:
        return ast.literal_eval(raw)
    except (ValueError, SyntaxError, TypeError, MemoryError, RecursionError):
        raise ValueError("not a literal") from None


_MISSING = object()


def _as_type(raw: str, kind: str) -> Any:
    s = raw.strip()
    if kind == "integer":
        try:
            return int(s)
        except ValueError:
            f = float(s)  # "3.0" (ValueError propagates otherwise)
            if f.is_integer():
                return int(f)
            return _MISSING
    if kind == "number":
        value = json.loads(s)
        return value if isinstance(value, int | float) and not isinstance(value, bool) else _MISSING
    if kind == "boolean":
        return {"true": True, "false": False}.get(s.lower(), _MISSING)
    if kind == "null":
        return None if s.lower() in ("null", "none") else _MISSING
    if kind in ("object", "array"):
        value = _literal(s)
        return value if isinstance(value, dict if kind == "object" else list) else _MISSING
    return _MISSING


def convert_value(raw: str, schema: dict[str, Any] | None) -> Any:
    """A parameter value written as text, as the type its schema gives (the first type it fits); without a usable
    schema, JSON when it reads as JSON, else the text."""
    kinds = _schema_types(schema) if schema else []
    for kind in kinds:
        if kind == "string":
            continue
        try:
            value = _as_type(raw, kind)
        except (ValueError, OverflowError):
            continue
        if value is not _MISSING:
            return value
    if "string" in kinds:
        return raw
    try:
        return json.loads(raw.strip())
    except ValueError:
        return raw


def trim_newline(raw: str) -> str:
    """A tag's value without the one newline after the opening tag and the one before the closing tag."""
    if raw.startswith("\n"):
        raw = raw[1:]
    return raw[:-1] if raw.endswith("\n") else raw


def arg_pairs(arguments: str) -> list[tuple[str, Any]]:
    """A past call's arguments (JSON object text) as (name, value) pairs, for formats that write them as tags."""
    value = json.loads(arguments or "{}")
    return list(value.items()) if isinstance(value, dict) else []


def value_text(value: Any) -> str:
    """A value as the tag formats write it: a string as it is, anything else as JSON."""
    return value if isinstance(value, str) else json.dumps(value, ensure_ascii=False)
