"""The OpenAI-compatible API: GET /v1/models[/{model}], POST /v1/completions, POST /v1/chat/completions, POST
/v1/responses (serving_responses.py, on the chat path) with its stored responses (GET and DELETE
/v1/responses/{response_id}, GET /v1/responses/{response_id}/input_items), and on a
--is-embedding server POST /v1/embeddings (with the native POST /encode); on a cross-encoder's server POST
/v1/rerank and POST /v1/score (serving_score.py; also as vLLM's /rerank and /score)."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response, read_json
from radixserve.entrypoints.openai.serving_score import score_service
from radixserve.entrypoints.server_state import ServerState, server_state

router = APIRouter()


def _model_card(state: ServerState, adapter: str | None = None) -> dict[str, Any]:
    card = {"id": state.served_model_name, "object": "model", "created": int(state.start_time),
            "owned_by": "radixserve", "root": state.server_args.model_path, "max_model_len": state.tm.context_len}
    if adapter is not None:  # a LoRA adapter: its own id, the base model as parent
        card.update(id=adapter, root=adapter, parent=state.served_model_name)
    return card


@router.get("/v1/models")
async def list_models(request: Request) -> Response:
    state = server_state(request)
    adapters = sorted(state.tm.lora_names or ())
    return json_response({"object": "list", "data": [_model_card(state)] + [_model_card(state, a) for a in adapters]})


@router.get("/v1/models/{model:path}")
async def get_model(request: Request, model: str) -> Response:
    state = server_state(request)
    return json_response(_model_card(state, state.completions.resolve_lora(model, None)))


@router.post("/v1/completions")
async def completions(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request)
    state.ensure_generation()
    state.ensure_serving()
    return await state.completions.create(request, body)


@router.post("/v1/chat/completions")
async def chat_completions(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request)
    state.ensure_generation()
    state.ensure_serving()
    return await state.chat.create(request, body)


@router.post("/v1/responses")
async def responses(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request)
    state.ensure_generation()
    state.ensure_serving()
    return await state.responses.create(request, body)


@router.get("/v1/responses/{response_id}")
async def get_response(request: Request, response_id: str) -> Response:
    state = server_state(request)
    state.ensure_generation()
    return state.responses.retrieve(response_id, request.query_params)


@router.delete("/v1/responses/{response_id}")
async def delete_response(request: Request, response_id: str) -> Response:
    state = server_state(request)
    state.ensure_generation()
    return state.responses.delete(response_id)


@router.get("/v1/responses/{response_id}/input_items")
async def response_input_items(request: Request, response_id: str) -> Response:
    state = server_state(request)
    state.ensure_generation()
    return state.responses.list_input_items(response_id, request.query_params)


@router.post("/v1/embeddings")
async def embeddings(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request)
    state.ensure_embedding()
    state.ensure_serving()
    return await state.embeddings.create(request, body)


@router.post("/encode")
async def encode(request: Request) -> Response:
    """SGLang's native embedding route."""
    state = server_state(request)
    body = await read_json(request)
    state.ensure_embedding()
    state.ensure_serving()
    return await state.embeddings.encode(request, body)


@router.post("/v1/rerank")
@router.post("/rerank")
async def rerank(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request)
    service = score_service(state)  # a 400 unless the model is a cross-encoder
    state.ensure_serving()
    return await service.rerank(request, body)


@router.post("/v1/score")
@router.post("/score")
async def score(request: Request) -> Response:
    state = server_state(request)
    body = await read_json(request)
    service = score_service(state)
    state.ensure_serving()
    return await service.score(request, body)
