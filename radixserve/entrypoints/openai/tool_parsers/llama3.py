"""Llama 3.1 / 3.2 / 3.3 JSON tool calls: the answer is `{"name": ..., "parameters": {...}}` (several separated by
`;`), optionally after `<|python_tag|>` (kept when special tokens are not skipped). An answer that does not begin
with a call is content."""

from __future__ import annotations

from radixserve.entrypoints.openai.tool_parsers.base import (
    ScanResult,
    ToolParser,
    call_json,
    finish_scan,
    scan_call_list,
    skip_ws,
)

PYTHON_TAG = "<|python_tag|>"


class Llama3JsonToolParser(ToolParser):
    name = "llama3"
    template_markers = (PYTHON_TAG, "ipython")

    def scan(self, text: str, final: bool) -> ScanResult:
        i = skip_ws(text, 0)
        if text.startswith(PYTHON_TAG, i):
            i = skip_ws(text, i + len(PYTHON_TAG))
        elif not final and PYTHON_TAG.startswith(text[i:]):
            return ScanResult("", [])  # maybe the tag, still arriving
        if i >= len(text):
            return ScanResult("" if not final else text, [])
        if text[i] != "{":
            return ScanResult(text, [])
        calls, end, ok = scan_call_list(text, i, ("parameters", "arguments"), array=False, separators=";",
                                       names=self.tool_names)
        if not ok or not calls:
            return ScanResult(text if (final or not ok) else "", [])
        if final:
            if end is None or text[end:].strip():
                return ScanResult(text, [])
            return finish_scan(text, ScanResult("", calls))
        return ScanResult("", calls)

    def call_format_hint(self) -> str:
        return ('To call a function, answer only with JSON: {"name": "<function name>", "parameters": {<arguments>}} '
                "(several calls separated by ';').")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "; ".join(call_json(n, a, "parameters") for n, a in calls)
