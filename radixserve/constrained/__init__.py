"""Structured output: grammar backends (JSON schema, regex, EBNF) and their token bitmasks.

`create_grammar_backend(server_args, tokenizer, vocab_size)` builds the backend the scheduler uses (None for
`--grammar-backend none`); `validate_grammar(backend, kind, text)` is the cheap check the tokenizer manager runs
so that a bad constraint is a 400 before anything is queued. Backends are imported lazily: importing this package
never imports xgrammar.
"""

from __future__ import annotations

import importlib
import importlib.util
import logging
from collections.abc import Iterable
from functools import lru_cache
from typing import Any

from radixserve.constrained.base_grammar_backend import (
    GRAMMAR_KINDS,
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarError,
    bitmask_to_vocab_mask,
)

logger = logging.getLogger(__name__)

# The grammar backends (this registry also gives --grammar-backend its choices, with "none"): name ->
# (the class, imported when first used; the library that must be installed for it).
GRAMMAR_BACKENDS: dict[str, tuple[str, str]] = {
    "xgrammar": ("radixserve.constrained.xgrammar_backend:XGrammarBackend", "xgrammar"),
}


def is_backend_available(name: str) -> bool:
    """True when `name` is a known backend whose library is installed."""
    if name not in GRAMMAR_BACKENDS:
        return False
    module = GRAMMAR_BACKENDS[name][1]
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def _backend_class(name: str) -> type[BaseGrammarBackend]:
    if name not in GRAMMAR_BACKENDS:
        raise ValueError(f"unknown grammar backend {name!r}; expected one of {', '.join(GRAMMAR_BACKENDS)} or none")
    module, cls = GRAMMAR_BACKENDS[name][0].split(":")
    return getattr(importlib.import_module(module), cls)


def create_grammar_backend(server_args: Any, tokenizer: Any, vocab_size: int,
                           eos_token_ids: Iterable[int] | None = None) -> BaseGrammarBackend | None:
    """The backend chosen by `server_args.grammar_backend`, or None when it is "none", there is no tokenizer
    (--skip-tokenizer-init) or the library is missing (then constrained requests get a clear 400)."""
    name = getattr(server_args, "grammar_backend", "xgrammar")
    if name == "none":
        return None
    if tokenizer is None:
        logger.info("structured output is off: it needs the tokenizer (the server skips it)")
        return None
    if not is_backend_available(name):
        logger.warning("structured output is off: --grammar-backend %s is not installed (pip install %s)", name,
                       GRAMMAR_BACKENDS[name][1] if name in GRAMMAR_BACKENDS else name)
        return None
    if eos_token_ids is None:
        eos = getattr(tokenizer, "eos_token_id", None)
        eos_token_ids = [eos] if isinstance(eos, int) else []
    return _backend_class(name)(tokenizer, vocab_size, eos_token_ids)


@lru_cache(maxsize=4096)
def _validate_cached(name: str, kind: str, text: str) -> str | None:
    try:
        _backend_class(name).validate(kind, text)
    except GrammarError as e:
        return str(e)
    return None


def validate_grammar(name: str, kind: str, text: str) -> None:
    """Raise GrammarError when `text` is not a valid `kind` constraint for backend `name` (results cached)."""
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")
    if not isinstance(text, str):
        raise GrammarError(f"{kind}: must be a string, got {type(text).__name__}")
    error = _validate_cached(name, kind, text)
    if error is not None:
        raise GrammarError(error)


__all__ = ["GRAMMAR_BACKENDS", "GRAMMAR_KINDS", "BaseGrammarBackend", "BaseGrammarObject", "GrammarError",
           "bitmask_to_vocab_mask", "create_grammar_backend", "is_backend_available", "validate_grammar"]
