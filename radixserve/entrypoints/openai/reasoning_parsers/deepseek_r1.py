"""DeepSeek-R1: the template opens `<think>` in the prompt, so the answer starts inside the thinking block and only
`</think>` appears; an answer cut off before it is all reasoning."""

from __future__ import annotations

from radixserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class DeepSeekR1ReasoningParser(ReasoningParser):
    name = "deepseek-r1"
    starts_in_reasoning = True
