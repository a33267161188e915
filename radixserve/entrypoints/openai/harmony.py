"""OpenAI's harmony output format (GPT-OSS): the messages of a generated text, for the `gpt-oss` reasoning and
tool-call parsers.

A harmony answer is a run of messages, each `<|start|>ROLE[ to=RECIPIENT]<|channel|>CHANNEL[ to=RECIPIENT]
[<|constrain|>TYPE | TYPE]<|message|>BODY` ended by `<|end|>`, `<|return|>` (the answer's last message) or `<|call|>`
(a tool call). Generation starts after the prompt's `<|start|>assistant`, so the first message has no `<|start|>`.
Channels: `analysis` (the model's reasoning), `final` (the answer), `commentary` (a call when it has a
`to=functions.NAME` recipient, else a preamble the user may see).

`read_messages(text, final)` reads the whole text generated so far. While streaming (final=False) a half-written
marker at the end is held back and a message counts only once its header is complete (`<|message|>` seen), so what
is read only grows. Malformed output never raises: text outside any message is a `plain` message, a stray marker
is skipped, a message that is not ended explicitly ends where the next one starts (or at the end of the text), and
a header cut off by the end of the text is dropped.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from radixserve.entrypoints.openai.tool_parsers.base import held_back

START, END, MESSAGE, CHANNEL = "<|start|>", "<|end|>", "<|message|>", "<|channel|>"
CONSTRAIN, RETURN, CALL, ENDOFTEXT = "<|constrain|>", "<|return|>", "<|call|>", "<|endoftext|>"
# every marker the parsers know; RETURN, CALL and ENDOFTEXT are the model's stop tokens (eos ids)
MARKERS = (START, END, MESSAGE, CHANNEL, CONSTRAIN, RETURN, CALL, ENDOFTEXT)
_CLOSERS = frozenset({END, RETURN, CALL, ENDOFTEXT})
_MARKER = re.compile("|".join(re.escape(m) for m in MARKERS))
_CHANNEL = re.compile(re.escape(CHANNEL) + r"\s*([^\s<]+)")
_RECIPIENT = re.compile(r"(?:^|[\s>])to=([^\s<]+)")
FUNCTIONS = "functions."


@dataclass
class HarmonyMessage:
    start: int  # where its raw text begins in the text read (its header, or the plain text)
    end: int  # just past its raw text (the closing marker included)
    channel: str | None = None
    recipient: str | None = None  # "functions.get_weather", "python", ...
    body: str = ""
    closed: bool = False  # ended by a marker (or by the next message's header)
    plain: bool = False  # text outside any message (no header): output without harmony structure

    @property
    def function(self) -> str | None:
        """The function a call message is addressed to (`to=functions.NAME`), else None."""
        if self.recipient is None or not self.recipient.startswith(FUNCTIONS):
            return None
        return self.recipient[len(FUNCTIONS):] or None


def marker_hold(text: str) -> int:
    """Length of the longest suffix of `text` that may be a marker still arriving."""
    return max(held_back(text, m) for m in MARKERS)


def has_markers(text: str) -> bool:
    return _MARKER.search(text) is not None


def _header(start: int, end: int, header: str) -> HarmonyMessage:
    channel = _CHANNEL.search(header)
    recipient = _RECIPIENT.search(header)
    return HarmonyMessage(start, end, channel.group(1) if channel else None, recipient.group(1) if recipient else None)


def read_messages(text: str, final: bool) -> list[HarmonyMessage]:
    """The messages of `text` (see the module's docstring); positions index `text`."""
    if not final:
        text = text[: len(text) - marker_hold(text)]
    msgs: list[HarmonyMessage] = []
    header_at: int | None = None  # inside a header that began here
    cur: HarmonyMessage | None = None  # the message whose body is being read
    pos = 0
    for m in _MARKER.finditer(text):
        piece, marker = text[pos:m.start()], m.group()
        if cur is not None:
            cur.body += piece
        elif header_at is None and piece:
            msgs.append(HarmonyMessage(pos, m.start(), body=piece, closed=True, plain=True))
        if marker == MESSAGE:
            if cur is None:  # (a stray `<|message|>` inside a body is skipped)
                at = m.start() if header_at is None else header_at
                cur = _header(at, m.end(), text[at:m.start()])
                msgs.append(cur)
                header_at = None
        elif marker in _CLOSERS:
            if cur is not None:
                cur.closed, cur.end, cur = True, m.end(), None
            header_at = None  # a header ended before its body: dropped (a stray closer: skipped)
        elif cur is not None:
            if marker != CONSTRAIN:  # the next message's header, no `<|end|>` written before it
                cur.closed, cur.end, cur = True, m.start(), None
                header_at = m.start()
        elif header_at is None or marker == START:
            header_at = m.start()
        pos = m.end()
    tail = text[pos:]
    if cur is not None:
        cur.body += tail
        cur.end = len(text)
    elif header_at is None and tail:
        msgs.append(HarmonyMessage(pos, len(text), body=tail, plain=True))
    return msgs


def join_parts(parts: list[str], sep: str = "\n\n") -> str:
    """Non-empty parts joined: a part that is still empty adds nothing (so the join only grows while streaming)."""
    return sep.join(p for p in parts if p)

