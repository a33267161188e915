"""Pieces of the HTTP server that need no running engine: request models and their errors, the CLI."""

from __future__ import annotations

import subprocess
import sys

import pytest

from radixserve.entrypoints.http_utils import parse_model
from radixserve.entrypoints.openai.errors import APIError, from_request_error, loc_to_param
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, CompletionRequest, GenerateRequest
from radixserve.managers.tokenizer_manager import RequestError


def test_loc_to_param() -> None:
    assert loc_to_param(("messages", 0, "content")) == "messages[0].content"
    assert loc_to_param(("prompt", "list[int]", 3)) == "prompt[3]"
    assert loc_to_param(("messages", 1, "content", "str")) == "messages[1].content"


@pytest.mark.parametrize("body,needle,param", [
    ({"prompt": "x", "foo": 1, "bar": 2}, "unknown parameter(s): bar, foo", "bar"),
    ({"prompt": "x", "tools": []}, "unsupported parameter(s): tools", "tools"),  # completions: no tools
    ({"max_tokens": 1}, "missing required parameter(s): prompt", "prompt"),
    ({"prompt": "x", "n": "2"}, "n: Input should be a valid integer", "n"),
    ({"prompt": "x", "temperature": 2.5}, "temperature: Input should be less than or equal to 2", "temperature"),
    ({"prompt": "x", "stream": 1}, "stream: Input should be a valid boolean", "stream"),
    ({"prompt": "x", "n": 2, "best_of": 1}, "best_of (1) must be >= n (2)", None),
])
def test_completion_request_errors(body: dict, needle: str, param: str) -> None:
    with pytest.raises(APIError) as ei:
        parse_model(CompletionRequest, body)
    assert ei.value.status_code == 400 and needle in ei.value.message and ei.value.param == param
    assert set(ei.value.body()["error"]) == {"message", "type", "param", "code"}


def test_valid_requests_parse() -> None:
    c = parse_model(CompletionRequest, {"prompt": [[1, 2], [3]], "temperature": 0, "stop": ["a"], "top_k": 5})
    assert c.prompt == [[1, 2], [3]] and c.temperature == 0.0 and c.max_tokens == 16
    chat = parse_model(ChatCompletionRequest, {
        "messages": [{"role": "user", "content": [{"type": "text", "text": "hi"}]}],
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "object"}}},
        "stream": True, "stream_options": {"include_usage": True}})
    assert chat.response_format.json_schema.schema_ == {"type": "object"}
    g = parse_model(GenerateRequest, {"text": ["a", "b"], "sampling_params": {"max_new_tokens": 3}})
    assert g.text == ["a", "b"]


def test_request_error_mapping() -> None:
    e = from_request_error(RequestError("max_new_tokens must be an integer >= 0, got -1", 400, "sampling_params"),
                           openai=True)
    assert e.param == "max_tokens" and e.message.startswith("max_tokens must")
    e = from_request_error(RequestError("unknown sampling parameter(s): bogus", 400, "sampling_params"))
    assert e.param == "sampling_params"
    e = from_request_error(RequestError("the server is overloaded", 503))
    assert e.status_code == 503 and e.code == "overloaded" and e.type == "overloaded_error"
    e = from_request_error(RequestError("the prompt is empty", 400, "input_ids"), prompt_param="prompt")
    assert e.param == "prompt"


@pytest.mark.integration
def test_cli() -> None:
    from radixserve.entrypoints import cli
    from radixserve.launch_server import main as launch_main

    assert cli.main(["version"]) == 0
    assert cli.main([]) == 2
    assert cli.main(["bogus"]) == 2
    assert launch_main(["--port", "0"]) == 2  # validated before anything starts
    out = subprocess.run([sys.executable, "-m", "radixserve.entrypoints.cli", "serve", "--help"],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0 and "--api-key" in out.stdout and "--max-queued-requests" in out.stdout


# ====================================================================== fields real clients send
def _sdk_assistant_message() -> dict:
    """The `openai` SDK's response message, as `model_dump()` writes it when a client appends it to the history."""
    return {"role": "assistant", "content": "Hello!", "refusal": None, "annotations": None, "audio": None,
            "function_call": None, "tool_calls": None}


NOOP_CHAT_FIELDS = {"tools": None, "tool_choice": "none", "parallel_tool_calls": False, "functions": None,
                    "function_call": None, "store": False, "metadata": {"team": "a"}, "service_tier": "auto",
                    "reasoning_effort": None, "user": "user-1", "modalities": ["text"], "audio": None,
                    "prediction": None, "web_search_options": None, "lora_path": None, "n": None, "stream": None,
                    "safety_identifier": "s-1", "prompt_cache_key": "k", "prompt_cache_retention": "in_memory",
                    "prompt_cache_options": None, "verbosity": "medium", "moderation": None,
                    "separate_reasoning": None}


def test_null_and_default_fields_are_accepted() -> None:
    from radixserve.entrypoints.openai.feature_gates import check_openai_request

    body = {"messages": [{"role": "user", "content": "hi"}, _sdk_assistant_message(),
                         {"role": "user", "content": "and?"}], **NOOP_CHAT_FIELDS}
    check_openai_request(parse_model(ChatCompletionRequest, body))
    check_openai_request(parse_model(ChatCompletionRequest, {**body, "tool_choice": None}))
    check_openai_request(parse_model(CompletionRequest, {"prompt": "x", "user": "u", "suffix": None,
                                                         "lora_path": None}))
    # null is the default (as OpenAI reads it), for the fields that have one too
    chat = parse_model(ChatCompletionRequest, body)
    assert chat.n == 1 and chat.stream is False and chat.separate_reasoning is True
    comp = parse_model(CompletionRequest, {"prompt": "x", "n": None, "stream": None, "echo": None, "best_of": 1})
    assert comp.n == 1 and comp.stream is False and comp.echo is False


@pytest.mark.parametrize("field,value,param", [
    ("functions", [{"name": "f"}], "functions"),
    ("function_call", "auto", "function_call"),
    ("reasoning_effort", "high", "reasoning_effort"),
    ("store", True, "store"),
    ("service_tier", "flex", "service_tier"),
    ("modalities", ["text", "audio"], "modalities"),
    ("verbosity", "low", "verbosity"),
    ("prompt_cache_retention", "24h", "prompt_cache_retention"),
    ("prompt_cache_options", {"ttl": "1h"}, "prompt_cache_options"),
    ("moderation", {"model": "omni-moderation-latest"}, "moderation"),
])
def test_fields_we_cannot_honour_are_a_400(field: str, value: object, param: str) -> None:
    from radixserve.entrypoints.openai.feature_gates import check_openai_request

    req = parse_model(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}], field: value})
    with pytest.raises(APIError) as ei:
        check_openai_request(req)
    assert ei.value.status_code == 400 and ei.value.param == param and param in ei.value.message


@pytest.mark.parametrize("field,value", [("refusal", "no"), ("audio", {"id": "a"})])
def test_message_fields_we_cannot_honour_are_a_400(field: str, value: object) -> None:
    from radixserve.entrypoints.openai.feature_gates import check_openai_request

    msg = {**_sdk_assistant_message(), field: value}
    req = parse_model(ChatCompletionRequest, {"messages": [{"role": "user", "content": "hi"}, msg]})
    with pytest.raises(APIError) as ei:
        check_openai_request(req)
    assert ei.value.param == f"messages[1].{field}"


def test_sglang_generate_fields() -> None:
    from radixserve.entrypoints.openai.feature_gates import check_native_fields

    body = {"text": "hi", "sampling_params": {"max_new_tokens": 4}, "stream": True, "lora_path": None,
            "return_logprob": False, "logprob_start_len": -1}  # what SGLang's bench_serving posts
    check_native_fields(parse_model(GenerateRequest, body))
    check_native_fields(parse_model(GenerateRequest, {"input_ids": [[1], [2]], "lora_path": [None, None]}))
    nulls = parse_model(GenerateRequest, {"text": "hi", "stream": None, "return_logprob": None,
                                          "logprob_start_len": None, "top_logprobs_num": None})
    assert (nulls.stream, nulls.return_logprob, nulls.logprob_start_len, nulls.top_logprobs_num) == (False, False,
                                                                                                    -1, 0)
    for extra in ({"custom_logit_processor": "x"}, {"return_hidden_states": True}):
        with pytest.raises(APIError) as ei:
            check_native_fields(parse_model(GenerateRequest, {**body, **extra}))
        assert ei.value.status_code == 400 and ei.value.param == next(iter(extra))


def test_json_schema_name_is_checked() -> None:
    ok = {"messages": [{"role": "user", "content": "hi"}],
          "response_format": {"type": "json_schema", "json_schema": {"name": "Person_1", "strict": True,
                                                                     "schema": {"type": "object"}}}}
    parse_model(ChatCompletionRequest, ok)
    bad = {**ok, "response_format": {"type": "json_schema", "json_schema": {"name": "a person!",
                                                                            "schema": {"type": "object"}}}}
    with pytest.raises(APIError) as ei:
        parse_model(ChatCompletionRequest, bad)
    assert ei.value.param == "response_format.json_schema.name"


def test_stop_strings_without_a_tokenizer_are_a_400() -> None:
    """With --skip-tokenizer-init nothing can match stop strings: a 400 naming `stop` (they were ignored)."""
    from radixserve.managers.tokenizer_manager import TokenizerManager
    from radixserve.server_args import ServerArgs

    tm = object.__new__(TokenizerManager)
    tm.tokenizer, tm.vocab_size, tm.server_args = None, 100, ServerArgs(skip_tokenizer_init=True)
    assert tm.make_sampling_params({"stop_token_ids": [5], "stop": []}).stop_token_ids == [5]
    for stop in ("x", ["a", "b"]):
        with pytest.raises(RequestError, match="--skip-tokenizer-init") as ei:
            tm.make_sampling_params({"stop": stop})
        err = from_request_error(ei.value, openai=True)
        assert err.status_code == 400 and err.param == "stop"


def test_sampling_defaults_from_generation_config(tmp_path) -> None:
    import json

    from radixserve.managers.tokenizer_manager import TokenizerManager
    from radixserve.sampling.model_defaults import load_sampling_defaults
    from radixserve.server_args import ServerArgs

    (tmp_path / "generation_config.json").write_text(json.dumps(
        {"bos_token_id": 1, "do_sample": True, "temperature": 0.3, "top_p": 0.8, "top_k": 20}))
    defaults = load_sampling_defaults(str(tmp_path))
    assert defaults == {"temperature": 0.3, "top_p": 0.8, "top_k": 20}
    tm = object.__new__(TokenizerManager)
    tm.tokenizer, tm.vocab_size, tm.server_args = None, 100, ServerArgs(skip_tokenizer_init=True)
    tm.sampling_defaults = defaults
    sp = tm.make_sampling_params({})
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.3, 0.8, 20)
    sp = tm.make_sampling_params({"top_p": 0.5, "top_k": None})  # null is unset
    assert (sp.temperature, sp.top_p, sp.top_k) == (0.3, 0.5, 20)
    (tmp_path / "generation_config.json").write_text(json.dumps({"temperature": -1}))
    assert load_sampling_defaults(str(tmp_path)) == {}  # invalid values are not used
    assert load_sampling_defaults(None) == {}
