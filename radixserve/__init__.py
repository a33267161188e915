"""radixserve: an LLM serving engine with a radix prefix cache, continuous batching and an OpenAI-compatible API."""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

__version__ = "0.1.0"

if TYPE_CHECKING:
    from radixserve.entrypoints.engine import Engine


def __getattr__(name: str) -> Any:  # lazy, so `import radixserve` stays light
    if name == "Engine":
        from radixserve.entrypoints.engine import Engine

        return Engine
    raise AttributeError(name)


__all__ = ["Engine"]
