"""Tool calling and reasoning output through a real server, with the official `openai` client.

On the embedded SmolLM2 (its chat template knows no tools: they are described in the system message):
`tool_choice` "required" and a named function are constrained by a grammar, so every call must parse and validate
against its function's schema (asserted strictly, streamed and not, with n=2 and parallel_tool_calls false);
"auto" is checked for the response's shape (the tiny model rarely calls tools: the parsers themselves are tested
on crafted outputs in test_tool_parsers.py); a history with assistant tool_calls and tool results is rendered; bad
tool requests are 400s naming the field.

On a tiny random Llama whose chat template opens `<think>` (Qwen3 style, `--reasoning-parser qwen3`), a regex
shapes the answer as `thinking</think>\\n\\nanswer`: reasoning_content and content split it, streamed deltas agree,
`separate_reasoning: false` keeps it inline, and `chat_template_kwargs: {"enable_thinking": false}` reaches the
template."""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import openai
import pytest
from server_utils import wait_healthy

from radixserve.utils import free_port, kill_process_tree

pytestmark = pytest.mark.integration

WEATHER = {"type": "function", "function": {
    "name": "get_weather", "description": "The current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                                    "unit": {"type": "string", "enum": ["celsius", "fahrenheit"]}},
                   "required": ["city", "unit"], "additionalProperties": False}}}
TIME = {"type": "function", "function": {
    "name": "get_time", "description": "The current time in a time zone",
    "parameters": {"type": "object", "properties": {"timezone": {"type": "string", "maxLength": 32},
                                                    "24h": {"type": "boolean"}},
                   "required": ["timezone", "24h"], "additionalProperties": False}}}
TOOLS = [WEATHER, TIME]
SCHEMAS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
PROMPTS = ["What is the weather in Paris?", "What time is it in Tokyo?",
           "I am flying from Oslo to Lima tomorrow: what should I know about the weather and the time there?"]


def _start(cmd_tail: list[str], log_dir: Any) -> tuple[subprocess.Popen, str, Any]:
    port = free_port()
    log_path = log_dir / "server.log"
    log = open(log_path, "w")  # noqa: SIM115 - closed at teardown
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", "4096", *cmd_tail]
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc], lambda: log_path.read_text()[-4000:])
    except BaseException:
        kill_process_tree(proc.pid)
        log.close()
        raise
    return proc, base, log


@pytest.fixture(scope="module")
def server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    proc, base, log = _start([], tmp_path_factory.mktemp("tools"))
    try:
        yield base
    finally:
        kill_process_tree(proc.pid)
        log.close()


@pytest.fixture(scope="module")
def client(server: str) -> openai.OpenAI:
    return openai.OpenAI(base_url=server + "/v1", api_key="none", max_retries=0, timeout=300)


def _check_calls(calls: list[Any], allowed: set[str], cut: bool = False) -> None:
    """cut (finish_reason "length"): the last call's arguments end where max_tokens cut them."""
    assert calls, "a forced tool choice must produce a call"
    for call in calls[:-1] if cut else calls:
        assert call.type == "function" and call.id.startswith("call_")
        assert call.function.name in allowed
        jsonschema.validate(json.loads(call.function.arguments), SCHEMAS[call.function.name])


def _collect_stream(stream: Any) -> tuple[dict[int, dict[str, Any]], str, str | None]:
    """Rebuild the calls of choice 0 from stream deltas, checking OpenAI's shape: a call's first delta carries
    its id, type and name (with empty arguments), later ones only argument fragments."""
    calls: dict[int, dict[str, Any]] = {}
    content, finish = "", None
    for chunk in stream:
        if not chunk.choices:
            continue
        choice = chunk.choices[0]
        delta = choice.delta
        content += delta.content or ""
        for tc in delta.tool_calls or []:
            if tc.index not in calls:
                assert tc.id and tc.id.startswith("call_") and tc.type == "function" and tc.function.name
                assert tc.function.arguments == ""
                calls[tc.index] = {"id": tc.id, "name": tc.function.name, "arguments": ""}
            else:
                assert tc.id is None and tc.function.name is None
                calls[tc.index]["arguments"] += tc.function.arguments
        finish = choice.finish_reason or finish
    return calls, content, finish


def test_required_calls_always_validate(client: openai.OpenAI) -> None:
    """Sampled (n=2, temperature 0.8): every call returned validates. With parallel calls a small model may repeat
    calls until max_tokens (finish_reason "length": the calls before the cut validate, the cut one is returned as
    far as it got, as the stream sends it); with parallel_tool_calls false the answer is one call and always
    complete."""
    msgs = [{"role": "user", "content": PROMPTS[2]}]
    r = client.chat.completions.create(model="default", messages=msgs, tools=TOOLS, tool_choice="required",
                                       max_tokens=100, temperature=0.8, seed=1, n=2)
    assert len(r.choices) == 2
    for choice in r.choices:
        assert choice.finish_reason in ("tool_calls", "length") and choice.message.content is None
        _check_calls(choice.message.tool_calls, set(SCHEMAS), cut=choice.finish_reason == "length")
    r = client.chat.completions.create(model="default", messages=msgs, tools=TOOLS, tool_choice="required",
                                       parallel_tool_calls=False, max_tokens=60, temperature=0.8, seed=2, n=2)
    for choice in r.choices:
        assert choice.finish_reason == "tool_calls" and choice.message.content is None
        assert len(choice.message.tool_calls) == 1
        _check_calls(choice.message.tool_calls, set(SCHEMAS))


def test_required_streamed_and_single(client: openai.OpenAI) -> None:
    stream = client.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPTS[2]}],
                                            tools=TOOLS, tool_choice="required", max_tokens=80, stream=True,
                                            temperature=0)
    calls, content, finish = _collect_stream(stream)
    assert finish in ("tool_calls", "length") and content == "" and calls
    complete = list(calls.values()) if finish == "tool_calls" else list(calls.values())[:-1]  # the cut one
    for call in complete:
        jsonschema.validate(json.loads(call["arguments"]), SCHEMAS[call["name"]])
    # parallel_tool_calls false: exactly one call
    r = client.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPTS[2]}],
                                       tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                       max_tokens=60, temperature=0)
    assert len(r.choices[0].message.tool_calls) == 1
    _check_calls(r.choices[0].message.tool_calls, set(SCHEMAS))


@pytest.mark.parametrize("stream", [False, True])
def test_named_function(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS,
                              tool_choice={"type": "function", "function": {"name": "get_time"}}, max_tokens=80,
                              temperature=0)
    if not stream:
        r = client.chat.completions.create(**kw)
        assert r.choices[0].finish_reason == "tool_calls"
        calls = r.choices[0].message.tool_calls
        assert len(calls) == 1
        _check_calls(calls, {"get_time"})
        return
    calls, content, finish = _collect_stream(client.chat.completions.create(stream=True, **kw))
    assert finish == "tool_calls" and content == "" and list(calls) == [0] and calls[0]["name"] == "get_time"
    jsonschema.validate(json.loads(calls[0]["arguments"]), SCHEMAS["get_time"])


@pytest.mark.parametrize("stream", [False, True])
def test_auto_response_shape(client: openai.OpenAI, stream: bool) -> None:
    kw: dict[str, Any] = dict(model="default", messages=[{"role": "user", "content": PROMPTS[0]}], tools=TOOLS,
                              max_tokens=24, temperature=0)
    if stream:
        calls, content, finish = _collect_stream(client.chat.completions.create(stream=True, **kw))
        assert finish in ("stop", "length", "tool_calls") and (content or calls)
        assert (finish == "tool_calls") == bool(calls)
        return
    r = client.chat.completions.create(**kw)
    msg = r.choices[0].message
    assert r.choices[0].finish_reason in ("stop", "length", "tool_calls")
    assert (r.choices[0].finish_reason == "tool_calls") == bool(msg.tool_calls)
    assert msg.content or msg.tool_calls
    for call in msg.tool_calls or []:
        assert call.function.name in SCHEMAS and isinstance(json.loads(call.function.arguments), dict)


def test_history_with_calls_and_results(client: openai.OpenAI, server: str) -> None:
    first = client.chat.completions.create(model="default", messages=[{"role": "user", "content": PROMPTS[0]}],
                                           tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                                           max_tokens=60, temperature=0)
    msg = first.choices[0].message
    call = msg.tool_calls[0]
    history = [{"role": "user", "content": PROMPTS[0]}, msg.model_dump(exclude_none=True),
               {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 21})}]
    r = client.chat.completions.create(model="default", messages=history, tools=TOOLS, max_tokens=16, temperature=0)
    assert r.choices[0].message.content or r.choices[0].message.tool_calls
    # the call is in the prompt: the second prompt is longer than the first by more than the tool result
    assert r.usage.prompt_tokens > first.usage.prompt_tokens + 10
    # the same history with tool_choice "none": the tools are left out of the prompt, nothing is parsed
    r2 = client.chat.completions.create(model="default", messages=history, tools=TOOLS, tool_choice="none",
                                        max_tokens=16, temperature=0)
    assert r2.choices[0].message.tool_calls is None and r2.usage.prompt_tokens < r.usage.prompt_tokens


OK_MSG = [{"role": "user", "content": "hi"}]
BAD = [
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}},
     "tool_choice.function.name"),
    ({"tools": [WEATHER, WEATHER]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "strict": True}}]}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "bad name"}}]}, "tools[0].function.name"),
    ({"tools": [{"type": "code", "function": {"name": "f"}}]}, "tools[0].type"),
    ({"tools": TOOLS, "tool_choice": "sometimes"}, "tool_choice"),
    ({"tools": TOOLS, "tool_choice": "required", "response_format": {"type": "json_object"}}, "response_format"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "nonsense"}}}],
      "tool_choice": "required"}, "tools"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "string"}}}],
      "tool_choice": "required"}, "tools[0].function.parameters"),
    ({"chat_template_kwargs": {"add_generation_prompt": False}}, "chat_template_kwargs"),
    ({"messages": [{"role": "tool", "content": "21"}]}, "messages[0].tool_call_id"),
    ({"messages": [{"role": "user", "content": "x", "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}]}, "messages[0].tool_calls"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "not json"}}]}]},
     "messages[0].tool_calls[0].function.arguments"),
]


def test_bad_tool_requests_are_400(server: str) -> None:
    with httpx.Client(base_url=server, timeout=60) as http:
        for body, param in BAD:
            r = http.post("/v1/chat/completions", json={"messages": OK_MSG, "max_tokens": 2, **body})
            assert r.status_code == 400, (body, r.text)
            assert r.json()["error"]["param"] == param, (body, r.text)
        # null / default values of the tool fields change nothing
        r = http.post("/v1/chat/completions", json={"messages": OK_MSG, "max_tokens": 2, "tool_choice": None,
                                                    "parallel_tool_calls": True, "tools": []})
        assert r.status_code == 200 and "tool_calls" not in r.json()["choices"][0]["message"]
        assert http.get("/health").status_code == 200


# ---------------------------------------------------------------------------------------------- reasoning
THINK_TEMPLATE = (
    "{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n"
    "{% if enable_thinking is defined and not enable_thinking %}<think>\n\n</think>\n\n{% else %}<think>\n{% endif %}"
    "{% endif %}")
WORDS = "[a-z]{1,6}( [a-z]{1,6}){0,2}"


@pytest.fixture(scope="module")
def think_server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    from model_utils import make_tiny_model

    folder = tmp_path_factory.mktemp("think_model")
    make_tiny_model("llama", str(folder), vocab_size=49152)
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copy(os.path.join(embedded_model_path, name), folder / name)
    (folder / "chat_template.jinja").write_text(THINK_TEMPLATE)
    proc, base, log = _start(["--model-path", str(folder), "--reasoning-parser", "qwen3"],
                             tmp_path_factory.mktemp("think"))
    try:
        yield base
    finally:
        kill_process_tree(proc.pid)
        log.close()


def test_reasoning_split(think_server: str) -> None:
    c = openai.OpenAI(base_url=think_server + "/v1", api_key="none", max_retries=0, timeout=120)
    kw: dict[str, Any] = dict(model="default", messages=OK_MSG, max_tokens=100, temperature=0,
                              extra_body={"regex": WORDS + "</think>\n\n" + WORDS})
    r = c.chat.completions.create(**kw)
    msg = r.choices[0].message.model_dump()
    reasoning, content = msg["reasoning_content"], msg["content"]
    assert reasoning and content and "</think>" not in reasoning + content
    # separate_reasoning false: the same answer, inline
    inline = c.chat.completions.create(**{**kw, "extra_body": {**kw["extra_body"], "separate_reasoning": False}})
    assert inline.choices[0].message.content == reasoning + "</think>\n\n" + content
    assert inline.choices[0].message.model_dump().get("reasoning_content") is None
    # streamed: reasoning deltas first, then content deltas, adding up to the same
    kinds, parts = [], {"reasoning_content": "", "content": ""}
    for chunk in c.chat.completions.create(stream=True, **kw):
        for choice in chunk.choices:
            d = choice.delta.model_dump()
            for key in parts:
                if d.get(key):
                    parts[key] += d[key]
                    if not kinds or kinds[-1] != key:
                        kinds.append(key)
    assert parts == {"reasoning_content": reasoning, "content": content} and kinds == ["reasoning_content", "content"]
    # enable_thinking false reaches the template: the prompt closes the block, the answer is all content
    off = c.chat.completions.create(**{**kw, "extra_body": {"regex": WORDS,
                                                            "chat_template_kwargs": {"enable_thinking": False}}})
    assert off.choices[0].message.content and off.choices[0].message.model_dump().get("reasoning_content") is None
    assert off.usage.prompt_tokens > r.usage.prompt_tokens


def test_forced_call_with_the_prompt_opening_thinking(think_server: str) -> None:
    """The prompt opens `<think>`, but a forced call's grammar shapes the answer from its first token: the answer
    is the call (not reasoning_content and an empty call), streamed or not."""
    c = openai.OpenAI(base_url=think_server + "/v1", api_key="none", max_retries=0, timeout=120)
    flag = {"type": "function", "function": {"name": "set_flag", "parameters": {
        "type": "object", "properties": {"on": {"type": "boolean"}}, "required": ["on"],
        "additionalProperties": False}}}
    for choice in ("required", {"type": "function", "function": {"name": "set_flag"}}):
        kw: dict[str, Any] = dict(model="default", messages=OK_MSG, tools=[flag], tool_choice=choice, max_tokens=40,
                                  parallel_tool_calls=False, temperature=0)
        msg = c.chat.completions.create(**kw).choices[0].message
        assert msg.model_dump().get("reasoning_content") is None, msg
        assert [(t.function.name, set(json.loads(t.function.arguments))) for t in msg.tool_calls] == \
            [("set_flag", {"on"})], msg
        calls, content, finish = _collect_stream(c.chat.completions.create(stream=True, **kw))
        assert content == "" and finish == "tool_calls"
        assert [(v["name"], set(json.loads(v["arguments"]))) for v in calls.values()] == [("set_flag", {"on"})]
