"""bench_serving's client side: when a streamed chunk counts as a token arrival (TTFT, ITL)."""

from __future__ import annotations

import asyncio
import json

from radixserve.bench_serving import BenchRequest, send_request


class _Resp:
    status = 200

    def __init__(self, events: list[bytes]) -> None:
        self.content = self
        self._events = events

    async def iter_any(self):  # noqa: ANN201
        for e in self._events:
            await asyncio.sleep(0.01)
            yield e

    async def __aenter__(self) -> _Resp:
        return self

    async def __aexit__(self, *exc: object) -> None:
        return None


class _Session:
    def __init__(self, events: list[bytes]) -> None:
        self.events = events

    def post(self, url: str, json: dict, headers: dict) -> _Resp:  # noqa: A002
        return _Resp(self.events)


def _sse(obj: dict) -> bytes:
    return b"data: " + json.dumps(obj).encode() + b"\n\n"


def test_native_chunks_count_tokens_that_decode_to_no_text() -> None:
    """Tokens 1 and 2 decode to no text (e.g. ids beyond a tokenizer's vocabulary): they still arrive, so TTFT is the
    first chunk's time and each gap is one step, not a gap folded over several tokens."""
    chunks = [("", 1), ("", 2), ("ab", 3), ("ab", 3), ("abc", 4)]  # the repeated (text, count) brings nothing
    events = [_sse({"text": t, "meta_info": {"completion_tokens": n}}) for t, n in chunks] + [b"data: [DONE]\n\n"]
    req = BenchRequest(prompt="x", prompt_len=1, output_len=4)
    res = asyncio.run(send_request(_Session(events), "http://x", "radixserve", "m", req, True, {}, 0.0))
    assert res.success and res.output_len == 4 and res.generated_text == "abc"
    assert 0.005 < res.ttft < 0.05
    assert len(res.itl) == 3 and all(0.005 < g < 0.05 for g in res.itl)
