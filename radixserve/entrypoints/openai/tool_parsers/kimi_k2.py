"""Kimi-K2: calls in a section of special tokens, each named by an id `functions.NAME:INDEX`,

    <|tool_calls_section_begin|><|tool_call_begin|>functions.NAME:0<|tool_call_argument_begin|>{arguments}
    <|tool_call_end|>...<|tool_calls_section_end|>

Text before the section is content. The call ids this parser hands out have the same `functions.NAME:INDEX` form:
Kimi's chat template writes a past call's id back into the prompt as is."""

from __future__ import annotations

from radixserve.entrypoints.openai.tool_parsers.base import PartialCall, ScanResult, ToolParser, skip_ws
from radixserve.entrypoints.openai.tool_parsers.markup import at_marker, json_args, scan_blocks

SECTION_BEGIN, SECTION_END = "<|tool_calls_section_begin|>", "<|tool_calls_section_end|>"
CALL_BEGIN, ARGS, CALL_END = "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>"


def function_of(call_id: str) -> str:
    """`functions.NAME:0` -> NAME (a bare NAME stays as it is)."""
    name = call_id.strip()
    if name.startswith("functions."):
        name = name[len("functions."):]
    head, colon, index = name.rpartition(":")
    return head if colon and index.isdigit() else name


class KimiK2ToolParser(ToolParser):
    name = "kimi_k2"
    template_markers = (SECTION_BEGIN,)
    needs_special_tokens = True
    special_markers = (SECTION_BEGIN, SECTION_END, CALL_BEGIN, ARGS, CALL_END)

    def scan(self, text: str, final: bool) -> ScanResult:
        return scan_blocks(text, final, SECTION_BEGIN, self._read_section)

    def _read_section(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], int | None, bool]:
        calls: list[PartialCall] = []
        j = i
        while True:
            j = skip_ws(text, j)
            if j >= len(text):
                return calls, None, bool(calls) or not final
            if text.startswith(SECTION_END, j):
                return calls, j + len(SECTION_END), bool(calls)
            begun = at_marker(text, j, CALL_BEGIN)
            if begun is None and not final:
                return calls, None, True
            if not begun:
                return calls, None, False
            a = text.find(ARGS, j)
            if a < 0 or CALL_END in text[j:a]:
                return calls, None, a < 0 and not final and CALL_END not in text[j:]
            name = function_of(text[j + len(CALL_BEGIN):a])
            if not name or (self.tool_names is not None and name not in self.tool_names):
                return calls, None, False
            call = PartialCall(name=name)
            calls.append(call)
            try:
                end = json_args(call, text, a + len(ARGS))
            except ValueError:
                return calls, None, False
            if end is None:
                return calls, None, not final
            j = skip_ws(text, end)
            closed = at_marker(text, j, CALL_END)
            if not closed:  # (a call without its end marker is unfinished)
                return calls, None, closed is None and not final
            call.done = True
            j += len(CALL_END)

    def call_id(self, name: str | None = None, index: int = 0) -> str:
        return f"functions.{name}:{index}"

    def call_format_hint(self) -> str:
        return ("To call functions, write " + self.render_calls([("<function name>", "{<arguments as JSON>}")])
                + " (one <|tool_call_begin|>…<|tool_call_end|> per call, numbered from 0).")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        body = "".join(f"{CALL_BEGIN}{self.call_id(n, k)}{ARGS}{a or '{}'}{CALL_END}" for k, (n, a) in enumerate(calls))
        return SECTION_BEGIN + body + SECTION_END
