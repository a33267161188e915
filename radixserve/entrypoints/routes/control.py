"""Operator controls: POST /flush_cache (drop the idle prefix cache) and POST /abort_request."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response, parse_model, read_json
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.openai.protocol import AbortRequest
from radixserve.entrypoints.server_state import server_state

router = APIRouter()


@router.api_route("/flush_cache", methods=["GET", "POST"])
async def flush_cache(request: Request) -> Response:
    state = server_state(request)
    state.ensure_alive()
    if await state.tm.flush_cache():
        return json_response({"success": True, "message": "the prefix cache was flushed"})
    raise APIError("the cache was not flushed: requests are running or waiting; retry when the server is idle",
                   400, None, "server_busy")


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = server_state(request)
    req = parse_model(AbortRequest, await read_json(request))
    if req.abort_all:
        n = state.abort_all("aborted by /abort_request")
        return json_response({"success": True, "aborted": n})
    if not req.rid:
        raise APIError("rid: required (or set abort_all to true)", 400, "rid", "missing_required_parameter")
    n = state.tm.abort_named(req.rid, "aborted by /abort_request")
    return json_response({"success": True, "aborted": n})
