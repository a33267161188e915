"""The HTTP server: FastAPI routes over one TokenizerManager, served by uvicorn.

Routes
  native      POST /generate, GET /health, GET /health_generate, GET /get_model_info, GET /get_server_info,
              GET /get_internal_state, POST /flush_cache, POST /abort_request, GET /version
  OpenAI      POST /v1/completions, POST /v1/chat/completions, GET /v1/models, GET /v1/models/{model}
  metrics     GET /metrics (with --enable-metrics)

Every error is OpenAI-shaped (`{"error": {"message", "type", "param", "code"}}`). With --api-key every route but
/health needs `Authorization: Bearer KEY`. SIGTERM/SIGINT: stop accepting, abort in-flight requests (their streams
end with finish_reason "abort"), stop the scheduler and detokenizer processes, exit 0.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import hmac
import logging
import os
import signal
import socket
import threading
import time
import uuid
from collections.abc import AsyncIterator, Awaitable, Callable, Iterator
from typing import Any

import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response
from starlette.exceptions import HTTPException as StarletteHTTPException

import radixserve
from radixserve.entrypoints import web
from radixserve.entrypoints.http_utils import (
    ClientDisconnected,
    error_response,
    json_response,
    parse_model,
    read_json,
    sse_event,
    stream_as_sse,
    until_disconnected,
)
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.protocol import AbortRequest, GenerateRequest
from radixserve.entrypoints.openai.serving_base import GRAMMAR_FIELDS, structured_output_available
from radixserve.entrypoints.openai.serving_chat import OpenAIServingChat
from radixserve.entrypoints.openai.serving_completions import OpenAIServingCompletion
from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)

GRACEFUL_SHUTDOWN_S = 15  # after aborting in-flight requests, how long to wait for their responses to finish
HEALTH_GENERATE_TIMEOUT_S = 30.0
MAX_HEALTH_TIMEOUT_S = 60.0
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"


@dataclasses.dataclass
class ServerState:
    """Everything the routes share (stored on app.state.server)."""

    tm: TokenizerManager
    processes: Any  # EngineProcesses (alive(), shutdown())
    server_args: ServerArgs
    served_model_name: str
    completions: OpenAIServingCompletion
    chat: OpenAIServingChat
    metrics: Any = None
    grammar_ok: bool = False
    live_stats: Any = None  # the dashboard's recent figures (web.live_stats.LiveStats)
    start_time: float = dataclasses.field(default_factory=time.time)
    shutting_down: bool = False

    def abort_all(self, message: str) -> int:
        rids = list(self.tm.rid_to_state)
        for rid in rids:
            self.tm.abort_request(rid, message)
        return len(rids)


# ====================================================================== middleware
class AuthAndLogMiddleware:
    """Checks `Authorization: Bearer KEY` (all routes but /health) and, with --log-requests, logs each request."""

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
            logger.info("%s %s -> %s (%.1f ms)", scope["method"], scope["path"], status[0] if status else "-",
                        1000 * (time.perf_counter() - start))


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
    if metrics is not None:
        tm.metrics = metrics
    state.live_stats = web.attach_live_stats(tm)

    app = FastAPI(title="radixserve", version=radixserve.__version__, docs_url=None, redoc_url=None,
                  openapi_url=None)
    app.state.server = state
    _install_error_handlers(app)
    _add_native_routes(app, state)
    _add_openai_routes(app, state)
    app.include_router(web.stats_router)
    if not server_args.disable_web_ui:
        app.include_router(web.page_router)
    app.add_middleware(AuthAndLogMiddleware, api_key=server_args.api_key, log_requests=server_args.log_requests,
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


def _ensure_serving(state: ServerState) -> None:
    if state.shutting_down:
        raise APIError("the server is shutting down", 503, None, "shutting_down")
    if not state.processes.alive():
        raise APIError("the engine is not running (a scheduler or detokenizer process died); see the server log",
                       503, None, "engine_dead")


def _with_token_text(entries: list[Any] | None, tm: TokenizerManager) -> list[Any] | None:
    if entries is None or tm.tokenizer is None:
        return entries

    def text(tid: int) -> str:
        return tm.tokenizer.decode([tid], skip_special_tokens=False)

    out: list[Any] = []
    for e in entries:
        if e is None:
            out.append(None)
        elif e and isinstance(e[0], list | tuple):  # a top-k list
            out.append([[lp, tid, text(int(tid))] for lp, tid in e])
        else:
            out.append([e[0], e[1], text(int(e[1]))])
    return out


def _native_output(out: dict[str, Any], with_text: bool, tm: TokenizerManager) -> dict[str, Any]:
    if with_text:
        meta = out["meta_info"]
        for key in ("output_token_logprobs", "input_token_logprobs", "output_top_logprobs", "input_top_logprobs"):
            if key in meta:
                meta[key] = _with_token_text(meta[key], tm)
    return out


def _add_native_routes(app: FastAPI, state: ServerState) -> None:
    tm = state.tm
    args = state.server_args

    @app.get("/health")
    async def health() -> Response:
        if not state.processes.alive():
            raise APIError("a scheduler or detokenizer process has died", 503, None, "engine_dead")
        timeout = min(args.watchdog_timeout, MAX_HEALTH_TIMEOUT_S)
        try:
            info = await tm.get_internal_state(timeout=timeout)
        except TimeoutError:
            raise APIError(f"the scheduler did not answer within {timeout:g} s (stuck?)", 503, None,
                           "engine_stuck") from None
        busy = not info.get("idle", True)
        last = info.get("last_step_time")
        if busy and last is not None and time.monotonic() - last > args.watchdog_timeout:
            raise APIError(f"the scheduler has work but made no step for {time.monotonic() - last:.0f} s", 503,
                           None, "engine_stuck")
        if state.shutting_down:
            raise APIError("the server is shutting down", 503, None, "shutting_down")
        return json_response({"status": "ok"})

    @app.get("/health_generate")
    async def health_generate() -> Response:
        _ensure_serving(state)
        ids = tm.tokenize("Hi") if tm.tokenizer is not None else [0]
        obj = io.GenerateReqInput(input_ids=ids or [0], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                                  rid=f"health-{uuid.uuid4().hex}")

        async def run() -> list[dict[str, Any]]:
            return [o async for o in tm.generate_request(obj)]

        try:
            outs = await asyncio.wait_for(run(), HEALTH_GENERATE_TIMEOUT_S)
        except TimeoutError:
            raise APIError(f"a 1-token generation did not finish within {HEALTH_GENERATE_TIMEOUT_S:g} s", 503, None,
                           "engine_stuck") from None
        except RequestError as e:
            raise APIError(f"a 1-token generation failed: {e}", 503, None, "engine_error") from None
        return json_response({"status": "ok", "output_ids": outs[0]["output_ids"] if outs else []})

    @app.get("/get_model_info")
    async def get_model_info() -> Response:
        mc = getattr(tm, "model_config", None)
        return json_response({
            "model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
            "served_model_name": state.served_model_name, "is_generation": True,
            "context_length": tm.context_len, "vocab_size": tm.vocab_size,
            "architectures": list(getattr(mc, "architectures", []) or []),
            "chat_template": bool(tm.tokenizer is not None and getattr(tm.tokenizer, "chat_template", None)),
        })

    @app.get("/get_server_info")
    async def get_server_info() -> Response:
        sargs = dataclasses.asdict(args)
        if sargs.get("api_key"):
            sargs["api_key"] = "***"
        sched = dataclasses.asdict(tm.scheduler_info) if dataclasses.is_dataclass(tm.scheduler_info) else {}
        return json_response({**sargs, "scheduler_info": sched, "version": radixserve.__version__,
                              "structured_output": state.grammar_ok, "start_time": state.start_time})

    @app.get("/get_internal_state")
    async def get_internal_state() -> Response:
        _ensure_alive(state)
        info = await tm.get_internal_state(timeout=min(args.watchdog_timeout, MAX_HEALTH_TIMEOUT_S))
        return json_response({**info, "num_inflight_requests": len(tm.rid_to_state)})

    @app.api_route("/flush_cache", methods=["GET", "POST"])
    async def flush_cache() -> Response:
        _ensure_alive(state)
        if await tm.flush_cache():
            return json_response({"success": True, "message": "the prefix cache was flushed"})
        raise APIError("the cache was not flushed: requests are running or waiting; retry when the server is idle",
                       400, None, "server_busy")

    @app.post("/abort_request")
    async def abort_request(request: Request) -> Response:
        req = parse_model(AbortRequest, await read_json(request))
        if req.abort_all:
            n = state.abort_all("aborted by /abort_request")
            return json_response({"success": True, "aborted": n})
        if not req.rid:
            raise APIError("rid: required (or set abort_all to true)", 400, "rid", "missing_required_parameter")
        rids = [r for r in tm.rid_to_state if r == req.rid or r.startswith(req.rid + "-")] or [req.rid]
        for rid in rids:
            tm.abort_request(rid, "aborted by /abort_request")
        return json_response({"success": True, "aborted": len(rids)})

    @app.get("/version")
    async def version() -> Response:
        return json_response({"version": radixserve.__version__})

    @app.get("/metrics")
    async def metrics() -> Response:
        if state.metrics is None:
            raise APIError("metrics are disabled: start the server with --enable-metrics", 404, None,
                           "metrics_disabled")
        if state.processes.alive():
            with contextlib.suppress(Exception):
                info = await tm.get_internal_state(timeout=5.0)
                state.metrics.update_scheduler_state(info, num_inflight=len(tm.rid_to_state))
        return Response(state.metrics.render(), media_type=state.metrics.content_type)

    @app.post("/generate")
    async def generate(request: Request) -> Response:
        body = await read_json(request)
        _ensure_serving(state)
        g = parse_model(GenerateRequest, body)
        if (g.text is None) == (g.input_ids is None):
            raise APIError("give exactly one of text and input_ids", 400, "text", "invalid_value")
        batch = isinstance(g.text, list) or (bool(g.input_ids) and isinstance(g.input_ids[0], list))
        if batch and isinstance(g.rid, str):
            raise APIError("rid: a batched request needs a list of rids (one per prompt)", 400, "rid",
                           "invalid_value")
        for rid in [g.rid] if isinstance(g.rid, str) else (g.rid or []):
            if rid in tm.rid_to_state:
                raise APIError(f"rid: {rid!r} is already in use by a running request", 400, "rid", "invalid_value")
        sps = g.sampling_params if isinstance(g.sampling_params, list) else [g.sampling_params or {}]
        if not state.grammar_ok:
            for sp in sps:
                for key in GRAMMAR_FIELDS:
                    if sp.get(key) is not None:
                        raise APIError(f"sampling_params.{key}: structured output is not available on this server "
                                       "(no grammar backend)", 400, f"sampling_params.{key}",
                                       "unsupported_parameter")
        obj = io.GenerateReqInput(text=g.text, input_ids=g.input_ids, sampling_params=g.sampling_params, rid=g.rid,
                                  stream=g.stream, return_logprob=g.return_logprob,
                                  logprob_start_len=g.logprob_start_len, top_logprobs_num=g.top_logprobs_num)
        with_text = g.return_text_in_logprobs
        if g.stream:
            return await _native_stream(request, obj, with_text, tm)

        async def run() -> list[dict[str, Any]]:
            return [o async for o in tm.generate_request(obj)]

        try:
            outs = await until_disconnected(request, run())
        except RequestError as e:
            raise from_request_error(e) from None
        outs = [_native_output(o, with_text, tm) for o in outs]
        if len(outs) == 1 and "index" not in outs[0] and not batch:
            return json_response(outs[0])
        outs.sort(key=lambda o: o.get("index", 0))
        return json_response(outs)


def _ensure_alive(state: ServerState) -> None:
    if not state.processes.alive():
        raise APIError("the engine is not running (a scheduler or detokenizer process died)", 503, None,
                       "engine_dead")


async def _native_stream(request: Request, obj: io.GenerateReqInput, with_text: bool,
                         tm: TokenizerManager) -> Response:
    async def render(outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
        async for out in outputs:
            yield sse_event(_native_output(out, with_text, tm))

    return await stream_as_sse(request, tm, obj, render, from_request_error)


def _add_openai_routes(app: FastAPI, state: ServerState) -> None:
    def model_card() -> dict[str, Any]:
        return {"id": state.served_model_name, "object": "model", "created": int(state.start_time),
                "owned_by": "radixserve", "root": state.server_args.model_path,
                "max_model_len": state.tm.context_len}

    @app.get("/v1/models")
    async def list_models() -> Response:
        return json_response({"object": "list", "data": [model_card()]})

    @app.get("/v1/models/{model:path}")
    async def get_model(model: str) -> Response:
        state.completions.check_model(model)
        return json_response(model_card())

    async def run_openai(request: Request, handler: Callable[[Request, dict[str, Any]], Awaitable[Response]]
                         ) -> Response:
        body = await read_json(request)
        _ensure_serving(state)
        return await handler(request, body)

    @app.post("/v1/completions")
    async def completions(request: Request) -> Response:
        return await run_openai(request, state.completions.create)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request) -> Response:
        return await run_openai(request, state.chat.create)


# ====================================================================== launching
class _Server(uvicorn.Server):
    """uvicorn with our signal handling: the first SIGTERM/SIGINT starts a graceful shutdown (in-flight requests
    are aborted so their responses end promptly), a second SIGINT forces it; the signal is not re-raised, so the
    process exits 0."""

    def __init__(self, config: uvicorn.Config, state: ServerState) -> None:
        super().__init__(config)
        self.state = state
        self.loop: asyncio.AbstractEventLoop | None = None
        self.ready_line = ""

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
        first = not self.should_exit
        if self.should_exit and sig == signal.SIGINT:
            self.force_exit = True
        self.should_exit = True
        if first:
            logger.info("received %s: shutting down (aborting %d in-flight request(s))", signal.Signals(sig).name,
                        len(self.state.tm.rid_to_state))
            if self.loop is not None:
                self.loop.call_soon_threadsafe(self._begin_shutdown)

    def _begin_shutdown(self) -> None:
        self.state.shutting_down = True
        self.state.abort_all("the server is shutting down")

    async def startup(self, sockets: list[socket.socket] | None = None) -> None:
        self.loop = asyncio.get_running_loop()
        await super().startup(sockets=sockets)
        if self.started and not self.should_exit:
            logger.info("%s", self.ready_line)


def _check_port_free(host: str, port: int) -> None:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as e:
            raise RuntimeError(f"cannot listen on {host}:{port}: {e.strerror or e}") from None


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


def launch_server(server_args: ServerArgs) -> None:
    """Start the engine processes and serve HTTP until SIGTERM/SIGINT; returns after a clean shutdown."""
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
                                access_log=False, timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_S, lifespan="off",
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
