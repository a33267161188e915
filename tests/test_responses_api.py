"""POST /v1/responses (the Responses API over the chat path).

Unit tests (no process): input items -> chat messages, the request -> the chat body it runs, chat-side errors
renamed to Responses fields, a chat answer -> output items, and the stream's event sequence.
Unit tests also cover the response store (LRU by count), stored input items, a stored conversation before the
input, and reasoning summaries (items and stream events).
Server tests (one server on the embedded SmolLM2 for the module, few small requests): text streamed and not,
max_output_tokens -> incomplete, instructions, a forced function call and the function_call_output turn after it,
text.format json_schema, the `openai` SDK's client.responses.create (when installed), and 400s naming the field;
stored responses (GET, input_items, DELETE, previous_response_id, LRU eviction at --responses-store-size 4,
streamed ones, aborted ones not). A second server (--responses-store-size 0 --reasoning-parser deepseek-r1, so
SmolLM2's whole answer is reasoning) checks the store's 400s and reasoning summaries."""

from __future__ import annotations

import json
from collections.abc import Iterator
from typing import Any

import httpx
import jsonschema
import pytest
from server_utils import Server, serving

from radixserve.entrypoints.openai.chat_output import OutputConfig
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest, ResponsesRequest
from radixserve.entrypoints.openai.response_store import ResponseStore
from radixserve.entrypoints.openai.responses_items import (
    chat_request_body,
    check_request,
    input_items,
    input_messages,
    output_items,
    remap_error,
    response_object,
)
from radixserve.entrypoints.openai.serving_chat import PreparedChat
from radixserve.entrypoints.openai.serving_responses import ResponseEvents

WEATHER = {"type": "function", "name": "get_weather", "description": "The current weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 16}},
                          "required": ["city"], "additionalProperties": False}, "strict": True}
PERSON = {"type": "object", "properties": {"name": {"type": "string", "maxLength": 12}, "age": {"type": "integer"}},
          "required": ["name", "age"], "additionalProperties": False}


def _req(**fields: Any) -> ResponsesRequest:
    return ResponsesRequest.model_validate({"input": "hi", **fields})


def _api_error(fn: Any, *args: Any) -> APIError:
    with pytest.raises(APIError) as ei:
        fn(*args)
    assert ei.value.status_code == 400
    return ei.value


# ============================================================================================== unit: input
def test_string_input_and_instructions() -> None:
    assert input_messages("hi", None) == [{"role": "user", "content": "hi"}]
    assert input_messages("hi", "Be brief.") == [{"role": "developer", "content": "Be brief."},
                                                 {"role": "user", "content": "hi"}]


def test_items_become_chat_messages() -> None:
    items = [
        {"role": "system", "content": "sys"},
        {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "a"},
                                                        {"type": "input_text", "text": "b"}]},
        {"type": "reasoning", "id": "rs_1", "summary": [], "content": [{"type": "reasoning_text", "text": "hm"}]},
        # an earlier response's output, as the SDK sends it back
        {"id": "msg_1", "type": "message", "status": "completed", "role": "assistant",
         "content": [{"type": "output_text", "text": "let me look", "annotations": []}]},
        {"type": "function_call", "id": "fc_1", "call_id": "c1", "name": "f", "arguments": '{"x": 1}',
         "status": "completed"},
        {"type": "function_call", "call_id": "c2", "name": "g", "arguments": ""},
        {"type": "function_call_output", "call_id": "c1", "output": "one"},
        {"type": "function_call_output", "call_id": "c2", "output": [{"type": "input_text", "text": "two"}]},
        {"role": "developer", "content": "dev"},
    ]
    msgs = input_messages(items, None)
    assert msgs == [
        {"role": "system", "content": "sys"},
        {"role": "user", "content": "ab"},
        {"role": "assistant", "content": "let me look", "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "f", "arguments": '{"x": 1}'}},
            {"id": "c2", "type": "function", "function": {"name": "g", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "one"},
        {"role": "tool", "tool_call_id": "c2", "content": "two"},
        {"role": "developer", "content": "dev"},
    ]
    ChatCompletionRequest.model_validate({"messages": msgs})  # the chat path takes them as they are
    # a call with no assistant text before it is an assistant message of its own
    assert input_messages([{"type": "function_call", "call_id": "c", "name": "f", "arguments": "{}"}], None)[0] == \
        {"role": "assistant", "content": None,
         "tool_calls": [{"id": "c", "type": "function", "function": {"name": "f", "arguments": "{}"}}]}


@pytest.mark.parametrize("items, param", [
    ([{"type": "web_search_call", "id": "x"}], "input[0].type"),
    ([{"role": "user"}], "input[0].content"),
    ([{"role": "tool", "content": "x"}], "input[0].role"),
    ([{"role": "user", "content": [{"type": "input_image", "image_url": "u"}]}], "input[0].content[0].type"),
    ([{"role": "user", "content": "x", "bogus": 1}], "input[0].bogus"),
    ([{"role": "user", "content": "x"}, {"type": "function_call", "call_id": "c", "name": "f", "arguments": "[1]"}],
     "input[1].arguments"),
    ([{"type": "function_call_output", "call_id": "nope", "output": "x"}], "input[0].call_id"),
    ([{"type": "reasoning", "summary": []}], "input"),  # nothing left to answer
])
def test_bad_items_name_the_field(items: list[dict[str, Any]], param: str) -> None:
    err = _api_error(input_messages, items, None)
    assert err.param == param and param in err.message, err.message


# ============================================================================================== unit: request
def test_chat_body_maps_the_responses_fields() -> None:
    req = _req(instructions="sys", tools=[WEATHER], tool_choice={"type": "function", "name": "get_weather"},
               parallel_tool_calls=False, max_output_tokens=7, temperature=0.5, top_p=0.9, user="u",
               text={"format": {"type": "json_schema", "name": "p", "schema": PERSON, "strict": True}})
    body = chat_request_body(req, "{{ messages }}")
    assert body["tools"] == [{"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}]
    assert body["tool_choice"] == {"type": "function", "function": {"name": "get_weather"}}
    assert body["response_format"] == {"type": "json_schema",
                                       "json_schema": {"name": "p", "schema": PERSON, "strict": True}}
    assert (body["max_completion_tokens"], body["temperature"], body["top_p"], body["parallel_tool_calls"],
            body["user"]) == (7, 0.5, 0.9, False, "u")
    assert body["messages"][0] == {"role": "developer", "content": "sys"}
    ChatCompletionRequest.model_validate(body)
    assert chat_request_body(_req(text={"format": {"type": "json_object"}}), None)["response_format"] == \
        {"type": "json_object"}


def test_null_and_default_fields_change_nothing() -> None:
    nulls = {k: None for k in ResponsesRequest.model_fields if k not in ("input", "stream")}
    plain = chat_request_body(_req(), None)
    assert chat_request_body(_req(**nulls, stream=None), None) == plain == \
        {"messages": [{"role": "user", "content": "hi"}], "stream": False}
    defaults = _req(store=False, include=[], truncation="disabled", background=False, top_logprobs=0,
                    metadata={"k": "v"}, reasoning={"effort": None, "summary": "auto"},
                    text={"format": {"type": "text"}})
    check_request(defaults)
    assert {k: v for k, v in chat_request_body(defaults, None).items() if k != "response_format"} == plain
    check_request(_req(store=True))  # (whether the server stores is serving_responses' check)
    check_request(_req(previous_response_id="resp_1"))
    assert chat_request_body(_req(tool_choice="auto", tools=[]), None) == {**plain, "tools": []}


def test_reasoning_effort_reaches_templates_that_take_it() -> None:
    req = _req(reasoning={"effort": "low"})
    body = chat_request_body(req, "{{ reasoning_effort | default('medium') }}")
    assert body["chat_template_kwargs"] == {"reasoning_effort": "low"}
    assert _api_error(chat_request_body, req, "{{ messages }}").param == "reasoning.effort"


@pytest.mark.parametrize("fields, param", [
    ({"conversation": "conv_1"}, "conversation"),
    ({"reasoning": {"summary": "concise"}}, "reasoning.summary"),
    ({"reasoning": {"generate_summary": "concise"}}, "reasoning.generate_summary"),
    ({"background": True}, "background"),
    ({"include": ["reasoning.encrypted_content"]}, "include"),
    ({"truncation": "auto"}, "truncation"),
    ({"max_tool_calls": 2}, "max_tool_calls"),
    ({"stream_options": {"include_obfuscation": False}}, "stream_options"),
])
def test_unsupported_fields_are_400s(fields: dict[str, Any], param: str) -> None:
    assert _api_error(check_request, _req(**fields)).param == param


def test_chat_errors_name_the_responses_field() -> None:
    cases = {"tools[1].function.parameters": "tools[1].parameters", "tool_choice.function.name": "tool_choice.name",
             "response_format.json_schema.schema": "text.format.schema", "response_format": "text.format",
             "max_completion_tokens": "max_output_tokens", "messages": "input", "messages[2].content": "input",
             "temperature": "temperature"}
    for old, new in cases.items():
        err = remap_error(APIError(f"{old}: bad", 400, old, "invalid_value"))
        assert (err.param, err.message) == (new, f"{new}: bad")


# ============================================================================================== unit: storage
def test_response_store_is_lru_by_count() -> None:
    store = ResponseStore(2)
    for rid in ("a", "b"):
        store.put({"id": rid, "output": [{"n": rid}]}, [{"id": "in_" + rid}])
    assert store.get("a") is not None  # a is now the most recently used: b goes first
    store.put({"id": "c", "output": []}, [])
    assert ("a" in store, "b" in store, "c" in store, len(store)) == (True, False, True, 2)
    assert store.get("a").conversation() == [{"id": "in_a"}, {"n": "a"}]
    store.get("a").conversation()[0]["id"] = "changed"  # copies: the stored items stay as they were
    assert store.get("a").input_items == [{"id": "in_a"}]
    assert store.delete("a") and not store.delete("a") and store.get("a") is None
    off = ResponseStore(0)
    off.put({"id": "x", "output": []}, [])
    assert not off.enabled and len(off) == 0
    with pytest.raises(ValueError, match="capacity"):
        ResponseStore(-1)


def test_input_items_keep_ids_and_continue_as_the_same_messages() -> None:
    sent = [{"role": "user", "content": "hi"},
            {"type": "function_call", "id": "fc_mine", "call_id": "c", "name": "f", "arguments": "{}"},
            {"type": "function_call_output", "call_id": "c", "output": "42"},
            {"role": "assistant", "content": "it is 42"}]
    items = input_items(sent)
    assert [(i["type"], i["id"][:3], i["status"]) for i in items] == [
        ("message", "msg", "completed"), ("function_call", "fc_", "completed"),
        ("function_call_output", "fco", "completed"), ("message", "msg", "completed")]
    assert items[1]["id"] == "fc_mine" and len({i["id"] for i in items}) == 4
    assert items[0]["content"] == [{"type": "input_text", "text": "hi"}]
    assert items[3]["content"] == [{"type": "output_text", "text": "it is 42", "annotations": []}]
    assert input_items("hey")[0]["content"] == [{"type": "input_text", "text": "hey"}]
    # stored items read back as the same chat messages, before the new input and after the new instructions
    assert input_messages("next", "sys", items) == \
        [{"role": "developer", "content": "sys"}, *input_messages(sent, None), {"role": "user", "content": "next"}]
    # a call of the stored conversation answered in the new input; errors count in the new input
    history = input_items(sent[:2])
    assert input_messages([sent[2]], None, history)[-1] == {"role": "tool", "tool_call_id": "c", "content": "42"}
    bad = [{"role": "user", "content": "x"}, {"type": "function_call_output", "call_id": "nope", "output": "x"}]
    err = _api_error(input_messages, bad, None, history)
    assert err.param == "input[1].call_id"


def test_response_object_says_whether_it_is_stored() -> None:
    obj = response_object(_req(previous_response_id="resp_0"), "resp_1", "m", 0, "completed", [], None, store=True)
    assert (obj["store"], obj["previous_response_id"]) == (True, "resp_0")
    assert response_object(_req(), "resp_1", "m", 0, "completed", [], None)["store"] is False


# ============================================================================================== unit: output
def test_output_items() -> None:
    call = {"id": "call_1", "type": "function", "function": {"name": "f", "arguments": "{}"}}
    items = output_items({"role": "assistant", "content": "hi", "reasoning_content": "think", "tool_calls": [call]},
                         cut=False)
    assert [i["type"] for i in items] == ["reasoning", "message", "function_call"]
    assert items[0]["content"] == [{"type": "reasoning_text", "text": "think"}] and items[0]["summary"] == []
    assert items[1]["content"] == [{"type": "output_text", "text": "hi", "annotations": []}]
    assert {k: items[2][k] for k in ("call_id", "name", "arguments", "status")} == \
        {"call_id": "call_1", "name": "f", "arguments": "{}", "status": "completed"}
    assert [i["id"][:3] for i in items] == ["rs_", "msg", "fc_"]
    only_call = output_items({"role": "assistant", "content": None, "tool_calls": [call]}, cut=True)
    assert [(i["type"], i["status"]) for i in only_call] == [("function_call", "incomplete")]
    empty = output_items({"role": "assistant", "content": ""}, cut=False)
    assert [(i["type"], i["content"][0]["text"]) for i in empty] == [("message", "")]
    summarised = output_items({"role": "assistant", "content": "hi", "reasoning_content": "think"}, cut=False,
                              summary=True)
    assert summarised[0]["summary"] == [{"type": "summary_text", "text": "think"}]


def _events(chunks: list[bytes]) -> list[dict[str, Any]]:
    out = []
    for chunk in chunks:
        head, data = chunk.decode().strip().split("\n")
        payload = json.loads(data.removeprefix("data: "))
        assert head == "event: " + payload["type"]
        out.append(payload)
    return out


def test_stream_events_follow_the_deltas() -> None:
    prep = PreparedChat(obj=None, rid="abc", prompt_len=3, cfg=OutputConfig())  # type: ignore[arg-type]
    ev = ResponseEvents(_req(), prep, "m", 0, None)
    chunks: list[bytes] = []
    for delta in [{"reasoning_content": "th"}, {"reasoning_content": "ink"}, {"content": "A"}, {"content": "B"},
                  {"tool_calls": [{"index": 0, "id": "call_x", "type": "function",
                                   "function": {"name": "f", "arguments": ""}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": '{"a"'}}]},
                  {"tool_calls": [{"index": 0, "function": {"arguments": ": 1}"}}]}]:
        chunks += ev.on_delta(delta)
    chunks += ev.close("completed")
    events = _events(chunks)
    assert [e["type"] for e in events] == [
        "response.output_item.added", "response.content_part.added", "response.reasoning_text.delta",
        "response.reasoning_text.delta", "response.reasoning_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.content_part.added", "response.output_text.delta",
        "response.output_text.delta", "response.output_text.done", "response.content_part.done",
        "response.output_item.done",
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.delta", "response.function_call_arguments.done",
        "response.output_item.done"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    done = [e["item"] for e in events if e["type"] == "response.output_item.done"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1, 2]
    assert done[0]["content"][0]["text"] == "think" and done[1]["content"][0]["text"] == "AB"
    assert (done[2]["call_id"], done[2]["arguments"]) == ("call_x", '{"a": 1}')
    assert ev.items == done
    err = _events([ev.error(APIError("boom", 503, None, "request_aborted"))])[0]
    assert err == {"type": "error", "sequence_number": len(events), "code": "request_aborted", "message": "boom",
                   "param": None}


SUMMARY_KINDS = ["response.output_item.added", "response.content_part.added",
                 "response.reasoning_summary_part.added",
                 "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
                 "response.reasoning_text.delta", "response.reasoning_summary_text.delta",
                 "response.reasoning_text.done", "response.content_part.done",
                 "response.reasoning_summary_text.done", "response.reasoning_summary_part.done",
                 "response.output_item.done"]


def test_stream_events_with_a_reasoning_summary() -> None:
    prep = PreparedChat(obj=None, rid="abc", prompt_len=3, cfg=OutputConfig())  # type: ignore[arg-type]
    ev = ResponseEvents(_req(reasoning={"summary": "detailed"}), prep, "m", 0, None)
    chunks = ev.on_delta({"reasoning_content": "th"}) + ev.on_delta({"reasoning_content": "ink"})
    events = _events(chunks + ev.on_delta({"content": "A"}))
    assert [e["type"] for e in events][:len(SUMMARY_KINDS)] == SUMMARY_KINDS
    summary = [e for e in events if "summary_index" in e]
    assert all(e["summary_index"] == 0 and e["output_index"] == 0 for e in summary)
    assert summary[0]["part"] == {"type": "summary_text", "text": ""}
    assert [e["delta"] for e in summary if e["type"].endswith("text.delta")] == ["th", "ink"]
    assert summary[-2]["text"] == "think" and summary[-1]["part"] == {"type": "summary_text", "text": "think"}
    assert events[len(SUMMARY_KINDS) - 1]["item"]["summary"] == [{"type": "summary_text", "text": "think"}]
    plain = ResponseEvents(_req(), prep, "m", 0, None)
    kinds = [e["type"] for e in _events(plain.on_delta({"reasoning_content": "x"}) + plain.close("completed"))]
    assert not [k for k in kinds if "summary" in k] and plain.items[0]["summary"] == []


# ============================================================================================== server
STORE_SIZE = 4


@pytest.fixture(scope="module")
def server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    with serving(str(tmp_path_factory.mktemp("responses") / "server.log"),
                 ["--max-total-tokens", "4096", "--responses-store-size", str(STORE_SIZE)]) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, timeout=120) as c:
        yield c


def _create(http: httpx.Client, **body: Any) -> dict[str, Any]:
    r = http.post("/v1/responses", json={"model": "default", "temperature": 0, **body})
    assert r.status_code == 200, r.text
    return r.json()


def _stream(http: httpx.Client, **body: Any) -> list[dict[str, Any]]:
    events = []
    with http.stream("POST", "/v1/responses", json={"model": "default", "temperature": 0, "stream": True,
                                                    **body}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        kind = None
        for line in r.iter_lines():
            if line.startswith("event: "):
                kind = line[7:]
            elif line.startswith("data: "):
                payload = json.loads(line[6:])
                assert payload["type"] == kind
                events.append(payload)
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    return events


def _text(resp: dict[str, Any]) -> str:
    return "".join(c["text"] for i in resp["output"] if i["type"] == "message" for c in i["content"])


@pytest.mark.integration
def test_text_non_stream_and_stream_agree(http: httpx.Client) -> None:
    body = {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Name three colors."}]}],
            "instructions": "You are a painter.", "max_output_tokens": 8, "metadata": {"t": "1"}, "store": False}
    resp = _create(http, **body)
    assert resp["object"] == "response" and resp["id"].startswith("resp_")
    assert resp["status"] == "incomplete" and resp["incomplete_details"] == {"reason": "max_output_tokens"}
    assert [i["type"] for i in resp["output"]] == ["message"] and resp["output"][0]["status"] == "incomplete"
    assert (resp["instructions"], resp["max_output_tokens"], resp["metadata"], resp["store"]) == \
        ("You are a painter.", 8, {"t": "1"}, False)
    u = resp["usage"]
    assert u["output_tokens"] == 8 and u["total_tokens"] == u["input_tokens"] + 8 and u["input_tokens"] > 10
    # the instructions reach the prompt: longer ones, more input tokens
    longer = _create(http, **{**body, "instructions": "You are a painter who loves the sea and the sky.",
                              "max_output_tokens": 1})
    assert longer["usage"]["input_tokens"] > u["input_tokens"]

    events = _stream(http, **body)
    kinds = [e["type"] for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          "response.incomplete"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert events[0]["response"]["status"] == "in_progress" and events[0]["response"]["output"] == []
    final = events[-1]["response"]
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.output_text.delta")
    assert deltas == events[-4]["text"] == _text(final) == _text(resp)  # greedy: the same answer
    item_id = events[2]["item"]["id"]
    assert all(e["item_id"] == item_id for e in events[3:-2]) and final["output"][0]["id"] == item_id
    assert final["usage"]["output_tokens"] == 8 and final["id"] == events[0]["response"]["id"]


@pytest.mark.integration
def test_forced_function_call_then_its_output(http: httpx.Client) -> None:
    q = {"role": "user", "content": "What is the weather in Paris?"}
    events = _stream(http, input=[q], tools=[WEATHER], tool_choice="required", max_output_tokens=40)
    assert events[-1]["type"] == "response.completed"
    final = events[-1]["response"]
    assert [i["type"] for i in final["output"]] == ["function_call"]
    call = final["output"][0]
    assert call["name"] == "get_weather" and call["status"] == "completed" and call["call_id"].startswith("call_")
    jsonschema.validate(json.loads(call["arguments"]), WEATHER["parameters"])
    assert "".join(e["delta"] for e in events if e["type"] == "response.function_call_arguments.delta") == \
        next(e["arguments"] for e in events if e["type"] == "response.function_call_arguments.done") == \
        call["arguments"]
    assert final["tools"][0]["name"] == "get_weather" and final["tool_choice"] == "required"

    tool = {**WEATHER, "strict": False}  # (strict is enforced only for forced calls)
    follow = [q, *final["output"], {"type": "function_call_output", "call_id": call["call_id"],
                                    "output": json.dumps({"temperature_c": 21})}]
    resp = _create(http, input=follow, tools=[tool], tool_choice="none", max_output_tokens=12)
    assert resp["output"][0]["type"] == "message" and _text(resp)
    # the call and its output reached the prompt
    alone = _create(http, input=[q], tools=[tool], tool_choice="none", max_output_tokens=1)
    assert resp["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + 10


@pytest.mark.integration
def test_json_schema_format(http: httpx.Client) -> None:
    resp = _create(http, input="Describe a person as JSON.", max_output_tokens=40,
                   text={"format": {"type": "json_schema", "name": "person", "schema": PERSON, "strict": True}})
    assert resp["status"] == "completed", resp
    jsonschema.validate(json.loads(_text(resp)), PERSON)
    assert resp["text"]["format"]["type"] == "json_schema"


@pytest.mark.integration
def test_openai_sdk(server: Server) -> None:
    openai = pytest.importorskip("openai")
    client = openai.OpenAI(base_url=server.base + "/v1", api_key="none", max_retries=0, timeout=120)
    resp = client.responses.create(model="default", input="Say hello.", instructions="Be brief.",
                                   max_output_tokens=6, temperature=0, store=False, metadata={"k": "v"})
    assert resp.status == "incomplete" and resp.output_text and resp.usage.output_tokens == 6
    with pytest.raises(openai.NotFoundError) as ei:  # (store=False: nothing to continue)
        client.responses.create(model="default", input="x", previous_response_id=resp.id)
    assert ei.value.body["param"] == "previous_response_id"
    stored = client.responses.create(model="default", input="Say hello.", max_output_tokens=2, temperature=0)
    assert stored.store and client.responses.retrieve(stored.id).output_text == stored.output_text
    items = list(client.responses.input_items.list(stored.id))
    assert [(i.type, i.role, i.content[0].text) for i in items] == [("message", "user", "Say hello.")]
    follow = client.responses.create(model="default", input="Again.", previous_response_id=stored.id,
                                     max_output_tokens=2, temperature=0)
    assert follow.previous_response_id == stored.id
    client.responses.delete(stored.id)
    with pytest.raises(openai.NotFoundError):
        client.responses.retrieve(stored.id)


@pytest.mark.integration
@pytest.mark.parametrize("body, param", [
    ({}, "input"),
    ({"input": 5}, "input"),
    ({"input": "x", "max_output_tokens": 0}, "max_output_tokens"),
    ({"input": "x", "max_output_tokens": 1 << 20}, "input"),
    ({"input": "x", "tools": [{"type": "web_search"}]}, "tools[0].type"),
    ({"input": "x", "tools": [{**WEATHER, "parameters": {"type": "string"}}], "tool_choice": "required"},
     "tools[0].parameters"),
    ({"input": "x", "tools": [WEATHER], "tool_choice": {"type": "function", "name": "nope"}}, "tool_choice.name"),
    ({"input": "x", "text": {"format": {"type": "json_schema", "name": "p"}}}, "text.format.schema"),
    ({"input": [{"role": "user", "content": "x", "extra": 1}]}, "input[0].extra"),
    ({"input": "x", "reasoning": {"summary": "concise"}}, "reasoning.summary"),
])
def test_bad_requests_are_400s(http: httpx.Client, body: dict[str, Any], param: str) -> None:
    r = http.post("/v1/responses", json=body)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and err["type"] == "invalid_request_error", err


# ============================================================================================== server: storage
def _get(http: httpx.Client, path: str, status: int = 200, **params: Any) -> dict[str, Any]:
    r = http.get(path, params=params)
    assert r.status_code == status, r.text
    return r.json()


def _not_found(http: httpx.Client, method: str, path: str) -> dict[str, Any]:
    r = http.request(method, path)
    assert r.status_code == 404, r.text
    return r.json()["error"]


@pytest.mark.integration
def test_stored_response_round_trip(http: httpx.Client) -> None:
    msgs = [{"role": "user", "content": "Hi."}, {"role": "assistant", "content": "Hello!"},
            {"role": "user", "content": [{"type": "input_text", "text": "Name a fruit."}]}]
    resp = _create(http, input=msgs, instructions="Be brief.", max_output_tokens=3)  # store: null means true
    assert resp["store"] is True and resp["previous_response_id"] is None
    assert _get(http, f"/v1/responses/{resp['id']}") == resp

    listed = _get(http, f"/v1/responses/{resp['id']}/input_items", order="asc")
    items = listed["data"]
    assert (listed["object"], listed["has_more"], listed["first_id"], listed["last_id"]) == \
        ("list", False, items[0]["id"], items[-1]["id"])
    assert [(i["type"], i["role"], i["content"][0]["text"], i["id"][:4]) for i in items] == \
        [("message", "user", "Hi.", "msg_"), ("message", "assistant", "Hello!", "msg_"),
         ("message", "user", "Name a fruit.", "msg_")]  # the instructions are not an input item
    assert _get(http, f"/v1/responses/{resp['id']}/input_items")["data"] == items[::-1]  # OpenAI's default: desc
    page = _get(http, f"/v1/responses/{resp['id']}/input_items", order="asc", limit=2, after=items[0]["id"])
    assert (page["data"], page["has_more"]) == (items[1:], False)
    page = _get(http, f"/v1/responses/{resp['id']}/input_items", order="asc", limit=1)
    assert (page["data"], page["has_more"]) == (items[:1], True)
    assert _get(http, f"/v1/responses/{resp['id']}/input_items", 400, limit=0)["error"]["param"] == "limit"

    r = http.delete(f"/v1/responses/{resp['id']}")
    assert r.status_code == 200 and r.json() == {"id": resp["id"], "object": "response", "deleted": True}
    for method, path in [("GET", ""), ("DELETE", ""), ("GET", "/input_items")]:
        err = _not_found(http, method, f"/v1/responses/{resp['id']}{path}")
        assert err["code"] == "response_not_found" and resp["id"] in err["message"]

    unstored = _create(http, input="Hi.", max_output_tokens=1, store=False)
    assert unstored["store"] is False
    _not_found(http, "GET", f"/v1/responses/{unstored['id']}")


@pytest.mark.integration
def test_previous_response_id_continues_the_conversation(http: httpx.Client) -> None:
    first = {"role": "user", "content": "My name is Ada. Say OK."}
    second = {"role": "user", "content": "What is my name?"}
    prev = _create(http, input=first["content"], instructions="You are a pirate.", max_output_tokens=4)
    follow = _create(http, input=[second], previous_response_id=prev["id"], max_output_tokens=6)
    assert follow["previous_response_id"] == prev["id"] and follow["instructions"] is None
    # the same as sending the whole conversation (the instructions do not carry over), greedy
    explicit = _create(http, input=[first, *prev["output"], second], max_output_tokens=6, store=False)
    assert follow["usage"]["input_tokens"] == explicit["usage"]["input_tokens"]
    assert _text(follow) == _text(explicit)
    alone = _create(http, input=[second], max_output_tokens=1, store=False)
    assert follow["usage"]["input_tokens"] > alone["usage"]["input_tokens"] + 10
    # its input items: the previous input, the previous output, then its own input
    items = _get(http, f"/v1/responses/{follow['id']}/input_items", order="asc")["data"]
    assert [i["type"] for i in items] == ["message", "message", "message"]
    assert items[1] == prev["output"][0] and items[2]["content"][0]["text"] == second["content"]
    # a stored function call answered by the next request's input alone (its call_id is found in the stored turn)
    asked = _create(http, input="What is the weather in Paris?", tools=[WEATHER], tool_choice="required",
                    max_output_tokens=40)
    call = asked["output"][0]
    assert call["type"] == "function_call"
    output = {"type": "function_call_output", "call_id": call["call_id"], "output": "21 C"}
    answer = _create(http, input=[output], previous_response_id=asked["id"], tools=[WEATHER], tool_choice="none",
                     max_output_tokens=1)
    assert answer["status"] == "incomplete"
    r = http.post("/v1/responses", json={"input": [output], "tools": [WEATHER], "max_output_tokens": 1})
    assert r.status_code == 400 and r.json()["error"]["param"] == "input[0].call_id"  # without it: unknown call


@pytest.mark.integration
def test_unknown_previous_response_is_a_404(http: httpx.Client) -> None:
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": "resp_nope"})
    assert r.status_code == 404, r.text
    err = r.json()["error"]
    assert (err["param"], err["code"]) == ("previous_response_id", "previous_response_not_found")
    assert "resp_nope" in err["message"]


@pytest.mark.integration
def test_least_recently_used_responses_are_evicted(http: httpx.Client) -> None:
    ids = [_create(http, input=f"Say {n}.", max_output_tokens=1)["id"] for n in range(STORE_SIZE)]
    _get(http, f"/v1/responses/{ids[0]}")  # now the most recently used: ids[1] goes first
    ids.append(_create(http, input="Say more.", max_output_tokens=1)["id"])
    _not_found(http, "GET", f"/v1/responses/{ids[1]}")
    for rid in [ids[0], *ids[2:]]:
        assert _get(http, f"/v1/responses/{rid}")["id"] == rid
    r = http.post("/v1/responses", json={"input": "x", "previous_response_id": ids[1]})
    assert r.status_code == 404 and r.json()["error"]["param"] == "previous_response_id"


@pytest.mark.integration
def test_streamed_responses_are_stored_once_complete(http: httpx.Client) -> None:
    events = _stream(http, input="Name a color.", max_output_tokens=3)
    final = events[-1]["response"]
    assert events[0]["response"]["store"] is True and final["store"] is True
    assert _get(http, f"/v1/responses/{final['id']}") == final
    follow = _stream(http, input="Another.", previous_response_id=final["id"], max_output_tokens=2)[-1]["response"]
    assert follow["previous_response_id"] == final["id"]
    assert len(_get(http, f"/v1/responses/{follow['id']}/input_items")["data"]) == 3
    assert _stream(http, input="x", max_output_tokens=1, store=False)[-1]["response"]["store"] is False

    # an aborted stream is not stored
    rid = "responses-abort-test"
    kinds = []
    with http.stream("POST", "/v1/responses", json={"input": "Count from 1 to 500, separated by commas.",
                                                    "max_output_tokens": 1000, "temperature": 0, "stream": True,
                                                    "rid": rid}) as r:
        for line in r.iter_lines():
            if line.startswith("event: "):
                kinds.append(line[7:])
                if kinds[-1] == "response.output_text.delta" and kinds.count(kinds[-1]) == 1:
                    assert http.post("/abort_request", json={"rid": rid}).status_code == 200
    assert kinds[-1] == "error", kinds[-3:]
    _not_found(http, "GET", f"/v1/responses/resp_{rid}")


# ============================================================================================== server: no store
@pytest.fixture(scope="module")
def bare(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[httpx.Client]:
    """A server that stores nothing and reads SmolLM2's whole answer as reasoning (deepseek-r1: no </think>)."""
    args = ["--max-total-tokens", "4096", "--responses-store-size", "0", "--reasoning-parser", "deepseek-r1"]
    with serving(str(tmp_path_factory.mktemp("responses-bare") / "server.log"), args) as srv, \
            httpx.Client(base_url=srv.base, timeout=120) as c:
        yield c


@pytest.mark.integration
def test_a_server_that_stores_nothing(bare: httpx.Client) -> None:
    for body, param in [({"store": True}, "store"), ({"previous_response_id": "resp_1"}, "previous_response_id")]:
        r = bare.post("/v1/responses", json={"input": "x", "max_output_tokens": 1, **body})
        assert r.status_code == 400, r.text
        err = r.json()["error"]
        assert err["param"] == param and "--responses-store-size" in err["message"], err
    for store in (None, False):
        resp = _create(bare, input="Hi.", max_output_tokens=1, store=store)
        assert resp["store"] is False
    _not_found(bare, "GET", f"/v1/responses/{resp['id']}")


@pytest.mark.integration
def test_reasoning_summary_is_the_reasoning_text(bare: httpx.Client) -> None:
    body = {"input": "Why is the sky blue?", "max_output_tokens": 6}
    plain = _create(bare, **body)
    assert plain["output"][0]["type"] == "reasoning" and plain["output"][0]["summary"] == []
    thinking = plain["output"][0]["content"][0]["text"]
    assert thinking
    for reasoning in ({"summary": "auto"}, {"summary": "detailed"}, {"generate_summary": "auto"}):
        resp = _create(bare, **body, reasoning=reasoning)
        assert resp["output"][0]["summary"] == [{"type": "summary_text", "text": thinking}], resp
        assert resp["output"][0]["content"] == plain["output"][0]["content"]
        assert resp["reasoning"]["summary"] == next(iter(reasoning.values()))

    events = _stream(bare, **body, reasoning={"summary": "auto"})
    kinds = [e["type"] for e in events]
    n = kinds.count("response.reasoning_text.delta")
    expected = SUMMARY_KINDS[:3] + ["response.reasoning_text.delta", "response.reasoning_summary_text.delta"] * n + \
        SUMMARY_KINDS[7:]
    assert kinds[2:2 + len(expected)] == expected and n >= 1
    deltas = "".join(e["delta"] for e in events if e["type"] == "response.reasoning_summary_text.delta")
    done = next(e for e in events if e["type"] == "response.reasoning_summary_part.done")
    assert deltas == thinking == done["part"]["text"]
    assert events[-1]["response"]["output"][0]["summary"] == [{"type": "summary_text", "text": thinking}]

    r = bare.post("/v1/responses", json={**body, "reasoning": {"summary": "concise"}})
    assert r.status_code == 400 and r.json()["error"]["param"] == "reasoning.summary"
    assert "auto" in r.json()["error"]["message"]
