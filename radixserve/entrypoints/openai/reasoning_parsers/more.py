"""`<think>`-style reasoning of GLM-4.5/4.6, Kimi (`◁think▷…◁/think▷`) and MiniMax-M2.

GLM-4.5 writes `<think>…</think>` itself (an empty block when thinking is off); MiniMax-M2 begins its answer with
`<think>…</think>` (or its template opens the block in the prompt); Kimi's thinking models use `◁think▷…◁/think▷`.
Without the start marker, the answer is all content."""

from __future__ import annotations

from radixserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser


class Glm45ReasoningParser(ReasoningParser):
    name = "glm45"


class KimiReasoningParser(ReasoningParser):
    name = "kimi"
    start = "◁think▷"
    end = "◁/think▷"


class MiniMaxM2ReasoningParser(ReasoningParser):
    name = "minimax-m2"
