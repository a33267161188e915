"""Qwen3-Coder: each call is an XML-like block,

    <tool_call>
    <function=NAME>
    <parameter=city>
    Paris
    </parameter>
    </function>
    </tool_call>

A value is the text between its tags (less the newline after the opening tag and before the closing one), converted
to the type the function's JSON schema gives its parameter (a string stays as written), else read as JSON when it is
JSON. A `</parameter>` the model left out is tolerated at the end (the next `<parameter=` or `</function>` ends the
value). Text outside the blocks is content."""

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

START, END = "<tool_call>", "</tool_call>"
FUNCTION, FUNCTION_END = "<function=", "</function>"
PARAM, PARAM_END = "<parameter=", "</parameter>"


class Qwen3CoderToolParser(ToolParser):
    name = "qwen3_coder"
    template_markers = (FUNCTION, PARAM)

    def scan(self, text: str, final: bool) -> ScanResult:
        return scan_blocks(text, final, START, self._read_block)

    def _read_block(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], int | None, bool]:
        j = skip_ws(text, i)
        opened = at_marker(text, j, FUNCTION)
        if not opened:
            return [], None, opened is None and not final
        gt = text.find(">", j)
        if gt < 0:
            return [], None, not final
        name = text[j + len(FUNCTION):gt].strip()
        if not name or (self.tool_names is not None and name not in self.tool_names):
            return [], None, False
        call = PartialCall(name=name)
        params: list[tuple[str, Any]] = []
        j = gt + 1
        while True:
            call.args = args_object(params, False)
            j = skip_ws(text, j)
            if j >= len(text):  # (at the end, a call without `</function>` is unfinished)
                return [call], None, not final
            if text.startswith(FUNCTION_END, j):
                call.args = args_object(params, True)
                k = skip_ws(text, j + len(FUNCTION_END))
                closed = at_marker(text, k, END)
                if closed:
                    call.done = True
                    return [call], k + len(END), True
                call.done = final and k >= len(text)  # only `</tool_call>` missing at the very end: tolerated
                return [call], None, closed is None and (not final or call.done)
            param_at = at_marker(text, j, PARAM)
            if not param_at:
                return [call], None, param_at is None and not final
            gt = text.find(">", j)
            if gt < 0:
                return [call], None, not final
            key = text[j + len(PARAM):gt].strip()
            end, after = self._value_end(text, gt + 1, final)
            if end is None:
                return [call], None, not final
            params.append((key, convert_value(trim_newline(text[gt + 1:end]), self.param_schema(name, key))))
            j = after

    @staticmethod
    def _value_end(text: str, i: int, final: bool) -> tuple[int | None, int]:
        """(where the value that starts at text[i] ends, where reading goes on)."""
        k = text.find(PARAM_END, i)
        if k >= 0:
            return k, k + len(PARAM_END)
        if not final:
            return None, i
        ends = [e for e in (text.find(PARAM, i), text.find(FUNCTION_END, i)) if e >= 0]
        return (min(ends), min(ends)) if ends else (None, i)

    def call_format_hint(self) -> str:
        return ("To call a function, write one block per call:\n<tool_call>\n<function=<function name>>\n"
                "<parameter=<parameter name>>\n<value>\n</parameter>\n...\n</function>\n</tool_call>")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f"{START}\n{FUNCTION}{n}>\n" + "".join(f"{PARAM}{k}>\n{value_text(v)}\n{PARAM_END}\n"
                                                                 for k, v in arg_pairs(a))
                         + f"{FUNCTION_END}\n{END}" for n, a in calls)
