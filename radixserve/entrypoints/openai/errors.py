"""Errors in OpenAI's shape: `{"error": {"message", "type", "param", "code"}}` with the HTTP status that fits.

Every failure the HTTP server reports goes through `APIError` (or the engine's `RequestError`, converted by
`from_request_error`), so clients see one shape whatever the endpoint."""

from __future__ import annotations

from typing import Any

from pydantic import ValidationError

# Known OpenAI request fields that radixserve does not implement: named in the error so users know it is deliberate.
UNSUPPORTED_OPENAI_FIELDS = frozenset({
    "tools", "tool_choice", "parallel_tool_calls", "functions", "function_call", "audio", "modalities",
    "prediction", "store", "metadata", "service_tier", "reasoning_effort", "web_search_options", "suffix",
})

_TYPES = {400: "invalid_request_error", 401: "authentication_error", 403: "permission_error",
          404: "not_found_error", 405: "invalid_request_error", 409: "invalid_request_error",
          413: "invalid_request_error", 422: "invalid_request_error", 429: "rate_limit_error",
          503: "overloaded_error"}


def error_type(status_code: int) -> str:
    if status_code in _TYPES:
        return _TYPES[status_code]
    return "server_error" if status_code >= 500 else "invalid_request_error"


class APIError(Exception):
    """A request that fails with `status_code`; `param` names the offending field (OpenAI style)."""

    def __init__(self, message: str, status_code: int = 400, param: str | None = None, code: str | None = None,
                 type_: str | None = None) -> None:
        super().__init__(message)
        self.message = message
        self.status_code = status_code
        self.param = param
        self.code = code
        self.type = type_ or error_type(status_code)

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.type, "param": self.param, "code": self.code}}


def loc_to_param(loc: tuple[Any, ...]) -> str:
    """('messages', 0, 'content') -> 'messages[0].content'; union-branch labels pydantic inserts are dropped."""
    out = ""
    for part in loc:
        if isinstance(part, int):
            out += f"[{part}]"
            continue
        text = str(part)
        # pydantic names union members ('str', 'list[int]', 'function-after[...]'); they are not user fields
        if "[" in text or text in ("str", "int", "float", "bool", "dict", "list", "none", "is-instance"):
            continue
        out += ("." if out else "") + text
    return out


def _short(value: Any, limit: int = 80) -> str:
    text = repr(value)
    return text if len(text) <= limit else text[: limit - 3] + "..."


def from_validation_error(err: ValidationError) -> APIError:
    """A pydantic error as a 400: unknown fields are all named; otherwise the first problem, with its field."""
    errors = err.errors()
    extra = [loc_to_param(e["loc"]) for e in errors if e["type"] == "extra_forbidden"]
    if extra:
        names = sorted(set(extra))
        known = [n for n in names if n.rsplit(".", 1)[-1] in UNSUPPORTED_OPENAI_FIELDS]
        what = "unsupported parameter(s)" if known else "unknown parameter(s)"
        return APIError(f"{what}: {', '.join(names)}", 400, names[0], "unsupported_parameter" if known
                        else "unknown_parameter")
    missing = [loc_to_param(e["loc"]) for e in errors if e["type"] == "missing"]
    if missing:
        return APIError(f"missing required parameter(s): {', '.join(missing)}", 400, missing[0],
                        "missing_required_parameter")
    first = errors[0]
    param = loc_to_param(first["loc"]) or None
    msg = first["msg"]
    if "input" in first and first["loc"] and first["type"] not in ("model_type", "model_attributes_type"):
        msg = f"{msg}, got {_short(first['input'])}"
    return APIError(f"{param}: {msg}" if param else msg, 400, param, "invalid_value")


# Engine-side names of sampling fields -> the OpenAI names users wrote.
_OPENAI_NAMES = {"max_new_tokens": "max_tokens", "min_new_tokens": "min_tokens"}


def from_request_error(err: Exception, *, prompt_param: str | None = None, openai: bool = False) -> APIError:
    """The engine's RequestError (message, status_code, param) as an APIError."""
    status = int(getattr(err, "status_code", 400) or 400)
    param = getattr(err, "param", None)
    message = str(err)
    if param == "sampling_params":
        from radixserve.sampling.sampling_params import SamplingParams

        first = message.split(" ", 1)[0].split("[", 1)[0].rstrip(":")
        if first in SamplingParams.field_names():
            param = first
            if openai and first in _OPENAI_NAMES:
                param = _OPENAI_NAMES[first]
                message = _OPENAI_NAMES[first] + message[len(first):]
    if prompt_param is not None and param in ("text", "input_ids"):
        param = prompt_param
    code = getattr(err, "code", None)
    if code == "engine_dead":
        return APIError(message, status, param, code, "server_error")
    code = code or ("overloaded" if status == 503 else ("invalid_value" if status == 400 else None))
    return APIError(message, status, param, code)
