"""The HTTP server: FastAPI routes over one TokenizerManager, served by uvicorn.

Routes
  native      POST /generate, GET /health, GET /health_generate, GET /get_model_info, GET /get_server_info,
              GET /get_internal_state, POST /flush_cache, POST /abort_request, GET /version
  OpenAI      POST /v1/completions, POST /v1/chat/completions, POST /v1/responses, GET and DELETE
              /v1/responses/{id}, GET /v1/responses/{id}/input_items, GET /v1/models, GET /v1/models/{model}
  metrics     GET /metrics (with --enable-metrics)

Routes live in `routes/` (one router per concern), middleware (API key, body size and read timeout) in
`middleware.py`. Every error is OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`). With an API key
(--api-key, --api-key-file or $RADIXSERVE_API_KEY) every route but /health needs `Authorization: Bearer KEY`.
Lifecycle (see `_Server`): SIGTERM drains then exits 0; a dead child process makes the server exit 1.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import signal
import socket
import threading
import time
from collections.abc import Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect

import radixserve
from radixserve.entrypoints import web
from radixserve.entrypoints.http_utils import ClientDisconnected, error_response
from radixserve.entrypoints.middleware import (
    AuthAndLogMiddleware,
    BodyGuardMiddleware,
    BodyReadTimeout,
    BodyTooLarge,
    too_large,
)
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.serving_base import structured_output_available
from radixserve.entrypoints.openai.serving_chat import OpenAIServingChat
from radixserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from radixserve.entrypoints.openai.serving_responses import OpenAIServingResponses
from radixserve.entrypoints.routes import ROUTERS
from radixserve.entrypoints.server_state import ServerState
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.server_args import ServerArgs
from radixserve.utils import log_safe

logger = logging.getLogger(__name__)

RESPONSE_FLUSH_S = 10  # at shutdown, after the last request finished, how long uvicorn waits for responses to be sent
DEAD_CHILD_GRACE_S = 3.0  # between a child's death and the exit: in-flight requests get their error
CHILD_POLL_S = 0.25
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


# ====================================================================== app
def default_model_name(model_path: str | None) -> str:
    if model_path is None:
        return EMBEDDED_MODEL_NAME
    return model_path


def create_app(tokenizer_manager: TokenizerManager, processes: Any, server_args: ServerArgs,
               metrics: Any = None) -> FastAPI:
    """The FastAPI app over a running TokenizerManager (from `launch_subprocesses`)."""
    tm = tokenizer_manager
    name = server_args.served_model_name or default_model_name(server_args.model_path)
    aliases = tuple(a for a in {server_args.model_path, os.path.basename(str(server_args.model_path or "")),
                                "default"} if a)
    grammar_ok = structured_output_available(server_args.grammar_backend)
    state = ServerState(tm=tm, processes=processes, server_args=server_args, served_model_name=name,
                        completions=OpenAIServingCompletion(tm, name, aliases, grammar_ok),
                        chat=OpenAIServingChat(tm, name, aliases, grammar_ok), metrics=metrics,
                        grammar_ok=grammar_ok)
    state.responses = OpenAIServingResponses(state.chat, server_args.responses_store_size)
    if metrics is not None:
        tm.metrics = metrics
    state.live_stats = web.attach_live_stats(tm)
    if server_args.is_embedding:
        from radixserve.entrypoints.openai.serving_embedding import OpenAIServingEmbedding

        state.embeddings = OpenAIServingEmbedding(tm, name, aliases, grammar_ok)

    app = FastAPI(title="radixserve", version=radixserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    _install_error_handlers(app)
    for router in ROUTERS:
        app.include_router(router)
    app.include_router(web.stats_router)
    if not server_args.disable_web_ui:
        app.include_router(web.page_router)
    app.add_middleware(BodyGuardMiddleware, max_bytes=server_args.max_request_bytes,
                       read_timeout=server_args.request_read_timeout)
    app.add_middleware(AuthAndLogMiddleware, api_key=server_args.resolved_api_key(),
                       log_requests=server_args.log_requests,
                       public=None if server_args.disable_web_ui else web.is_public)
    return app


def _install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> Response:
        return error_response(exc)

    @app.exception_handler(RequestError)
    async def _request_error(request: Request, exc: RequestError) -> Response:
        return error_response(from_request_error(exc))

    @app.exception_handler(ClientDisconnected)
    async def _gone(request: Request, exc: ClientDisconnected) -> Response:
        metrics = request.app.state.server.metrics
        if metrics is not None:
            metrics.observe_abort()
        return Response(status_code=499)  # nobody reads it; the requests were aborted

    @app.exception_handler(ClientDisconnect)
    async def _gone_during_upload(request: Request, exc: ClientDisconnect) -> Response:
        logger.info("client %s went away while sending %s %s", _client(request), request.method,
                    log_safe(request.url.path))
        return Response(status_code=499)

    @app.exception_handler(BodyTooLarge)
    async def _too_large(request: Request, exc: BodyTooLarge) -> Response:
        return _closing(error_response(too_large(request.app.state.server.server_args.max_request_bytes)))

    @app.exception_handler(BodyReadTimeout)
    async def _read_timeout(request: Request, exc: BodyReadTimeout) -> Response:
        timeout = request.app.state.server.server_args.request_read_timeout
        logger.info("client %s did not send the body of %s %s within %g s", _client(request), request.method,
                    log_safe(request.url.path), timeout)
        return _closing(error_response(APIError(f"the request body did not arrive within {timeout:g} s "
                                                "(--request-read-timeout)", 408, None, "request_timeout")))

    @app.exception_handler(TimeoutError)
    async def _timeout(request: Request, exc: TimeoutError) -> Response:
        return error_response(APIError("the scheduler did not answer in time (busy or stuck); retry later", 503, None,
                                       "engine_timeout"))

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, exc: StarletteHTTPException) -> Response:
        if exc.status_code == 404:
            msg = f"Invalid URL ({request.method} {request.url.path}): no such route"
        elif exc.status_code == 405:
            msg = f"Method {request.method} is not allowed on {request.url.path}"
        else:
            msg = str(exc.detail)
        return error_response(APIError(msg, exc.status_code, None, None))

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, exc: RequestValidationError) -> Response:
        return error_response(APIError(f"invalid request: {exc.errors()}", 400))

    @app.exception_handler(Exception)
    async def _internal(request: Request, exc: Exception) -> Response:
        logger.exception("unhandled error on %s %s", request.method, request.url.path)
        return error_response(APIError(f"internal server error: {type(exc).__name__}: {exc}", 500, None,
                                       "internal_error"))


def _client(request: Request) -> str:
    return f"{request.client.host}:{request.client.port}" if request.client else "?"


def _closing(resp: Response) -> Response:
    """The body was not read to its end: close the connection after this response."""
    resp.headers["Connection"] = "close"
    return resp


# ====================================================================== launching
class _Server(uvicorn.Server):
    """uvicorn with the server's lifecycle.

    SIGTERM/SIGINT: drain -- /health and new requests get 503 while in-flight requests run to their end, for up to
    --graceful-shutdown-timeout seconds; what is left is then aborted (its clients get an error); exit 0. A second
    signal aborts at once.
    A child process dies: one error line says which and how, in-flight requests fail with 503, /health, /metrics
    and /get_server_info say so, and after DEAD_CHILD_GRACE_S the server exits 1 (so a supervisor restarts it)."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready_line = ""
        self.exit_code = 0
        self._drain_deadline = 0.0
        self._tasks: list[asyncio.Task] = []

    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        if threading.current_thread() is not threading.main_thread():
            yield
            return
        originals = {sig: signal.signal(sig, self.handle_exit) for sig in (signal.SIGINT, signal.SIGTERM)}
        try:
            yield
        finally:
            for sig, handler in originals.items():
                signal.signal(sig, handler)

    def handle_exit(self, sig: int, frame: Any) -> None:
        if self.loop is None or not self.started:
            self.should_exit = True
            return
        self.loop.call_soon_threadsafe(self._on_signal, signal.Signals(sig).name)

    def _on_signal(self, name: str) -> None:
        state = self.state
        if state.draining:
            logger.info("received %s again: aborting %d in-flight request(s) now", name, len(state.tm.rid_to_state))
            state.abort_all("the server is shutting down")
            self._drain_deadline = 0.0
            if name == "SIGINT":
                self.force_exit = True
            return
        state.draining = True
        timeout = state.server_args.graceful_shutdown_timeout
        logger.info("received %s: draining %d in-flight request(s) for up to %g s (--graceful-shutdown-timeout); "
                    "new requests get 503", name, len(state.tm.rid_to_state), timeout)
        self._drain_deadline = time.monotonic() + timeout
        self._tasks.append(asyncio.get_running_loop().create_task(self._drain()))

    async def _drain(self) -> None:
        tm = self.state.tm
        while tm.rid_to_state and time.monotonic() < self._drain_deadline:
            await asyncio.sleep(0.05)
        if tm.rid_to_state:
            n = self.state.abort_all("the server is shutting down (--graceful-shutdown-timeout ran out)")
            logger.warning("the graceful-shutdown timeout ran out: aborted %d request(s)", n)
            end = time.monotonic() + 5.0
            while tm.rid_to_state and time.monotonic() < end:
                await asyncio.sleep(0.05)
        self.should_exit = True

    async def _watch_children(self) -> None:
        state = self.state
        while not self.should_exit:
            dead = state.processes.dead()
            if dead:
                state.dead_child = "; ".join(dead)
                logger.error("%s: failing in-flight requests and exiting with status 1 in %g s", state.dead_child,
                             DEAD_CHILD_GRACE_S)
                if state.metrics is not None:
                    state.metrics.set_engine_alive(False)
                self.exit_code = 1
                await asyncio.sleep(DEAD_CHILD_GRACE_S)
                self.should_exit = True
                return
            await asyncio.sleep(CHILD_POLL_S)

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            self._tasks.append(self.loop.create_task(self._watch_children()))
            logger.info("%s", self.ready_line)


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e} (another server? choose a free "
                               "port with --port)") from None


def _load_chat_template(path: str | None) -> str | None:
    if path is None:
        return None
    if not os.path.isfile(path):
        raise ValueError(f"--chat-template {path!r} is not a file")
    with open(path, encoding="utf-8") as f:
        return f.read()


def _url(host: str, port: int) -> str:
    shown = f"[{host}]" if ":" in host else host
    return f"http://{shown}:{port}"


def launch_server(server_args: ServerArgs) -> int:
    """Start the engine processes and serve HTTP until SIGTERM/SIGINT (returns 0 after the drain) or until a child
    process dies (returns 1)."""
    from radixserve.entrypoints.engine import launch_subprocesses

    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s] %(levelname)s %(name)s: %(message)s")
    if server_args.served_model_name is None:
        server_args.served_model_name = default_model_name(server_args.model_path)
    chat_template = _load_chat_template(server_args.chat_template)
    _check_port_free(server_args.host, server_args.port)
    tm, processes = launch_subprocesses(server_args)
    try:
        if chat_template is not None and tm.tokenizer is not None:
            tm.tokenizer.chat_template = chat_template
        metrics = None
        if server_args.enable_metrics:
            from radixserve.metrics.collector import MetricsCollector

            metrics = MetricsCollector(server_args.served_model_name)
        app = create_app(tm, processes, server_args, metrics)
        config = uvicorn.Config(app, host=server_args.host, port=server_args.port,
                                log_level="warning" if server_args.log_level == "info" else server_args.log_level,
                                access_log=False, timeout_graceful_shutdown=RESPONSE_FLUSH_S, lifespan="off",
                                timeout_keep_alive=30)
        server = _Server(config, app.state.server)
        url = _url(server_args.host, server_args.port)
        server.ready_line = (f"radixserve {radixserve.__version__} is ready on {url} "
                             f"(model {server_args.served_model_name}, pid {os.getpid()})")
        server.run()
    finally:
        logger.info("stopping the engine processes")
        processes.shutdown()
    logger.info("radixserve stopped")
    return server.exit_code
