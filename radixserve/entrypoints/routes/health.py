"""GET /health (is the engine alive and stepping?) and GET /health_generate (can it produce a token?)."""

from __future__ import annotations

import asyncio
import time
import uuid
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.server_state import server_state
from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import RequestError

HEALTH_GENERATE_TIMEOUT_S = 30.0

router = APIRouter()


@router.api_route("/health", methods=["GET", "HEAD"])  # HEAD: load balancers' probes
async def health(request: Request) -> Response:
    state = server_state(request)
    if state.draining:
        raise APIError("the server is shutting down", 503, None, "shutting_down")
    state.ensure_alive()
    args = state.server_args
    timeout = state.control_timeout
    try:
        info = await state.tm.get_internal_state(timeout=timeout)
    except TimeoutError:
        raise APIError(f"the scheduler did not answer within {timeout:g} s (stuck?)", 503, None,
                       "engine_stuck") from None
    busy = not info.get("idle", True)
    last = info.get("last_step_time")
    if busy and last is not None and time.monotonic() - last > args.watchdog_timeout:
        raise APIError(f"the scheduler has work but made no step for {time.monotonic() - last:.0f} s", 503,
                       None, "engine_stuck")
    return json_response({"status": "ok"})


@router.get("/health_generate")
async def health_generate(request: Request) -> Response:
    state = server_state(request)
    state.ensure_serving()
    tm = state.tm
    ids = (await tm.tokenize_async("Hi")) if tm.tokenizer is not None else [0]
    obj = io.GenerateReqInput(input_ids=ids or [0], sampling_params={"max_new_tokens": 1, "temperature": 0.0},
                              rid=f"health-{uuid.uuid4().hex}", log_metrics=False)

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
