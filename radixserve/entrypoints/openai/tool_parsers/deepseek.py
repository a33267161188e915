"""DeepSeek-V3 / R1-0528 (`deepseekv3`) and DeepSeek-V3.1 (`deepseekv31`): calls in a section of special tokens,

    <｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>NAME
    ```json
    {arguments}
    ```<｜tool▁call▁end｜>...<｜tool▁calls▁end｜>

V3.1 drops the type and the code fence: `<｜tool▁call▁begin｜>NAME<｜tool▁sep｜>{arguments}<｜tool▁call▁end｜>`. Text
before the section is content. The markers are special tokens: the output keeps them while this parser reads it."""

from __future__ import annotations

from radixserve.entrypoints.openai.tool_parsers.base import PartialCall, ScanResult, ToolParser, skip_ws
from radixserve.entrypoints.openai.tool_parsers.markup import at_marker, json_args, scan_blocks

CALLS_BEGIN, CALLS_END = "<｜tool▁calls▁begin｜>", "<｜tool▁calls▁end｜>"
CALL_BEGIN, CALL_END, SEP = "<｜tool▁call▁begin｜>", "<｜tool▁call▁end｜>", "<｜tool▁sep｜>"
FENCE = "```"


class DeepSeekV3ToolParser(ToolParser):
    name = "deepseekv3"
    template_markers = (CALLS_BEGIN,)
    needs_special_tokens = True
    special_markers = (CALLS_BEGIN, CALLS_END, CALL_BEGIN, CALL_END, SEP)
    fenced = True  # V3: `type<sep>NAME\n```json\n{...}\n```` ; V3.1: `NAME<sep>{...}`

    def matches_template(self, chat_template: str) -> bool:
        return CALLS_BEGIN in chat_template and (FENCE + "json" in chat_template) == self.fenced

    def scan(self, text: str, final: bool) -> ScanResult:
        return scan_blocks(text, final, CALLS_BEGIN, self._read_section)

    def _read_section(self, text: str, i: int, final: bool) -> tuple[list[PartialCall], int | None, bool]:
        calls: list[PartialCall] = []
        j = i
        while True:
            j = skip_ws(text, j)
            if j >= len(text):
                return calls, None, bool(calls) or not final  # (a missing end marker at the very end is tolerated)
            if text.startswith(CALLS_END, j):
                return calls, j + len(CALLS_END), bool(calls)
            begun = at_marker(text, j, CALL_BEGIN)
            if begun is None and not final:
                return calls, None, True
            if not begun:
                return calls, None, False
            call, j, ok = self._read_call(text, j + len(CALL_BEGIN), final)
            if call is not None:
                calls.append(call)
            if not ok:
                return calls, None, False
            if j is None:
                return calls, None, True

    def _read_call(self, text: str, i: int, final: bool) -> tuple[PartialCall | None, int | None, bool]:
        """(the call so far, the index past it when complete, ok)."""
        sep = text.find(SEP, i)
        if sep < 0:
            return None, None, not final and CALL_END not in text[i:]
        if self.fenced:
            line_end = text.find("\n", sep)
            if line_end < 0:
                return None, None, not final
            name = text[sep + len(SEP):line_end].strip()
            j = skip_ws(text, line_end)
            fence = at_marker(text, j, FENCE + "json")
            if fence is None:
                return None, None, not final
            if fence:
                j += len(FENCE + "json")
        else:
            name, j = text[i:sep].strip(), sep + len(SEP)
        if not name or (self.tool_names is not None and name not in self.tool_names):
            return None, None, False
        call = PartialCall(name=name)
        try:
            end = json_args(call, text, j)
        except ValueError:
            return call, None, False
        if end is None:
            return call, None, not final
        j = skip_ws(text, end)
        if self.fenced and text.startswith(FENCE, j):
            j = skip_ws(text, j + len(FENCE))
        closed = at_marker(text, j, CALL_END)
        if closed:
            call.done = True
            return call, j + len(CALL_END), True
        return call, None, closed is None and not final  # (a call without its end marker is unfinished)

    def call_format_hint(self) -> str:
        return ("To call functions, write " + self.render_calls([("<function name>", "{<arguments as JSON>}")])
                + " (one <｜tool▁call▁begin｜>…<｜tool▁call▁end｜> per call).")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        if self.fenced:
            body = "".join(f"{CALL_BEGIN}function{SEP}{n}\n{FENCE}json\n{a or '{}'}\n{FENCE}{CALL_END}"
                           for n, a in calls)
        else:
            body = "".join(f"{CALL_BEGIN}{n}{SEP}{a or '{}'}{CALL_END}" for n, a in calls)
        return CALLS_BEGIN + body + CALLS_END


class DeepSeekV31ToolParser(DeepSeekV3ToolParser):
    name = "deepseekv31"
    fenced = False
