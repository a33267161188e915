"""Hermes / Qwen2.5 / Qwen3: each call is `<tool_call>\n{"name": ..., "arguments": {...}}\n</tool_call>`; text outside
the blocks is content."""

from __future__ import annotations

from radixserve.entrypoints.openai.tool_parsers.base import (
    ScanResult,
    ToolParser,
    call_json,
    finish_scan,
    held_back,
    scan_call_object,
    skip_ws,
)

START, END = "<tool_call>", "</tool_call>"


class HermesToolParser(ToolParser):
    name = "hermes"
    template_markers = (START,)

    def scan(self, text: str, final: bool) -> ScanResult:
        res = ScanResult()
        content: list[str] = []
        pos = 0
        while True:
            i = text.find(START, pos)
            if i < 0:
                tail = text[pos:]
                content.append(tail if final else tail[: len(tail) - held_back(tail, START)])
                break
            content.append(text[pos:i])
            j = skip_ws(text, i + len(START))
            call, end = scan_call_object(text, j, ("arguments", "parameters"), self.tool_names)
            if call is None:
                if j >= len(text) and not final:
                    break  # the block has only begun
                return ScanResult(text, []) if final else ScanResult("".join(content), res.calls)
            res.calls.append(call)
            if end is None:
                break
            close = text.find(END, end)
            if close < 0:
                if final:
                    pos = len(text)  # a missing close tag at the very end (stopped on it) is tolerated
                    continue
                break
            pos = close + len(END)
            # blocks are usually separated by a newline; keep it out of the content (whatever follows it, so that
            # the streamed content never has to take it back)
            while pos < len(text) and text[pos] == "\n":
                pos += 1
        res.content = "".join(content)
        return finish_scan(text, res) if final else res

    def call_format_hint(self) -> str:
        return ('To call a function, answer with one block per call:\n<tool_call>\n{"name": "<function name>", '
                '"arguments": {<arguments as JSON>}}\n</tool_call>')

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "\n".join(f"{START}\n{call_json(n, a)}\n{END}" for n, a in calls)
