"""MiniMax-M2: calls are `invoke` elements in a `minimax:tool_call` block,

    <minimax:tool_call>
    <invoke name="get_weather">
    <parameter name="city">Paris</parameter>
    </invoke>
    </minimax:tool_call>

A value is the text between its tags (less a newline right inside them), converted to the type the function's JSON
schema gives its parameter (a string stays as written), else read as JSON when it is JSON. Text outside the blocks
is content. The block's tags may be special tokens: the output keeps them while this parser reads it."""

from __future__ import annotations

from typing import Any

from radixserve.entrypoints.openai.tool_parsers.base import PartialCall, ScanResult, ToolParser, skip_ws
from radixserve.entrypoints.openai.tool_parsers.markup import (
    arg_pairs,
    args_object,
    at_marker,
    convert_value,
    scan_blocks,
    trim_newline,
    value_text,
)

START, END = "<minimax:tool_call>", "</minimax:tool_call>"
INVOKE, INVOKE_END = "<invoke name=", "</invoke>"
PARAM, PARAM_END = "<parameter name=", "</parameter>"


def _attr(raw: str) -> str:
    """`"NAME"` (or 'NAME', or NAME) -> NAME."""
    raw = raw.strip()
    if len(raw) >= 2 and raw[0] == raw[-1] and raw[0] in "\"'":
        return raw[1:-1]
    return raw


class MiniMaxM2ToolParser(ToolParser):
    name = "minimax-m2"
    template_markers = (START,)
    needs_special_tokens = True
    special_markers = (START, END)

    def scan(self, text: str, final: bool) -> ScanResult:
        return scan_blocks(text, final, START, self._read_block)

    def _read_block(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], int | None, bool]:
        calls: list[PartialCall] = []
        j = i
        while True:
            j = skip_ws(text, j)
            if j >= len(text):  # (only the block's close tag missing at the very end is tolerated)
                return calls, None, bool(calls) or not final
            if text.startswith(END, j):
                return calls, j + len(END), bool(calls)
            invoke_at = at_marker(text, j, INVOKE)
            if not invoke_at:
                return calls, None, invoke_at is None and not final
            gt = text.find(">", j)
            if gt < 0:
                return calls, None, not final
            name = _attr(text[j + len(INVOKE):gt])
            if not name or (self.tool_names is not None and name not in self.tool_names):
                return calls, None, False
            call = PartialCall(name=name)
            calls.append(call)
            j, ok = self._read_params(call, text, gt + 1, final)
            if j is None:
                return calls, None, ok

    def _read_params(self, call: PartialCall, text: str, j: int, final: bool) -> tuple[int | None, bool]:
        """Read an invoke's parameters into `call`: (the index past `</invoke>`, True), or (None, ok) when the text
        ends first (ok) or is not parameters."""
        params: list[tuple[str, Any]] = []
        while True:
            call.args = args_object(params, False)
            j = skip_ws(text, j)
            if j >= len(text):  # (at the end, an invoke without `</invoke>` is unfinished)
                return None, not final
            if text.startswith(INVOKE_END, j):
                call.done, call.args = True, args_object(params, True)
                return j + len(INVOKE_END), True
            param_at = at_marker(text, j, PARAM)
            if not param_at:
                return None, param_at is None and not final
            gt = text.find(">", j)
            end = text.find(PARAM_END, gt) if gt >= 0 else -1
            if end < 0:
                return None, not final
            key = _attr(text[j + len(PARAM):gt])
            raw = trim_newline(text[gt + 1:end])
            params.append((key, convert_value(raw, self.param_schema(call.name or "", key))))
            j = end + len(PARAM_END)

    def call_format_hint(self) -> str:
        return ('To call functions, write one block:\n<minimax:tool_call>\n<invoke name="<function name>">\n'
                '<parameter name="<parameter name>"><value></parameter>\n...\n</invoke>\n...\n</minimax:tool_call>')

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        invokes = "".join(f'{INVOKE}"{n}">\n' + "".join(f'{PARAM}"{k}">{value_text(v)}{PARAM_END}\n'
                                                        for k, v in arg_pairs(a)) + f"{INVOKE_END}\n"
                          for n, a in calls)
        return f"{START}\n{invokes}{END}"
