"""What the server is: GET /get_model_info, /get_server_info (our keys and SGLang's), /get_internal_state,
/version."""

from __future__ import annotations

import contextlib
import dataclasses
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

import radixserve
from radixserve.entrypoints.http_utils import json_response
from radixserve.entrypoints.server_state import ServerState, server_state

router = APIRouter()


@router.get("/get_model_info")
async def get_model_info(request: Request) -> Response:
    state = server_state(request)
    tm, args = state.tm, state.server_args
    mc = getattr(tm, "model_config", None)
    return json_response({
        "model_path": args.model_path, "tokenizer_path": args.tokenizer_path,
        "served_model_name": state.served_model_name, "is_generation": not state.server_args.is_embedding,
        "context_length": tm.context_len, "vocab_size": tm.vocab_size,
        "architectures": list(getattr(mc, "architectures", []) or []),
        "chat_template": bool(tm.tokenizer is not None and getattr(tm.tokenizer, "chat_template", None)),
    })


async def _internal_states(state: ServerState) -> list[dict[str, Any]]:
    """SGLang's `internal_states`: one dict per scheduler (clients such as SGLang's bench_serving read
    `internal_states[0]["avg_spec_accept_length"]` and `["last_gen_throughput"]`)."""
    sched: dict[str, Any] = {}
    if state.engine_dead_message() is None:
        with contextlib.suppress(Exception):
            sched = await state.tm.get_internal_state(timeout=min(2.0, state.control_timeout))
    return [{"avg_spec_accept_length": None, **sched, "last_gen_throughput": state.tm.gen_throughput()}]


@router.get("/get_server_info")
async def get_server_info(request: Request) -> Response:
    state = server_state(request)
    tm = state.tm
    sargs = dataclasses.asdict(state.server_args)
    if sargs.get("api_key"):
        sargs["api_key"] = "***"
    sched = dataclasses.asdict(tm.scheduler_info) if dataclasses.is_dataclass(tm.scheduler_info) else {}
    dead = state.engine_dead_message()
    return json_response({**sargs, "scheduler_info": sched, "version": radixserve.__version__,
                          "structured_output": state.grammar_ok, "start_time": state.start_time,
                          "sampling_defaults_from_model": tm.sampling_defaults,
                          "engine_alive": dead is None, "engine_error": dead, "draining": state.draining,
                          "internal_states": await _internal_states(state)})


@router.get("/get_internal_state")
async def get_internal_state(request: Request) -> Response:
    state = server_state(request)
    state.ensure_alive()
    info = await state.tm.get_internal_state(timeout=state.control_timeout)
    return json_response({**info, "num_inflight_requests": len(state.tm.rid_to_state)})


@router.get("/version")
async def version() -> Response:
    return json_response({"version": radixserve.__version__})
