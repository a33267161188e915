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


class TextOffsets:
    """OpenAI's legacy `text_offset`: for each token in turn, the characters of the returned text before it.

    Counted from the tokens' real bytes (a character split over tokens counts once, when complete), so offsets
    index the returned text. With echo, the first `prompt_tokens` tokens index the echoed prompt and the output's
    tokens start at `prompt_chars` (the echoed text's length). Tokens in `skip_ids` (special tokens the output
    text leaves out) take no room."""

    def __init__(self, token_bytes: Callable[[int], bytes], skip_ids: frozenset[int] = frozenset(),
                 prompt_tokens: int = 0, prompt_chars: int = 0, prompt_skip_ids: frozenset[int] = frozenset()
                 ) -> None:
        import codecs

        self._new_decoder = codecs.getincrementaldecoder("utf-8")
        self.token_bytes = token_bytes
        self.skip_ids = skip_ids
        self.prompt_tokens = prompt_tokens
        self.prompt_chars = prompt_chars
        self.prompt_skip_ids = prompt_skip_ids
        self.n = 0
        self.chars = 0
        self.decoder = self._new_decoder(errors="replace")

    def advance(self, tid: int) -> int:
        if self.n == self.prompt_tokens:  # the output starts after the echoed prompt text
            self.chars = self.prompt_chars
            self.decoder = self._new_decoder(errors="replace")
        skip = self.prompt_skip_ids if self.n < self.prompt_tokens else self.skip_ids
        offset = self.chars
        if tid not in skip:
            self.chars += len(self.decoder.decode(self.token_bytes(tid)))
        self.n += 1
        return offset
