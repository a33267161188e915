"""Qwen3: the answer may begin with `<think>…</think>` (or the template opens the block); without it, all of the
answer is content (`enable_thinking: false`)."""

from __future__ import annotations

from radixserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class Qwen3ReasoningParser(ReasoningParser):
    name = "qwen3"
