"""Mistral: `[TOOL_CALLS]` then a JSON array `[{"name": ..., "arguments": {...}}, ...]` (v3 tokenizers) or, with the
v11 format, `[TOOL_CALLS]name[ARGS]{...}` per call. The marker is a control token, dropped when special tokens are
skipped; an answer that then begins with `[{` is read as the array form."""

from __future__ import annotations

import secrets
import string

from radixserve.entrypoints.openai.tool_parsers.base import (
    PartialCall,
    ScanResult,
    ToolParser,
    call_json,
    finish_scan,
    held_back,
    scan_call_list,
    skip_ws,
    value_end,
)

MARKER, ARGS = "[TOOL_CALLS]", "[ARGS]"
_ID_CHARS = string.ascii_letters + string.digits


class MistralToolParser(ToolParser):
    name = "mistral"
    template_markers = (MARKER,)

    def scan(self, text: str, final: bool) -> ScanResult:
        i = text.find(MARKER)
        if i < 0:
            j = skip_ws(text, 0)
            rest = text[j:]
            if rest.startswith("[{"):
                return self._array(text, j, "", final)
            if not final and rest and ("[{".startswith(rest) or MARKER.startswith(rest)):
                return ScanResult("", [])  # maybe a call, still arriving
            hold = 0 if final else held_back(text, MARKER)
            return ScanResult(text[: len(text) - hold], [])
        content = text[:i]
        j = skip_ws(text, i + len(MARKER))
        if j >= len(text):
            return ScanResult(text if final else content, [])
        if text[j] == "[":
            return self._array(text, j, content, final)
        return self._v11(text, i, content, final)

    def _array(self, text: str, j: int, content: str, final: bool) -> ScanResult:
        calls, end, ok = scan_call_list(text, j, ("arguments", "parameters"), array=True, names=self.tool_names)
        if not ok:
            return ScanResult(text, [])
        if final:
            if end is None or text[end:].strip():
                return ScanResult(text, [])
            return finish_scan(text, ScanResult(content.strip(), calls))
        return ScanResult(content, calls)

    def _v11(self, text: str, i: int, content: str, final: bool) -> ScanResult:
        calls: list[PartialCall] = []
        pos = i
        while pos < len(text) and text.startswith(MARKER, pos):
            a = text.find(ARGS, pos)
            if a < 0:
                break
            call = PartialCall(name=text[pos + len(MARKER):a].strip())
            if self.tool_names is not None and call.name not in self.tool_names:
                return ScanResult(text if final else content, calls)  # not a call of this request's
            calls.append(call)
            j = skip_ws(text, a + len(ARGS))
            end = value_end(text, j) if j < len(text) and text[j] == "{" else None
            call.args = text[j:end] if end is not None else text[j:]
            if end is None:
                break
            call.done = True
            pos = skip_ws(text, end)
        if final:
            if pos < len(text) and text[pos:].strip():
                return ScanResult(text, [])
            return finish_scan(text, ScanResult(content.strip(), calls))
        return ScanResult(content, calls)

    def call_id(self, name: str | None = None, index: int = 0) -> str:
        """Mistral's templates (and mistral-common) refuse a history whose call ids are not 9 letters or digits."""
        return "".join(secrets.choice(_ID_CHARS) for _ in range(9))

    def call_format_hint(self) -> str:
        return ('To call functions, answer with [TOOL_CALLS] followed by a JSON array: [{"name": "<function name>", '
                '"arguments": {<arguments>}}]')

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return MARKER + "[" + ", ".join(call_json(n, a) for n, a in calls) + "]"
