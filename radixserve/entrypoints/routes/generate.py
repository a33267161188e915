"""POST /generate: SGLang's native API (text or input_ids, sampling_params, streaming, logprobs)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import (
    json_response,
    parse_model,
    read_json,
    sse_event,
    stream_as_sse,
    until_disconnected,
)
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.feature_gates import check_native_fields
from radixserve.entrypoints.openai.protocol import GenerateRequest
from radixserve.entrypoints.openai.serving_base import GRAMMAR_FIELDS
from radixserve.entrypoints.server_state import server_state
from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import RequestError, TokenizerManager

router = APIRouter()


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


@router.post("/generate")
async def generate(request: Request) -> Response:
    state = server_state(request)
    tm = state.tm
    body = await read_json(request)
    state.ensure_generation()
    state.ensure_serving()
    g = parse_model(GenerateRequest, body)
    check_native_fields(g)
    if (g.text is None) == (g.input_ids is None):
        raise APIError("give exactly one of text and input_ids", 400, "text", "invalid_value")
    batch = isinstance(g.text, list) or (bool(g.input_ids) and isinstance(g.input_ids[0], list))
    if batch and isinstance(g.rid, str):
        raise APIError("rid: a batched request needs a list of rids (one per prompt)", 400, "rid", "invalid_value")
    for rid in [g.rid] if isinstance(g.rid, str) else (g.rid or []):
        if rid in tm.rid_to_state:
            raise APIError(f"rid: {rid!r} is already in use by a running request", 400, "rid", "invalid_value")
    sps = g.sampling_params if isinstance(g.sampling_params, list) else [g.sampling_params or {}]
    if not state.grammar_ok:
        for sp in sps:
            for key in GRAMMAR_FIELDS:
                if sp.get(key) is not None:
                    raise APIError(f"sampling_params.{key}: structured output is not available on this server "
                                   "(no grammar backend)", 400, f"sampling_params.{key}", "unsupported_parameter")
    obj = io.GenerateReqInput(text=g.text, input_ids=g.input_ids, sampling_params=g.sampling_params, rid=g.rid,
                              stream=g.stream, return_logprob=g.return_logprob,
                              logprob_start_len=g.logprob_start_len, top_logprobs_num=g.top_logprobs_num,
                              lora_path=g.lora_path)
    with_text = g.return_text_in_logprobs
    if g.stream:
        async def render(outputs: AsyncIterator[dict[str, Any]]) -> AsyncIterator[bytes]:
            async for out in outputs:
                yield sse_event(_native_output(out, with_text, tm))

        return await stream_as_sse(request, tm, obj, render, from_request_error)

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
