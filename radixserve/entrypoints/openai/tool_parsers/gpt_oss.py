"""GPT-OSS (harmony format, see entrypoints/openai/harmony.py): a call is a message addressed to a function,
`<|channel|>commentary to=functions.NAME <|constrain|>json<|message|>{arguments}<|call|>` (the recipient may also
come before the channel: `<|start|>assistant to=functions.NAME<|channel|>commentary json<|message|>...`).

The content is the bodies of the `final` messages, of commentary without a recipient (a preamble the user may
see) and of text outside any message, joined by a blank line; `analysis` messages are the reasoning (the
`gpt-oss` reasoning parser takes them out first) and never content. Markers, stop tokens included, never reach
the content. A text without harmony markers is all content. With `final=True`, a call that is not one of the
request's functions, or whose arguments are not a JSON object, makes every message's body content and no call
(the other parsers' rule)."""

from __future__ import annotations

from radixserve.entrypoints.openai.harmony import (
    CALL,
    CHANNEL,
    CONSTRAIN,
    MESSAGE,
    START,
    HarmonyMessage,
    has_markers,
    join_parts,
    marker_hold,
    read_messages,
)
from radixserve.entrypoints.openai.tool_parsers.base import PartialCall, ScanResult, ToolParser

ANALYSIS = "analysis"


class GptOssToolParser(ToolParser):
    name = "gpt-oss"
    template_markers = (CHANNEL,)
    needs_special_tokens = True

    def scan(self, text: str, final: bool) -> ScanResult:
        if not has_markers(text):
            visible = text if final else text[: len(text) - marker_hold(text)]
            # whitespace alone may come before a first marker, where it is not content: held back until the end
            return ScanResult(visible if final or visible.strip() else "", [])
        content: list[str] = []
        everything: list[str] = []  # what the content is when a call turns out malformed
        calls: list[PartialCall] = []
        malformed = False
        for m in read_messages(text, final):
            if m.plain and not m.body.strip():
                continue  # between messages (held back while streaming: it may come before a header)
            if m.channel == ANALYSIS and m.recipient is None:
                continue
            everything.append(m.body)
            if m.recipient is None:
                content.append(m.body)
                continue
            call = self._call(m, final)
            if call is None:
                if not final:
                    break  # not a call of this request's: nothing after it is streamed before the end
                malformed = True
                continue
            calls.append(call)
        if final and (malformed or any(c.final_arguments() is None for c in calls)):
            return ScanResult(join_parts(everything), [])
        return ScanResult(join_parts(content), calls)

    def _call(self, m: HarmonyMessage, final: bool) -> PartialCall | None:
        name = m.function
        if name is None or (self.tool_names is not None and name not in self.tool_names):
            return None
        # a call cut off at the very end (stopped on `<|call|>` without it in the text) counts if its JSON does
        return PartialCall(name=name, args=m.body.lstrip(), done=m.closed or final)

    def call_format_hint(self) -> str:
        return ("To call a function, write a commentary message addressed to it: <|start|>assistant<|channel|>"
                "commentary to=functions.<function name> <|constrain|>json<|message|>{<arguments as JSON>}<|call|>")

    def render_calls(self, calls: list[tuple[str, str]]) -> str:
        return "".join(f"{START}assistant{CHANNEL}commentary to=functions.{n} {CONSTRAIN}json{MESSAGE}{a or '{}'}{CALL}"
                       for n, a in calls)
