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
    ({"prompt": "x", "tools": []}, "unsupported parameter(s): tools", "tools"),
    ({"max_tokens": 1}, "missing required parameter(s): prompt", "prompt"),
    ({"prompt": "x", "n": "2"}, "n: Input should be a valid integer", "n"),
    ({"prompt": "x", "temperature": 2.5}, "temperature: Input should be less than or equal to 2", "temperature"),
    ({"prompt": "x", "stream": 1}, "stream: Input should be a valid boolean", "stream"),
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
