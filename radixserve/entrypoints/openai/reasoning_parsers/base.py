"""Splitting a model's thinking from its answer: `<think>…</think>` styles.

`split(text, final, in_reasoning)` looks at the whole text generated so far and returns (reasoning, content);
streaming diffs one split against the previous one (both only grow: a half-written marker is held back), so
streamed deltas and the final message agree. `in_reasoning` says that the prompt already opened the thinking block
(templates that end the generation prompt with `<think>`); a parser with `starts_in_reasoning` assumes so always.
"""

from __future__ import annotations

from radixserve.entrypoints.openai.tool_parsers.base import held_back


class ReasoningParser:
    name = "base"
    start = "<think>"
    end = "</think>"
    starts_in_reasoning = False  # the model's output begins inside the thinking block
    needs_special_tokens = False  # reads markers that are special tokens: the output keeps them (serving_chat)

    @property
    def special_markers(self) -> tuple[str, ...]:
        """The marker texts this parser reads (kept in the output when special tokens are)."""
        return (self.start, self.end)

    def prompt_opens_reasoning(self, prompt_text: str) -> bool:
        """True when the rendered prompt ends inside an open thinking block."""
        tail = prompt_text.rstrip()
        return tail.endswith(self.start) or (self.start in tail and tail.rfind(self.start) > tail.rfind(self.end))

    def split(self, text: str, final: bool, in_reasoning: bool = False) -> tuple[str, str]:
        in_reasoning = in_reasoning or self.starts_in_reasoning
        body = text.lstrip()
        if body.startswith(self.start):
            in_reasoning, text = True, body[len(self.start):]
        elif not final and self.start.startswith(body):
            return "", ""  # maybe the start marker, still arriving (or only whitespace so far)
        if not in_reasoning:
            return "", text
        i = text.find(self.end)
        if i < 0:
            if final:
                return _trim(text), ""
            return _trim(text[: len(text) - held_back(text, self.end)]), ""
        return _trim(text[:i]), text[i + len(self.end):].lstrip()


def _trim(reasoning: str) -> str:
    return reasoning.lstrip("\n")
