"""Operator controls: POST /flush_cache (drop the idle prefix cache) and POST /abort_request."""

from __future__ import annotations

from collections.abc import Iterable

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


def _rids_to_abort(running: Iterable[str], rid: str) -> list[str]:
    """The running request under `rid` itself, else an n > 1 request's samples (`rid-0`, `rid-1`, ...; its shared
    prefill's `rid-0-prefill`). The exact rid first: another client's `rid-2` is not one of `rid`'s samples."""
    running = list(running)
    if rid in running:
        return [rid]
    return [r for r in running if r.startswith(rid + "-")] or [rid]


@router.post("/abort_request")
async def abort_request(request: Request) -> Response:
    state = server_state(request)
    req = parse_model(AbortRequest, await read_json(request))
    if req.abort_all:
        n = state.abort_all("aborted by /abort_request")
        return json_response({"success": True, "aborted": n})
    if not req.rid:
        raise APIError("rid: required (or set abort_all to true)", 400, "rid", "missing_required_parameter")
    tm = state.tm
    rids = _rids_to_abort(tm.rid_to_state, req.rid)
    for rid in rids:
        tm.abort_request(rid, "aborted by /abort_request")
    return json_response({"success": True, "aborted": len(rids)})
