"""The xgrammar backend (`--grammar-backend xgrammar`): JSON schema, regex and EBNF through xgrammar's
GrammarCompiler (its own cache of compiled grammars and rule masks) and one GrammarMatcher per request.

The token table is built once from the Hugging Face tokenizer with the *model's* vocabulary size: a model whose LM
head is wider than the tokenizer (padded vocabularies) gets those extra ids masked out, never sampled. The stop
tokens of every grammar are the model's EOS ids, so a complete grammar lets the model stop the way it normally
does and the request then finishes with `{"type": "stop", "matched": <eos id>}`.
"""

from __future__ import annotations

import json
import re
from collections.abc import Iterable
from typing import Any

import torch
import xgrammar as xgr

from radixserve.constrained.base_grammar_backend import (
    DEFAULT_CACHE_ENTRIES,
    DEFAULT_COMPILE_THREADS,
    BaseGrammarBackend,
    BaseGrammarObject,
    GrammarError,
    check_kind,
)

# xgrammar's C++ errors start with a log prefix ("[14:23:48] /project/cpp/x.cc:94: ") and may echo the whole input.
_LOG_PREFIX = re.compile(r"^\s*\[[0-9:.]+\]\s+\S+?:\d+:\s*")
_CHECK_FAILED = re.compile(r"Check failed: \(.*?\) is false:\s*")
MAX_ERROR_CHARS = 300
COMPILER_CACHE_BYTES = 256 << 20


def _clean_error(e: BaseException) -> str:
    msg = _CHECK_FAILED.sub("", _LOG_PREFIX.sub("", str(e).strip()))
    msg = msg.split(" The JSON string is:", 1)[0].strip()
    msg = " ".join(msg.split())
    if len(msg) > MAX_ERROR_CHARS:
        msg = msg[: MAX_ERROR_CHARS - 3] + "..."
    return msg or type(e).__name__


def _check_json_schema_text(text: str) -> None:
    try:
        schema = json.loads(text)
    except json.JSONDecodeError as e:
        raise GrammarError(f"json_schema: not valid JSON: {e}") from None
    if not isinstance(schema, dict | bool):
        raise GrammarError(f"json_schema: a JSON schema must be an object (or a boolean), got "
                           f"{type(schema).__name__}")
    found = unenforced_keyword(schema)
    if found is not None:
        keyword, where = found
        raise GrammarError(f"json_schema: {keyword!r} (at {where}) is not enforced by the grammar backend "
                           "(xgrammar): the output could break it; leave it out of the schema")


# Keywords xgrammar 0.2 compiles without enforcing (an instance that breaks them is accepted; checked by matching
# violating instances): rejected rather than silently ignored. `allOf` is enforced with one subschema only.
_UNENFORCED = ("contains", "minContains", "maxContains", "if", "then", "else", "not", "dependentRequired",
               "dependentSchemas", "dependencies", "patternProperties")
# keywords whose value is a schema, a list of schemas, or a {name: schema} map (names are not keywords)
_SUBSCHEMA = ("items", "additionalProperties", "unevaluatedProperties", "propertyNames", "contains", "not", "if",
              "then", "else")
_SUBSCHEMA_LISTS = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUBSCHEMA_MAPS = ("properties", "$defs", "definitions", "patternProperties", "dependentSchemas")


def unenforced_keyword(schema: Any, where: str = "#") -> tuple[str, str] | None:
    """The first keyword of `schema` (walked through its subschemas) that the backend would not enforce, with its
    location, or None."""
    if not isinstance(schema, dict):
        return None
    for key in _UNENFORCED:
        if key in schema and schema[key] not in ({}, [], None):
            return key, where
    if schema.get("uniqueItems") is True:
        return "uniqueItems", where
    if isinstance(schema.get("allOf"), list) and len(schema["allOf"]) > 1:
        return "allOf", where
    subs: list[tuple[Any, str]] = [(schema[k], f"{where}/{k}") for k in _SUBSCHEMA if k in schema]
    for k in _SUBSCHEMA_LISTS:
        if isinstance(schema.get(k), list):
            subs += [(v, f"{where}/{k}/{i}") for i, v in enumerate(schema[k])]
    for k in _SUBSCHEMA_MAPS:
        if isinstance(schema.get(k), dict):
            subs += [(v, f"{where}/{k}/{name}") for name, v in schema[k].items()]
    if isinstance(schema.get("items"), list):  # (draft 4-7 tuple form)
        subs += [(v, f"{where}/items/{i}") for i, v in enumerate(schema["items"])]
    for sub, at in subs:
        found = unenforced_keyword(sub, at)
        if found is not None:
            return found
    return None


class XGrammarGrammar(BaseGrammarObject):
    """One request's xgrammar GrammarMatcher."""

    def __init__(self, compiled: xgr.CompiledGrammar) -> None:
        super().__init__()
        self._compiled = compiled
        self._matcher = xgr.GrammarMatcher(compiled)

    def accept_token(self, token_id: int) -> bool:
        ok = bool(self._matcher.accept_token(int(token_id)))
        if ok:
            self.num_accepted += 1
        return ok

    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        self._matcher.fill_next_token_bitmask(mask, row)

    def is_terminated(self) -> bool:
        return bool(self._matcher.is_terminated())

    def rollback(self, num_tokens: int) -> None:
        if num_tokens < 0 or num_tokens > self.num_accepted:
            raise ValueError(f"rollback: cannot undo {num_tokens} of {self.num_accepted} accepted tokens")
        if num_tokens:
            self._matcher.rollback(num_tokens)
            self.num_accepted -= num_tokens

    def copy(self) -> XGrammarGrammar:
        return XGrammarGrammar(self._compiled)


class XGrammarBackend(BaseGrammarBackend):
    def __init__(self, tokenizer: Any, vocab_size: int, eos_token_ids: Iterable[int] | None = None, *,
                 any_whitespace: bool = False, num_threads: int = DEFAULT_COMPILE_THREADS,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        super().__init__(vocab_size, num_threads=num_threads, cache_entries=cache_entries)
        stop = sorted({int(t) for t in eos_token_ids or ()})
        self.tokenizer_info = xgr.TokenizerInfo.from_huggingface(tokenizer, vocab_size=self.vocab_size,
                                                                 stop_token_ids=stop or None)
        self.compiler = xgr.GrammarCompiler(self.tokenizer_info, max_threads=max(1, num_threads),
                                            cache_enabled=True, cache_limit_bytes=COMPILER_CACHE_BYTES)
        # Compact JSON ("{"a": 1, "b": [2]}"): free whitespace lets a small model pad the output with newlines
        # until it runs out of tokens.
        self.any_whitespace = any_whitespace

    def compile(self, kind: str, text: str) -> XGrammarGrammar:
        check_kind(kind)
        if kind == "json_schema":
            _check_json_schema_text(text)
        try:
            if kind == "json_schema":
                compiled = self.compiler.compile_json_schema(text, any_whitespace=self.any_whitespace)
            elif kind == "regex":
                compiled = self.compiler.compile_regex(text)
            else:
                compiled = self.compiler.compile_grammar(text)
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{kind}: invalid {_WHAT[kind]}: {_clean_error(e)}") from None
        return XGrammarGrammar(compiled)

    @classmethod
    def validate(cls, kind: str, text: str) -> None:
        check_kind(kind)
        if not isinstance(text, str):
            raise GrammarError(f"{kind}: must be a string, got {type(text).__name__}")
        try:
            if kind == "json_schema":
                _check_json_schema_text(text)
                xgr.Grammar.from_json_schema(text, any_whitespace=False)
            elif kind == "regex":
                xgr.Grammar.from_regex(text)
            else:
                xgr.Grammar.from_ebnf(text)
        except GrammarError:
            raise
        except (RuntimeError, ValueError, TypeError) as e:
            raise GrammarError(f"{kind}: invalid {_WHAT[kind]}: {_clean_error(e)}") from None


_WHAT = {"json_schema": "JSON schema", "regex": "regular expression", "ebnf": "EBNF grammar"}
