"""Request fields of features this server does not implement (yet), checked in one place.

Clients send these fields with null or default values (the `openai` SDK's own response message appended to the
history, SGLang's benchmark client, LangChain, ...): those are accepted and change nothing. Any other value is a
400 that names the field -- never silently ignored. When a feature lands, its gate here is replaced by the real
handling:

- tool calling is served (chat_tools); the deprecated `functions` / `function_call` stay gated in
  `check_tool_fields`;
- reasoning: `reasoning_effort` in `check_tool_fields` (the thinking itself is split by --reasoning-parser);
- the rest (`store`, `service_tier`, `modalities`, `audio`, `prediction`, `web_search_options`, `verbosity`,
  `prompt_cache_retention`, `prompt_cache_options`, `moderation`, `suffix`, SGLang's `custom_logit_processor` and
  `return_hidden_states`) have no planned feature.
"""

from __future__ import annotations

from typing import Any

from radixserve.entrypoints.openai.errors import APIError


def _unsupported(param: str, what: str) -> APIError:
    return APIError(f"{param}: {what}", 400, param, "unsupported_parameter")


# ---------------------------------------------------------------------------------------------- tool calling
def check_tool_fields(req: Any) -> None:
    """The deprecated functions / function_call and reasoning_effort on a chat request (tools, tool_choice and
    parallel_tool_calls are served: see chat_tools)."""
    if req.functions is not None:
        raise _unsupported("functions", "the deprecated functions field is not supported; send tools instead")
    if req.function_call is not None and req.function_call != "none":
        raise _unsupported("function_call", f"only 'none' (or null) is accepted (use tool_choice), got "
                                            f"{req.function_call!r}")
    if req.reasoning_effort is not None:
        raise _unsupported("reasoning_effort", "reasoning effort is not supported by this server; send null")


def check_message(msg: Any, i: int) -> None:
    """Fields of one chat history message beyond role/content/name/tool_calls/tool_call_id (chat_tools checks
    those)."""
    where = f"messages[{i}]"
    if msg.function_call is not None:
        raise _unsupported(f"{where}.function_call", "function calls in the history are not supported")
    if msg.refusal is not None:
        raise _unsupported(f"{where}.refusal", "only null is accepted (put the text in content)")
    if msg.audio is not None:
        raise _unsupported(f"{where}.audio", "audio is not supported by this server; send null")
    if msg.annotations:  # null or []
        raise _unsupported(f"{where}.annotations", "only null or [] is accepted")


# ---------------------------------------------------------------------------------------------- no feature
def check_noop_fields(req: Any) -> None:
    """Fields whose null/default value changes nothing: store, service_tier, modalities, audio, prediction,
    web_search_options, verbosity, prompt_cache_retention / _options, moderation (chat); suffix (completions)."""
    if getattr(req, "suffix", None) is not None:
        raise _unsupported("suffix", "insertion (a suffix) is not supported by this server; send null")
    if getattr(req, "store", None):
        raise _unsupported("store", "this server does not store completions; send false or null")
    tier = getattr(req, "service_tier", None)
    if tier is not None and tier not in ("auto", "default"):
        raise _unsupported("service_tier", f"only 'auto' or 'default' is accepted, got {tier!r}")
    modalities = getattr(req, "modalities", None)
    if modalities is not None and modalities != ["text"]:
        raise _unsupported("modalities", f"only ['text'] is accepted, got {modalities!r}")
    verbosity = getattr(req, "verbosity", None)
    if verbosity is not None and verbosity != "medium":
        raise _unsupported("verbosity", f"only 'medium' (the default) is accepted, got {verbosity!r}")
    retention = getattr(req, "prompt_cache_retention", None)
    if retention is not None and retention != "in_memory":
        raise _unsupported("prompt_cache_retention", "the radix cache keeps prefixes in memory while it has room; "
                                                     f"only 'in_memory' is accepted, got {retention!r}")
    for name in ("audio", "prediction", "web_search_options", "prompt_cache_options", "moderation"):
        if getattr(req, name, None) is not None:
            raise _unsupported(name, "not supported by this server; send null")


def check_native_fields(req: Any) -> None:
    """POST /generate: SGLang's fields for features we do not have."""
    values = req.custom_logit_processor if isinstance(req.custom_logit_processor, list) else \
        [req.custom_logit_processor]
    if any(v is not None for v in values):
        raise _unsupported("custom_logit_processor", "custom logit processors are not supported by this server")
    if req.return_hidden_states:
        raise _unsupported("return_hidden_states", "hidden states are not returned by this server")


def check_openai_request(req: Any) -> None:
    """Everything above that applies to an OpenAI request (completions or chat)."""
    check_noop_fields(req)
    if hasattr(req, "tools"):
        check_tool_fields(req)
    for i, msg in enumerate(getattr(req, "messages", None) or []):
        check_message(msg, i)
