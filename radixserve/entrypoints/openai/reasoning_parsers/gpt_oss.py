"""GPT-OSS (harmony format, see entrypoints/openai/harmony.py): the `analysis` channel is the reasoning.

`split` returns the analysis messages' bodies as the reasoning and, as the rest, the raw text of every other
message (markers kept), which the `gpt-oss` tool parser reads into content and calls; the serving code pairs the
two and keeps special tokens in the output (`needs_special_tokens`). A text without harmony markers is all rest."""

from __future__ import annotations

from radixserve.entrypoints.openai.harmony import join_parts, read_messages
from radixserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser

ANALYSIS = "analysis"


class GptOssReasoningParser(ReasoningParser):
    name = "gpt-oss"
    needs_special_tokens = True

    def prompt_opens_reasoning(self, prompt_text: str) -> bool:
        return False  # each message names its channel: the prompt never leaves one open

    def split(self, text: str, final: bool, in_reasoning: bool = False) -> tuple[str, str]:
        reasoning: list[str] = []
        rest: list[str] = []
        for m in read_messages(text, final):
            if m.channel == ANALYSIS and m.recipient is None:
                reasoning.append(m.body)
            else:
                rest.append(text[m.start:m.end])
        return join_parts(reasoning, "\n"), "".join(rest)
