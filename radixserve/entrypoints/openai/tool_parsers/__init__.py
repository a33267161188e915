"""Tool-call parsers, one file per model family, behind a registry with lazy imports.

`TOOL_PARSERS` (name -> "module:Class") feeds `--tool-call-parser`'s choices; `get_tool_parser(name)` builds one;
`detect_tool_parser(chat_template)` picks the family whose markers the template mentions."""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from radixserve.entrypoints.openai.tool_parsers.base import ToolParser

_PKG = "radixserve.entrypoints.openai.tool_parsers"
TOOL_PARSERS: dict[str, str] = {
    "hermes": f"{_PKG}.hermes:HermesToolParser",
    "qwen25": f"{_PKG}.hermes:HermesToolParser",
    "qwen3": f"{_PKG}.hermes:HermesToolParser",
    "llama3": f"{_PKG}.llama3:Llama3JsonToolParser",
    "mistral": f"{_PKG}.mistral:MistralToolParser",
    "gpt-oss": f"{_PKG}.gpt_oss:GptOssToolParser",
    "pythonic": f"{_PKG}.pythonic:PythonicToolParser",
    "deepseekv3": f"{_PKG}.deepseek:DeepSeekV3ToolParser",
    "deepseekv31": f"{_PKG}.deepseek:DeepSeekV31ToolParser",
    "glm45": f"{_PKG}.glm45:Glm45ToolParser",
    "qwen3_coder": f"{_PKG}.qwen3_coder:Qwen3CoderToolParser",
    "kimi_k2": f"{_PKG}.kimi_k2:KimiK2ToolParser",
    "minimax-m2": f"{_PKG}.minimax_m2:MiniMaxM2ToolParser",
}
# the names vLLM's --tool-call-parser gives the same formats
TOOL_PARSERS.update({"llama4_pythonic": TOOL_PARSERS["pythonic"], "deepseek_v3": TOOL_PARSERS["deepseekv3"],
                     "deepseek_v31": TOOL_PARSERS["deepseekv31"], "minimax_m2": TOOL_PARSERS["minimax-m2"]})
DEFAULT_TOOL_PARSER = "hermes"  # when the chat template shows no family's markers
# templates checked in this order: the most specific markers first (GPT-OSS's harmony `<|channel|>`; GLM's and
# Qwen3-Coder's templates also show hermes' <tool_call>; Llama 4's shows `ipython` as Llama 3's does)
_DETECT_ORDER = ("gpt-oss", "mistral", "kimi_k2", "deepseekv3", "deepseekv31", "minimax-m2", "glm45",
                 "qwen3_coder", "hermes", "pythonic", "llama3")


def get_tool_parser(name: str) -> ToolParser:
    if name not in TOOL_PARSERS:
        raise ValueError(f"unknown tool-call parser {name!r}; expected one of {', '.join(TOOL_PARSERS)}")
    module, cls = TOOL_PARSERS[name].split(":")
    return getattr(importlib.import_module(module), cls)()


def detect_tool_parser(chat_template: str | None) -> str | None:
    """The parser whose markers the chat template contains, or None."""
    if not chat_template:
        return None
    for name in _DETECT_ORDER:
        if get_tool_parser(name).matches_template(chat_template):
            return name
    return None


__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "detect_tool_parser", "get_tool_parser"]
