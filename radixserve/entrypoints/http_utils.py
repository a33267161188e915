"""HTTP plumbing shared by the native and OpenAI handlers: JSON bodies, JSON/SSE responses, and aborting work when
the client goes away."""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

import orjson
from fastapi import Request
from fastapi.responses import Response, StreamingResponse
from pydantic import BaseModel, ValidationError

from radixserve.entrypoints.openai.errors import APIError, from_validation_error

T = TypeVar("T")
M = TypeVar("M", bound=BaseModel)

SSE_DONE = b"data: [DONE]\n\n"


class ClientDisconnected(Exception):
    """The client closed the connection before the response was ready."""


def json_response(content: Any, status_code: int = 200) -> Response:
    return Response(orjson.dumps(content, option=orjson.OPT_SERIALIZE_NUMPY), status_code=status_code,
                     media_type="application/json")


def error_response(err: APIError) -> Response:
    headers = {"WWW-Authenticate": "Bearer"} if err.status_code == 401 else None
    resp = json_response(err.body(), err.status_code)
    if headers:
        resp.headers.update(headers)
    return resp


def sse_event(payload: Any) -> bytes:
    return b"data: " + orjson.dumps(payload) + b"\n\n"


async def read_json(request: Request) -> dict[str, Any]:
    """The body as a JSON object; malformed JSON or another JSON type is a 400."""
    raw = await request.body()
    if not raw.strip():
        raise APIError("the request body is empty: send a JSON object", 400, None, "invalid_json")
    try:
        data = orjson.loads(raw)
    except orjson.JSONDecodeError as e:
        raise APIError(f"malformed JSON in the request body: {e}", 400, None, "invalid_json") from None
    if not isinstance(data, dict):
        raise APIError(f"the request body must be a JSON object, got a JSON {type(data).__name__}", 400, None,
                       "invalid_json")
    return data


def parse_model(model: type[M], data: dict[str, Any]) -> M:
    try:
        return model.model_validate(data)
    except ValidationError as e:
        raise from_validation_error(e) from None


async def _wait_disconnect(request: Request) -> None:
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def until_disconnected(request: Request, awaitable: Awaitable[T]) -> T:
    """Await `awaitable`; if the client disconnects first, cancel it (which aborts its requests in the engine) and
    raise ClientDisconnected. The request body must have been read already."""
    task: asyncio.Future[T] = asyncio.ensure_future(awaitable)
    watcher = asyncio.ensure_future(_wait_disconnect(request))
    try:
        await asyncio.wait({task, watcher}, return_when=asyncio.FIRST_COMPLETED)
    except asyncio.CancelledError:
        task.cancel()
        raise
    finally:
        watcher.cancel()
    if task.done():
        return task.result()
    task.cancel()
    with contextlib.suppress(asyncio.CancelledError, Exception):
        await task
    raise ClientDisconnected()


class SSEResponse(StreamingResponse):
    """A text/event-stream response that always closes its body iterator, so the engine-side generator's clean-up
    (aborting unfinished requests) runs as soon as the response ends, however it ends."""

    media_type = "text/event-stream"

    def __init__(self, content: AsyncIterator[bytes], status_code: int = 200) -> None:
        super().__init__(content, status_code=status_code, media_type="text/event-stream",
                         headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            aclose = getattr(self.body_iterator, "aclose", None)
            if aclose is not None:
                with contextlib.suppress(Exception):
                    await aclose()


def stream_as_sse(request: Request, tm: Any, obj: Any,
                  render: Callable[[AsyncIterator[dict[str, Any]]], AsyncIterator[bytes]],
                  to_error: Callable[[Exception], APIError],
                  generate: Callable[[Any], AsyncIterator[dict[str, Any]]] | None = None,
                  error_event: Callable[[APIError], bytes] | None = None,
                  done: bytes | None = SSE_DONE) -> Awaitable[Response]:
    """Start `obj` on the tokenizer manager (or with `generate`) and wait for its first output (so bad input and
    overload are plain HTTP errors), then stream `render(outputs)` as server-sent events ending in `done` ([DONE]);
    a later error is an error event (`error_event(err)`, else `data: {"error": ...}`). A client that leaves
    mid-stream closes the generator, which aborts the request."""
    def error_chunk(err: APIError) -> bytes:
        return error_event(err) if error_event is not None else sse_event(err.body())

    from radixserve.managers.tokenizer_manager import RequestError

    async def start() -> Response:
        agen = (generate or tm.generate_request)(obj)
        try:
            first = await until_disconnected(request, agen.__anext__())
        except StopAsyncIteration:
            first = None
        except RequestError as e:
            await agen.aclose()
            raise to_error(e) from None
        except BaseException:
            await agen.aclose()
            raise

        async def outputs() -> AsyncIterator[dict[str, Any]]:
            if first is not None:
                yield first
                async for o in agen:
                    yield o

        async def body() -> AsyncIterator[bytes]:
            ended = False
            try:
                async for chunk in render(outputs()):
                    yield chunk
                ended = True
            except RequestError as e:
                ended = True
                yield error_chunk(to_error(e))
            except APIError as e:
                ended = True
                yield error_chunk(e)
            except Exception as e:  # an engine bug must still end the stream cleanly
                ended = True
                _logger.exception("error while streaming request %s", getattr(obj, "rid", None))
                yield error_chunk(APIError(f"internal error: {type(e).__name__}: {e}", 500))
            finally:
                await agen.aclose()
                if not ended and tm.metrics is not None:  # the client went away mid-stream
                    tm.metrics.observe_abort()
            if done is not None:
                yield done

        return SSEResponse(body())

    return start()


_logger = logging.getLogger(__name__)
