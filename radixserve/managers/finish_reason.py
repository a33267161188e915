"""Why a request finished, as the scheduler records it. Messages to the other processes carry `to_json()` (the
dict the detokenizer, the tokenizer manager and the OpenAI layer read): {"type": "stop", "matched": token id,
string or None} | {"type": "length", "length": n} | {"type": "abort", "message": ..., "status_code"?: n}."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any


@dataclass(frozen=True)
class FinishReason:
    def to_json(self) -> dict[str, Any]:
        raise NotImplementedError


@dataclass(frozen=True)
class FinishMatchedToken(FinishReason):
    """A stop token (EOS or a stop_token_ids entry) was sampled; None: a grammar ended without an EOS id."""

    matched: int | None

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FinishMatchedStr(FinishReason):
    """A stop string appeared in the decoded output."""

    matched: str

    def to_json(self) -> dict[str, Any]:
        return {"type": "stop", "matched": self.matched}


@dataclass(frozen=True)
class FinishLength(FinishReason):
    """max_new_tokens (after the context-length cap) reached."""

    length: int

    def to_json(self) -> dict[str, Any]:
        return {"type": "length", "length": self.length}


@dataclass(frozen=True)
class FinishAbort(FinishReason):
    """Aborted (client gone, /abort_request, a bad request); status_code: the HTTP status it maps to, if any."""

    message: str = "aborted"
    status_code: int | None = None

    def to_json(self) -> dict[str, Any]:
        out: dict[str, Any] = {"type": "abort", "message": self.message}
        if self.status_code is not None:
            out["status_code"] = self.status_code
        return out
