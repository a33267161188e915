"""The bytes a token stands for, whether or not they form whole UTF-8 characters (OpenAI's logprob `bytes`).

Decoding one token of a multi-byte character gives U+FFFD; its real bytes come from the vocabulary: byte-level BPE
(GPT-2, Llama 3, Qwen, SmolLM) maps each byte to one printable character, SentencePiece writes raw bytes as
`<0xE4>` and spaces as U+2581. Added and special tokens are their text."""

from __future__ import annotations

import functools
import re
from collections.abc import Callable
from typing import Any

_SP_BYTE = re.compile(r"^<0x([0-9A-Fa-f]{2})>$")


@functools.lru_cache(maxsize=1)
def _byte_level_decoder() -> dict[str, int]:
    """GPT-2's byte <-> printable character table, inverted."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + \
        list(range(ord("®"), ord("ÿ") + 1))
    chars = list(printable)
    n = 0
    for b in range(256):
        if b not in printable:
            printable.append(b)
            chars.append(256 + n)
            n += 1
    return {chr(c): b for b, c in zip(printable, chars, strict=True)}


def _is_byte_level(tok: Any) -> bool:
    backend = getattr(tok, "backend_tokenizer", None)
    decoder = getattr(backend, "decoder", None)
    return decoder is not None and "ByteLevel" in repr(decoder)


def token_bytes_fn(tok: Any) -> Callable[[int], bytes]:
    """A function from token id to its bytes, for this tokenizer (cached per id)."""
    if tok is None:
        return lambda tid: b""
    added = {int(i): t.content for i, t in (getattr(tok, "added_tokens_decoder", None) or {}).items()}
    byte_level = _is_byte_level(tok)
    table = _byte_level_decoder()

    @functools.lru_cache(maxsize=1 << 16)
    def token_bytes(tid: int) -> bytes:
        if tid in added:
            return added[tid].encode("utf-8")
        piece = tok.convert_ids_to_tokens(tid)
        if not isinstance(piece, str):
            return tok.decode([tid]).encode("utf-8")
        if byte_level and all(ch in table for ch in piece):
            return bytes(table[ch] for ch in piece)
        m = _SP_BYTE.match(piece)
        if m:
            return bytes([int(m.group(1), 16)])
        if "\u2581" in piece:
            return piece.replace("\u2581", " ").encode("utf-8")
        return tok.decode([tid]).encode("utf-8")

    return token_bytes
