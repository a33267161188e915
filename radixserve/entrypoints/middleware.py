"""ASGI middleware of the HTTP server: the API key check (and request log), and the request-body guard (size
limit, read timeout)."""

from __future__ import annotations

import asyncio
import hmac
import logging
import time
from collections.abc import Callable
from typing import Any

from radixserve.entrypoints.http_utils import error_response
from radixserve.entrypoints.openai.errors import APIError
from radixserve.utils import log_safe

logger = logging.getLogger("radixserve.entrypoints.http_server")


class BodyTooLarge(Exception):
    """The request body passed --max-request-bytes while being read."""


class BodyReadTimeout(Exception):
    """The client did not send its whole body within --request-read-timeout."""


class AuthAndLogMiddleware:
    """Checks `Authorization: Bearer KEY` (all routes but /health and the public web-page files) and, with
    --log-requests, logs each request."""

    def __init__(self, app: Any, api_key: str | None, log_requests: bool,
                 public: Callable[[str], bool] | None = None) -> None:
        self.app = app
        self.expected = f"bearer {api_key}".encode() if api_key else None
        self.log_requests = log_requests
        self.public = public or (lambda path: False)

    def _authorized(self, scope: dict[str, Any]) -> bool:
        if self.expected is None or scope["path"] == "/health" or self.public(scope["path"]):
            return True
        for name, value in scope.get("headers", []):
            if name == b"authorization":
                scheme, _, token = value.partition(b" ")
                return hmac.compare_digest(scheme.lower() + b" " + token.strip(), self.expected)
        return False

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        if not self._authorized(scope):
            err = APIError("Incorrect or missing API key: send the header 'Authorization: Bearer <key>'", 401, None,
                           "invalid_api_key")
            await error_response(err)(scope, receive, send)
            return
        if not self.log_requests:
            await self.app(scope, receive, send)
            return
        start = time.perf_counter()
        status: list[int] = []

        async def send_logged(message: dict[str, Any]) -> None:
            if message["type"] == "http.response.start":
                status.append(message["status"])
            await send(message)

        try:
            await self.app(scope, receive, send_logged)
        finally:
            logger.info("%s %s -> %s (%.1f ms)", scope["method"], log_safe(scope["path"]), status[0] if status else "-",
                        1000 * (time.perf_counter() - start))




class BodyGuardMiddleware:
    """A body larger than `max_bytes` is a 413 (at once when Content-Length says so, else as soon as the bytes read
    pass it); a body not fully received within `read_timeout` seconds is a 408. Only the body is timed: after it,
    `receive` is the client's own (streams wait on it for a disconnect)."""

    def __init__(self, app: Any, max_bytes: int, read_timeout: float) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.read_timeout = read_timeout

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        for name, value in scope.get("headers", []):
            if name == b"content-length" and value.isdigit() and int(value) > self.max_bytes:
                await error_response(too_large(self.max_bytes))(scope, receive, send)
                return
        loop = asyncio.get_running_loop()
        deadline = loop.time() + self.read_timeout
        received = 0
        done = False

        async def guarded_receive() -> dict[str, Any]:
            nonlocal received, done
            if done:
                return await receive()
            try:
                message = await asyncio.wait_for(receive(), max(0.0, deadline - loop.time()))
            except TimeoutError:
                done = True
                raise BodyReadTimeout() from None
            if message["type"] == "http.request":
                received += len(message.get("body", b""))
                if received > self.max_bytes:
                    done = True
                    raise BodyTooLarge()
                done = not message.get("more_body", False)
            else:
                done = True
            return message

        await self.app(scope, guarded_receive, send)


def too_large(max_bytes: int) -> APIError:
    return APIError(f"the request body is larger than {max_bytes} bytes (--max-request-bytes)", 413, None,
                    "request_too_large")
