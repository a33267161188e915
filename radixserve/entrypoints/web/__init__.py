"""The built-in web page: GET / (a chat playground and a live dashboard), its static files under /static/, and the
dashboard's figures on GET /stats. The files ship inside the package (no CDN: the page works offline).

The page and its static files are public (a browser cannot send the API key on navigation); the page asks for the
key and sends it with every API call, so with --api-key nothing is served to a client without the key except
these files. --disable-web-ui leaves the routes out (404)."""

from __future__ import annotations

import asyncio
import contextlib
import os
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import FileResponse, Response

from radixserve.entrypoints.http_utils import json_response
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.web.live_stats import LiveStats, MetricsFanout, scheduler_figures

STATIC_DIR = os.path.join(os.path.dirname(__file__), "static")
_TYPES = {".html": "text/html; charset=utf-8", ".js": "text/javascript; charset=utf-8",
          ".css": "text/css; charset=utf-8", ".png": "image/png", ".svg": "image/svg+xml"}
PUBLIC_PATHS = ("/", "/favicon.ico")
PUBLIC_PREFIX = "/static/"
STATS_TIMEOUT_S = 5.0

page_router = APIRouter()  # the page and its files (left out with --disable-web-ui)
stats_router = APIRouter()


def is_public(path: str) -> bool:
    """Routes of the page that need no API key (static files only)."""
    return path in PUBLIC_PATHS or path.startswith(PUBLIC_PREFIX)


def attach_live_stats(tm: Any) -> LiveStats:
    """Have the TokenizerManager report to a new LiveStats (next to the Prometheus collector, if any)."""
    stats = LiveStats()
    tm.metrics = MetricsFanout(tm.metrics, stats)
    return stats


def _static(name: str) -> Response:
    path = os.path.join(STATIC_DIR, name)
    if os.sep in name or name.startswith(".") or not os.path.isfile(path):
        raise APIError(f"Invalid URL (GET /static/{name}): no such file", 404)
    return FileResponse(path, media_type=_TYPES.get(os.path.splitext(name)[1], "application/octet-stream"),
                        headers={"Cache-Control": "no-cache"})


@page_router.get("/")
async def index() -> Response:
    return _static("index.html")


@page_router.get("/favicon.ico")
async def favicon() -> Response:
    return Response(status_code=204)


@page_router.get("/static/{name}")
async def static(name: str) -> Response:
    return _static(name)


@stats_router.get("/stats")
async def stats(request: Request) -> Response:
    """The dashboard's figures: the scheduler's queues and KV pool, and recent throughput and latencies."""
    server = request.app.state.server
    live: LiveStats | None = getattr(server, "live_stats", None)
    out: dict[str, Any] = {"model": server.served_model_name, "num_inflight_reqs": len(server.tm.rid_to_state),
                           "engine_alive": bool(server.processes.alive())}
    info: dict[str, Any] = {}
    if out["engine_alive"]:
        with contextlib.suppress(TimeoutError, asyncio.TimeoutError):
            info = await server.tm.get_internal_state(timeout=STATS_TIMEOUT_S)
    out.update(scheduler_figures(info))
    out.update(live.snapshot() if live is not None else LiveStats().snapshot())
    return json_response(out)
