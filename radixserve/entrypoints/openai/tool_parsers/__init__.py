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
}
DEFAULT_TOOL_PARSER = "hermes"  # when the chat template shows no family's markers
# markers checked in this order (a Llama template mentions neither <tool_call> nor [TOOL_CALLS]; GPT-OSS's harmony
# `<|channel|>` first: the most specific)
_DETECT_ORDER = ("gpt-oss", "mistral", "hermes", "llama3")


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
        if any(m in chat_template for m in get_tool_parser(name).template_markers):
            return name
    return None


__all__ = ["DEFAULT_TOOL_PARSER", "TOOL_PARSERS", "detect_tool_parser", "get_tool_parser"]
