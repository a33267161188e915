"""LoRA adapters at run time: POST /load_lora_adapter {lora_name, lora_path} and POST /unload_lora_adapter
{lora_name} (SGLang's routes). Unloading waits for the adapter's running requests; new ones are refused at once."""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import Response

from radixserve.entrypoints.http_utils import json_response, parse_model, read_json
from radixserve.entrypoints.openai.errors import APIError, from_request_error
from radixserve.entrypoints.openai.protocol import LoadLoRAAdapterRequest, UnloadLoRAAdapterRequest
from radixserve.entrypoints.server_state import server_state
from radixserve.managers.tokenizer_manager import RequestError

router = APIRouter()


@router.post("/load_lora_adapter")
async def load_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    req = parse_model(LoadLoRAAdapterRequest, await read_json(request))
    state.ensure_alive()
    if req.lora_name in state.completions.accepted_models:  # `model` with that name selects the base model
        raise APIError(f"lora_name {req.lora_name!r} names the served model (its name or an alias); choose another",
                       400, "lora_name", "invalid_value")
    try:
        message = await state.tm.load_lora_adapter(req.lora_name, req.lora_path)
    except RequestError as e:
        raise from_request_error(e) from None
    return json_response({"success": True, "message": message, "loaded_adapters": sorted(state.tm.lora_names)})


@router.post("/unload_lora_adapter")
async def unload_lora_adapter(request: Request) -> Response:
    state = server_state(request)
    req = parse_model(UnloadLoRAAdapterRequest, await read_json(request))
    state.ensure_alive()
    try:
        message = await state.tm.unload_lora_adapter(req.lora_name)
    except RequestError as e:
        raise from_request_error(e) from None
    return json_response({"success": True, "message": message, "loaded_adapters": sorted(state.tm.lora_names)})
