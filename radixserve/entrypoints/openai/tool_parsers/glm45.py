"""GLM-4.5 / GLM-4.6: each call is a block of tags, the arguments as key/value pairs,

    <tool_call>NAME
    <arg_key>city</arg_key>
    <arg_value>Paris</arg_value>
    </tool_call>

(GLM-4.7 writes the same without the newlines.) A value is text: it is converted to the type the function's JSON
schema gives its parameter (a string stays as written), else read as JSON when it is JSON. Text outside the blocks
is content. The tags may be special tokens in GLM's tokenizers: the output keeps them while this parser reads
it."""

from __future__ import annotations

from typing import Any

from radixserve.entrypoints.openai.tool_parsers.base import PartialCall, ScanResult, ToolParser, skip_ws
from radixserve.entrypoints.openai.tool_parsers.markup import (
    arg_pairs,
    args_object,
    at_marker,
    convert_value,
    scan_blocks,
    value_text,
)

START, END = "<tool_call>", "</tool_call>"
KEY, KEY_END, VALUE, VALUE_END = "<arg_key>", "</arg_key>", "<arg_value>", "</arg_value>"


class Glm45ToolParser(ToolParser):
    name = "glm45"
    template_markers = (KEY,)
    needs_special_tokens = True
    special_markers = (START, END, KEY, KEY_END, VALUE, VALUE_END)

    def scan(self, text: str, final: bool) -> ScanResult:
        return scan_blocks(text, final, START, self._read_block)

    def _read_block(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], int | None, bool]:
        ends = [k for k in (text.find("\n", skip_ws(text, i)), text.find(KEY, i), text.find(END, i)) if k >= 0]
        if not ends:
            return [], None, not final
        name = text[i:min(ends)].strip()
        if not name or (self.tool_names is not None and name not in self.tool_names):
            return [], None, False
        call = PartialCall(name=name)
        params: list[tuple[str, Any]] = []
        j = min(ends)
        while True:
            call.args = args_object(params, False)
            j = skip_ws(text, j)
            if j >= len(text):  # (at the end, a call without its close tag is unfinished)
                return [call], None, not final
            if text.startswith(END, j):
                call.done, call.args = True, args_object(params, True)
                return [call], j + len(END), True
            key_at = at_marker(text, j, KEY)
            if not key_at:
                return [call], None, key_at is None and not final
            key_end = text.find(KEY_END, j)
            if key_end < 0:
                return [call], None, not final
            key = text[j + len(KEY):key_end].strip()
            v = skip_ws(text, key_end + len(KEY_END))
            value_at = at_marker(text, v, VALUE)
            if not value_at:
                return [call], None, value_at is None and not final
            value_end = text.find(VALUE_END, v)
            if value_end < 0:
                return [call], None, not final
            params.append((key, convert_value(text[v + len(VALUE):value_end], self.param_schema(name, key))))
            j = value_end + len(VALUE_END)

    def call_format_hint(self) -> str:
        return ("To call a function, write one block per call:\n<tool_call><function name>\n<arg_key><parameter "
                "name></arg_key>\n<arg_value><value></arg_value>\n...\n</tool_call>")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f"{START}{n}\n" + "".join(f"{KEY}{k}{KEY_END}\n{VALUE}{value_text(v)}{VALUE_END}\n"
                                                   for k, v in arg_pairs(a)) + END for n, a in calls)

