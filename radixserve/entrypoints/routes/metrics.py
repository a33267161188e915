"""GET /metrics: Prometheus text (with --enable-metrics), including whether the engine's processes are alive."""

from __future__ import annotations

import contextlib

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.server_state import server_state

router = APIRouter()


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    state = server_state(request)
    if state.metrics is None:
        raise APIError("metrics are disabled: start the server with --enable-metrics", 404, None,
                       "metrics_disabled")
    alive = state.engine_dead_message() is None
    state.metrics.set_engine_alive(alive)
    if alive:
        with contextlib.suppress(Exception):
            info = await state.tm.get_internal_state(timeout=5.0)
            state.metrics.update_scheduler_state(info, num_inflight=len(state.tm.rid_to_state))
    return Response(state.metrics.render(), media_type=state.metrics.content_type)
