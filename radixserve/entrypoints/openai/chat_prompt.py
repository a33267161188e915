"""Chat messages -> prompt token ids through the tokenizer's chat template, with message text kept as text.

The template's own markers (`<|im_start|>`, `<|eot_id|>`, ...) are special tokens; the same strings inside a
message's content are tokenized as plain text, so user input cannot forge a role marker (`<|im_start|>system`).
`--parse-special-tokens-in-messages` restores the raw behaviour (the rendered prompt tokenized as one text).

How: when some content holds a special-token string, the template is rendered once more with each content wrapped
in private-use marker characters; the text between markers is content, the rest is the template's. The pieces are
tokenized separately, the content with `split_special_tokens`. Templates that trim content are handled; one that
changes content otherwise cannot be split, and such a request is a 400 rather than a silent forgery."""

from __future__ import annotations

import re
from typing import Any

_OPEN, _CLOSE = "\ue000", "\ue001"
_PIECE = re.compile(f"({_OPEN}[^{_OPEN}{_CLOSE}]*{_CLOSE})")


class ChatPromptError(ValueError):
    """The messages cannot be tokenized safely (or the template rejected them)."""


def special_strings(tok: Any) -> tuple[str, ...]:
    """The strings the tokenizer turns into added/special tokens when it parses them."""
    cached = getattr(tok, "_radixserve_special_strings", None)
    if cached is not None:
        return cached
    found = set(getattr(tok, "all_special_tokens", []) or [])
    for added in (getattr(tok, "added_tokens_decoder", None) or {}).values():
        found.add(getattr(added, "content", str(added)))
    out = tuple(s for s in found if s)
    try:
        tok._radixserve_special_strings = out
    except AttributeError:
        pass
    return out


def render(tok: Any, messages: list[dict[str, Any]], **template_kwargs: Any) -> str:
    try:
        return tok.apply_chat_template(messages, add_generation_prompt=True, tokenize=False, **template_kwargs)
    except Exception as e:  # jinja errors raised by the template itself ("roles must alternate", ...)
        raise ChatPromptError(f"the chat template rejected them: {e}") from None


def split_prompt(tok: Any, messages: list[dict[str, Any]], parse_special: bool,
                 **template_kwargs: Any) -> list[tuple[str, bool]]:
    """The rendered prompt as (text, is_message_content) pieces; one template piece when nothing needs guarding."""
    text = render(tok, messages, **template_kwargs)
    contents = [m.get("content") for m in messages]
    specials = special_strings(tok)
    guarded = [i for i, c in enumerate(contents) if isinstance(c, str) and any(s in c for s in specials)]
    if parse_special or not guarded:
        return [(text, False)]
    if any(_OPEN in c or _CLOSE in c for c in contents if isinstance(c, str)):
        raise ChatPromptError("a message holds both a special-token string and a private-use marker character "
                              "(U+E000/U+E001); remove one")
    for strip in (False, True):  # the second try suits templates that trim content (`| trim`)
        marked = [dict(m, content=f"{_OPEN}{c.strip() if strip else c}{_CLOSE}") if isinstance(c, str) else m
                  for m, c in zip(messages, contents, strict=True)]
        pieces = [(p[1:-1], True) if p.startswith(_OPEN) else (p, False)
                  for p in _PIECE.split(render(tok, marked, **template_kwargs)) if p]
        if "".join(p for p, _ in pieces) == text and not any(_OPEN in p or _CLOSE in p for p, _ in pieces):
            return pieces
    first = guarded[0]
    found = next(s for s in specials if s in contents[first])
    raise ChatPromptError(f"messages[{first}].content holds the special-token string {found!r}, and this chat "
                          "template changes message text, so it cannot be kept as plain text; remove it, or start the "
                          "server with --parse-special-tokens-in-messages")


def encode_pieces(tok: Any, pieces: list[tuple[str, bool]]) -> list[int]:
    """Token ids of the pieces: the template's with special tokens parsed, message content as plain text."""
    ids: list[int] = []
    special_ids: set[int] | None = None
    for text, is_content in pieces:
        if not is_content:
            ids.extend(tok.encode(text, add_special_tokens=False))
            continue
        part = tok.encode(text, add_special_tokens=False, split_special_tokens=True)
        if special_ids is None:
            special_ids = set(tok.convert_tokens_to_ids(list(special_strings(tok))))
        if special_ids.intersection(part):
            raise ChatPromptError("this tokenizer cannot tokenize special-token strings as plain text; start the "
                                  "server with --parse-special-tokens-in-messages to accept them as tokens")
        ids.extend(part)
    return ids
