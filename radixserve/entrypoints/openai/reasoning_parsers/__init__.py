"""Reasoning parsers (`<think>` styles, GPT-OSS's harmony channels), one file per family, behind a registry with
lazy imports that feeds `--reasoning-parser`'s choices."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.entrypoints.openai.reasoning_parsers.base import ReasoningParser

_PKG = "radixserve.entrypoints.openai.reasoning_parsers"
REASONING_PARSERS: dict[str, str] = {
    "qwen3": f"{_PKG}.qwen3:Qwen3ReasoningParser",
    "deepseek-r1": f"{_PKG}.deepseek_r1:DeepSeekR1ReasoningParser",
    "gpt-oss": f"{_PKG}.gpt_oss:GptOssReasoningParser",
    "glm45": f"{_PKG}.more:Glm45ReasoningParser",
    "kimi": f"{_PKG}.more:KimiReasoningParser",
    "minimax-m2": f"{_PKG}.more:MiniMaxM2ReasoningParser",
    # SGLang's names for formats above: DeepSeek-V3.1's optional thinking (the template opens `<think>` when asked),
    # Qwen3's thinking-only models (the answer starts inside the block)
    "deepseek-v3": f"{_PKG}.qwen3:Qwen3ReasoningParser",
    "qwen3-thinking": f"{_PKG}.deepseek_r1:DeepSeekR1ReasoningParser",
}
REASONING_PARSERS["minimax_m2"] = REASONING_PARSERS["minimax-m2"]  # vLLM's name


def get_reasoning_parser(name: str) -> ReasoningParser:
    if name not in REASONING_PARSERS:
        raise ValueError(f"unknown reasoning parser {name!r}; expected one of {', '.join(REASONING_PARSERS)}")
    module, cls = REASONING_PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


__all__ = ["REASONING_PARSERS", "get_reasoning_parser"]
