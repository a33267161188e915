"""Tokenizer loading and incremental detokenization."""

from __future__ import annotations

from typing import Any


def get_tokenizer(path: str, trust_remote_code: bool = False) -> Any:
    import os

    from transformers import AutoTokenizer

    try:
        if path.endswith(".gguf"):
            return AutoTokenizer.from_pretrained(os.path.dirname(path) or ".", gguf_file=os.path.basename(path),
                                                 trust_remote_code=trust_remote_code)
        return AutoTokenizer.from_pretrained(path, trust_remote_code=trust_remote_code)
    except Exception as e:  # transformers raises many kinds
        raise ValueError(f"could not load a tokenizer from {path!r}: {e}") from e


def get_tokenizer_for(server_args: Any, model_tokenizer_path: str) -> Any:
    """The tokenizer a server started with `server_args` uses: --tokenizer-path (else `model_tokenizer_path`),
    --trust-remote-code, and --chat-template's file as its chat template."""
    tok = get_tokenizer(server_args.tokenizer_path or model_tokenizer_path, server_args.trust_remote_code)
    if server_args.chat_template is not None:
        with open(server_args.chat_template, encoding="utf-8") as f:
            tok.chat_template = f.read()
    return tok


class IncrementalDecoder:
    """Turns a growing list of token ids into text deltas. A delta is emitted only once its bytes form complete
    characters (a multi-byte character split over tokens shows up whole, never as U+FFFD)."""

    # how many already-emitted tokens to re-decode as context (so word-initial spaces come out right)
    CONTEXT = 5

    def __init__(self, tokenizer: Any, skip_special_tokens: bool = True,
                 spaces_between_special_tokens: bool = True) -> None:
        self.tokenizer = tokenizer
        self.skip = skip_special_tokens
        self.spaces = spaces_between_special_tokens
        self.ids: list[int] = []
        self.prefix_offset = 0  # start of the context window
        self.read_offset = 0  # tokens already turned into emitted text
        self.text = ""

    def _decode(self, ids: list[int]) -> str:
        kw: dict[str, Any] = {"skip_special_tokens": self.skip}
        if not self.spaces:
            kw["spaces_between_special_tokens"] = False
        return self.tokenizer.decode(ids, **kw)

    def add(self, new_ids: list[int], final: bool = False) -> str:
        self.ids.extend(new_ids)
        prefix = self._decode(self.ids[self.prefix_offset:self.read_offset])
        full = self._decode(self.ids[self.prefix_offset:])
        if full.endswith("\ufffd") and not final:
            return ""  # wait for the rest of the character
        delta = full[len(prefix):] if full.startswith(prefix) else full
        self.text += delta
        self.read_offset = len(self.ids)
        self.prefix_offset = max(0, self.read_offset - self.CONTEXT)
        return delta
