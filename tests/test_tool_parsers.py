"""Tool-call and reasoning parsers on crafted model outputs: the final parse, and the stream (fed in small pieces)
adding up to the same content, reasoning and calls; malformed calls stay content; the constrained (forced) call
schema accepts exactly the calls it should (xgrammar)."""

from __future__ import annotations

import json

import pytest

from radixserve.entrypoints.openai.chat_output import ChoiceOutput, ForcedCallScanner, OutputConfig, forced_call_schema
from radixserve.entrypoints.openai.chat_tools import output_config, plan_tools
from radixserve.entrypoints.openai.errors import APIError
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from radixserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, detect_tool_parser, get_tool_parser
from radixserve.server_args import ServerArgs

WEATHER = ("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a "quoted" } brace'})
TIME = ("get_time", {})

OUTPUTS = {
    "hermes": ("Let me check.\n<tool_call>\n" + json.dumps({"name": WEATHER[0], "arguments": WEATHER[1]})
               + "\n</tool_call>\n<tool_call>\n" + json.dumps({"name": TIME[0], "arguments": TIME[1]})
               + "\n</tool_call>", "Let me check."),
    "llama3": ("<|python_tag|>" + json.dumps({"name": WEATHER[0], "parameters": WEATHER[1]}) + "; "
               + json.dumps({"name": TIME[0], "parameters": TIME[1]}), ""),
    "mistral": ("[TOOL_CALLS]" + json.dumps([{"name": WEATHER[0], "arguments": WEATHER[1]},
                                             {"name": TIME[0], "arguments": TIME[1]}]), ""),
}


def _stream(out: ChoiceOutput, text: str, step: int) -> tuple[str, str, list[tuple[str, str, str]]]:
    deltas = []
    cuts = list(range(step, len(text), step)) + [len(text)]
    for end in cuts:
        deltas += out.deltas(text[:end], end == len(text))
    content = "".join(d.get("content", "") for d in deltas)
    reasoning = "".join(d.get("reasoning_content", "") for d in deltas)
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:  # the first delta of a call: id, type and name, empty arguments
                assert tc["index"] not in calls and tc["type"] == "function" and tc["function"]["arguments"] == ""
                calls[tc["index"]] = [tc["id"], tc["function"]["name"], ""]
            else:
                calls[tc["index"]][2] += tc["function"]["arguments"]
    return content, reasoning, [tuple(calls[k]) for k in sorted(calls)]


@pytest.mark.parametrize("family", sorted(OUTPUTS))
@pytest.mark.parametrize("step", [1, 3, 17])
def test_family_final_and_stream_agree(family: str, step: int) -> None:
    text, content = OUTPUTS[family]
    parser = get_tool_parser(family)
    got_content, calls = parser.parse(text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in calls] == [WEATHER, TIME]
    s_content, _, s_calls = _stream(ChoiceOutput(OutputConfig(tools=parser)), text, step)
    assert s_content.strip() == content
    assert [(n, json.loads(a)) for _, n, a in s_calls] == [WEATHER, TIME]
    assert len({cid for cid, _, _ in s_calls}) == 2 and all(c.startswith("call_") for c, _, _ in s_calls)


@pytest.mark.parametrize("step", [1, 2, 5])
def test_stream_keeps_content_after_calls(step: int) -> None:
    """The newline after a block and the final strip never make the stream take back (and so lose) content."""
    block = '<tool_call>\n{"name": "f", "arguments": {"a": 1}}\n</tool_call>'
    for text, content in [(block + "\nDone.", "Done."), (block + "\n" + block + "Done.", "Done."),
                          ("Hi.\n" + block + "\n" + block + "\nBye.", "Hi.\nBye.")]:
        parser = get_tool_parser("hermes")
        assert parser.parse(text)[0] == content
        s_content, _, calls = _stream(ChoiceOutput(OutputConfig(tools=parser)), text, step)
        assert s_content.strip() == content and len(calls) == text.count("<tool_call>")


@pytest.mark.parametrize("family,text", [
    ("hermes", '<tool_call>\n{"name": "f"}\n</tool_call>'),
    ("llama3", '{"name": "f"}'),
    ("mistral", '[TOOL_CALLS][{"name": "f"}]'),
])
def test_stream_call_without_arguments_sends_an_object(family: str, text: str) -> None:
    parser = get_tool_parser(family)
    assert parser.parse(text) == ("", [("f", "{}")])
    for step in (1, 4):
        assert _stream(ChoiceOutput(OutputConfig(tools=parser)), text, step)[2][0][1:] == ("f", "{}")
    assert _stream(ChoiceOutput(OutputConfig(tools=ForcedCallScanner("f"))), "", 1)[2][0][1:] == ("f", "{}")


@pytest.mark.parametrize("family,text", [
    ("llama3", '{"name": "Bob", "age": 3}'),  # an answer in JSON, not a call
    ("hermes", 'Hi <tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>'),
    ("mistral", '[TOOL_CALLS][{"name": "nope", "arguments": {}}]'),
    ("mistral", '[TOOL_CALLS]nope[ARGS]{}'),
])
def test_call_to_a_function_not_offered_stays_content(family: str, text: str) -> None:
    parser = get_tool_parser(family)
    parser.tool_names = frozenset({"f", "get_time"})
    cfg = OutputConfig(tools=parser)
    msg = ChoiceOutput(cfg).message(text)
    assert msg["content"] == text and "tool_calls" not in msg
    for step in (1, 3):
        assert _stream(ChoiceOutput(cfg), text, step)[::2] == (text, [])
    assert ChoiceOutput(cfg).message(text.replace("Bob", "f").replace("nope", "f"))["tool_calls"]


def test_message_shape_with_calls() -> None:
    msg = ChoiceOutput(OutputConfig(tools=get_tool_parser("hermes"))).message(OUTPUTS["hermes"][0])
    assert msg["role"] == "assistant" and msg["content"] == "Let me check."
    assert [c["function"]["name"] for c in msg["tool_calls"]] == ["get_weather", "get_time"]
    assert all(c["type"] == "function" and c["id"].startswith("call_") for c in msg["tool_calls"])
    plain = ChoiceOutput(OutputConfig(tools=get_tool_parser("hermes"))).message("Just an answer.")
    assert plain["content"] == "Just an answer." and "tool_calls" not in plain


@pytest.mark.parametrize("family,text", [
    ("hermes", 'ok <tool_call>\n{"name": "f", "arguments": {"a": 1}\n</tool_call>'),  # unbalanced
    ("hermes", '<tool_call>\n{"arguments": {"a": 1}}\n</tool_call>'),  # no name
    ("hermes", '<tool_call>\n{"name": "f", "arguments": [1]}\n</tool_call>'),  # arguments not an object
    ("llama3", '{"name": "f", "parameters": {"a": 1}'),  # cut off
    ("llama3", '{"city": "Paris"}'),  # JSON, but not a call
    ("llama3", '{"name": "f", "parameters": {}} and then some prose'),
    ("mistral", '[TOOL_CALLS][{"name": "f", "arguments": {"a": 1}}'),  # array not closed
])
def test_malformed_calls_stay_content(family: str, text: str) -> None:
    content, calls = get_tool_parser(family).parse(text)
    assert calls == [] and content == text


def test_plain_text_streams_without_losing_marker_lookalikes() -> None:
    text = "Use <tool> tags or [TOOL] markers, then {braces}."
    for family in OUTPUTS:
        content, _, calls = _stream(ChoiceOutput(OutputConfig(tools=get_tool_parser(family))), text, 1)
        assert content == text and calls == []


def test_mistral_v11_and_stripped_marker() -> None:
    p = get_tool_parser("mistral")
    assert p.parse('[TOOL_CALLS]get_time[ARGS]{}[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}') == (
        "", [("get_time", "{}"), ("get_weather", '{"city": "Paris"}')])
    assert p.parse('[{"name": "get_time", "arguments": {}}]') == ("", [("get_time", "{}")])


def test_arguments_given_as_a_json_string() -> None:
    text = '<tool_call>\n{"name": "f", "arguments": "{\\"a\\": 1}"}\n</tool_call>'
    assert get_tool_parser("hermes").parse(text) == ("", [("f", '{"a": 1}')])
    _, _, calls = _stream(ChoiceOutput(OutputConfig(tools=get_tool_parser("hermes"))), text, 2)
    assert [(n, json.loads(a)) for _, n, a in calls] == [("f", {"a": 1})]


def test_render_calls_parse_back() -> None:
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    for family in OUTPUTS:
        p = get_tool_parser(family)
        assert p.parse(p.render_calls(calls))[1] == calls


def test_registry_detection_and_server_args_choices() -> None:
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    assert detect_tool_parser("[TOOL_CALLS] {{ tools }}") == "mistral"
    assert detect_tool_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert detect_tool_parser("{{ messages }}") is None
    assert {"hermes", "qwen25", "llama3", "mistral"} <= set(TOOL_PARSERS)
    with pytest.raises(ValueError, match="tool-call-parser"):
        ServerArgs(tool_call_parser="nope")
    with pytest.raises(ValueError, match="reasoning-parser"):
        ServerArgs(reasoning_parser="nope")
    assert ServerArgs(tool_call_parser="llama3", reasoning_parser="deepseek-r1").tool_call_parser == "llama3"
    # (gpt-oss: test_harmony.py; the others: test_tool_parsers_more.py)
    assert {"qwen3", "deepseek-r1", "gpt-oss", "glm45", "kimi", "minimax-m2"} <= set(REASONING_PARSERS)


# ---------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("step", [1, 4])
def test_reasoning_split_final_and_stream(step: int) -> None:
    r = get_reasoning_parser("qwen3")
    text = "<think>\nFirst, 2 + 2.\n</think>\n\nThe answer is 4."
    assert r.split(text, True) == ("First, 2 + 2.\n", "The answer is 4.")
    content, reasoning, _ = _stream(ChoiceOutput(OutputConfig(reasoning=r)), text, step)
    assert (reasoning, content) == ("First, 2 + 2.\n", "The answer is 4.")
    # no thinking block: all content (enable_thinking false); a lookalike prefix is released at the end
    assert r.split("Four.", True) == ("", "Four.")
    assert _stream(ChoiceOutput(OutputConfig(reasoning=r)), "<thin", 1)[0] == "<thin"


@pytest.mark.parametrize("in_reasoning", [False, True])
def test_reasoning_stream_with_leading_whitespace(in_reasoning: bool) -> None:
    """Whitespace before `<think>` is held back while streaming, not sent and then taken back."""
    for name in ("qwen3", "deepseek-r1"):  # the `<think>` styles
        r = get_reasoning_parser(name)
        text = "  \n<think>\nabc\n</think>\n\nThe answer."
        reasoning, content = r.split(text, True, in_reasoning)
        assert (reasoning, content) == ("abc\n", "The answer.")
        for step in (1, 3):
            cfg = OutputConfig(reasoning=r, prompt_opens_reasoning=in_reasoning)
            assert _stream(ChoiceOutput(cfg), text, step)[:2] == (content, reasoning)
    assert _stream(ChoiceOutput(OutputConfig(reasoning=get_reasoning_parser("qwen3"))), " \n", 1)[0] == " \n"


def test_reasoning_opened_by_the_prompt() -> None:
    r1 = get_reasoning_parser("deepseek-r1")
    assert r1.split("hmm...</think>Answer", True) == ("hmm...", "Answer")
    assert r1.split("cut off while thinking", True) == ("cut off while thinking", "")
    q = get_reasoning_parser("qwen3")
    assert q.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n")
    assert not q.prompt_opens_reasoning("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    assert q.split("thinking</think>done", True, in_reasoning=True) == ("thinking", "done")


def test_reasoning_then_tool_call() -> None:
    text = '<think>need weather</think>\n<tool_call>\n{"name": "get_time", "arguments": {}}\n</tool_call>'
    cfg = OutputConfig(reasoning=get_reasoning_parser("qwen3"), tools=get_tool_parser("hermes"))
    msg = ChoiceOutput(cfg).message(text)
    assert msg["reasoning_content"] == "need weather" and msg["content"] is None
    assert msg["tool_calls"][0]["function"] == {"name": "get_time", "arguments": "{}"}


def test_forced_call_is_not_read_as_reasoning() -> None:
    """A JSON-schema grammar shapes the answer from its first token: with a parser whose answers start inside the
    thinking block (deepseek-r1), the forced call is still the call, not reasoning_content."""
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS,
                                tool_choice={"type": "function", "function": {"name": "get_weather"}})
    plan = plan_tools(req, None, None, grammar_ok=True)
    cfg = output_config(req, plan, "deepseek-r1", "<|im_start|>assistant\n<think>\n", json_output=True)
    msg = ChoiceOutput(cfg).message('{"city": "Paris", "days": 2}')
    assert msg["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris", "days": 2}'}
    assert msg.get("reasoning_content") is None
    assert output_config(req, plan, "deepseek-r1", "", json_output=False).reasoning is not None


@pytest.mark.parametrize("parameters", [{"type": "string"}, {"type": "array", "items": {}},
                                        {"type": ["object", "null"]}])
def test_parameters_must_describe_an_object(parameters: dict) -> None:
    tools = [{"type": "function", "function": {"name": "f", "parameters": parameters}}]
    for choice in ("auto", "required", {"type": "function", "function": {"name": "f"}}):
        req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=tools, tool_choice=choice)
        with pytest.raises(APIError, match="must be 'object'") as e:
            plan_tools(req, None, None, grammar_ok=True)
        assert e.value.param == "tools[0].function.parameters"
    for fine in ({}, {"type": ["object"]}, {"type": {"not": "a type"}}, {"type": [{}]}):  # (the grammar judges these)
        ok = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}],
                                   tools=[{"type": "function", "function": {"name": "f", "parameters": fine}}])
        plan = plan_tools(ok, None, None, grammar_ok=True)
        assert plan.mode == "auto" and plan.parser.tool_names == {"f"}


# ---------------------------------------------------------------------------------------------- forced calls
TOOLS = [{"type": "function", "function": {"name": "get_weather", "parameters": {
    "type": "object", "properties": {"city": {"type": "string"}, "days": {"type": "integer"}},
    "required": ["city", "days"], "additionalProperties": False}}},
    {"type": "function", "function": {"name": "get_time"}}]


def test_forced_scanner() -> None:
    named = ForcedCallScanner("get_weather")
    assert named.parse('{"city": "Paris", "days": 2}') == ("", [("get_weather", '{"city": "Paris", "days": 2}')])
    req = ForcedCallScanner(None)
    text = ('[{"name": "get_weather", "parameters": {"city": "Oslo", "days": 1}}, '
            '{"name": "get_time", "parameters": {}}]')
    assert [n for n, _ in req.parse(text)[1]] == ["get_weather", "get_time"]
    # cut off by max_tokens: every call begun, the cut one's arguments as far as they got (as OpenAI returns it);
    # the grammar's text never content
    assert req.parse(text[:-20]) == ("", [("get_weather", '{"city": "Oslo", "days": 1}'), ("get_time", "")])
    assert req.parse(text[:45]) == ("", [("get_weather", '{"city')])
    assert req.parse(text[:8]) == ("", [])  # no name read yet
    assert named.parse('{"city": "Par') == ("", [("get_weather", '{"city": "Par')])
    _, _, calls = _stream(ChoiceOutput(OutputConfig(tools=req)), text, 5)
    assert [(n, json.loads(a)) for _, n, a in calls] == [("get_weather", {"city": "Oslo", "days": 1}),
                                                          ("get_time", {})]
    # a complete answer and a streamed one agree, cut anywhere
    for scanner in (req, named):
        full = text if scanner is req else '{"city": "Paris", "days": 2}'
        for cut in range(1, len(full) + 1):
            msg = ChoiceOutput(OutputConfig(tools=scanner)).message(full[:cut])
            content, _, streamed = _stream(ChoiceOutput(OutputConfig(tools=scanner)), full[:cut], 3)
            assert msg["content"] is None and content == "", (cut, msg)
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == \
                [(n, a) for _, n, a in streamed], cut


def test_forced_call_schema_accepts_exactly_valid_calls() -> None:
    xgr = pytest.importorskip("xgrammar")

    def accepts(schema: str, text: str) -> bool:
        return xgr.testing._is_grammar_accept_string(xgr.Grammar.from_json_schema(schema, any_whitespace=False), text)

    named = forced_call_schema(TOOLS, "get_weather", True)
    assert accepts(named, '{"city": "Paris", "days": 2}')
    assert not accepts(named, '{"city": "Paris"}') and not accepts(named, '{"city": 1, "days": 2}')
    required = forced_call_schema(TOOLS, None, True)
    assert accepts(required, '[{"name": "get_weather", "parameters": {"city": "Paris", "days": 2}}, '
                             '{"name": "get_time", "parameters": {}}]')
    assert not accepts(required, "[]")
    assert not accepts(required, '[{"name": "get_weather", "parameters": {}}]')
    assert not accepts(required, '[{"name": "nope", "parameters": {}}]')
    single = forced_call_schema(TOOLS, None, False)
    assert accepts(single, '[{"name": "get_time", "parameters": {}}]')
    assert not accepts(single, '[{"name": "get_time", "parameters": {}}, {"name": "get_time", "parameters": {}}]')


def test_required_schema_keeps_local_refs() -> None:
    """Parameters with `$defs` / `$ref` (the openai SDK's `pydantic_function_tool` of nested models): with
    "required" each function's schema sits inside the array's, and its refs must still resolve there."""
    xgr = pytest.importorskip("xgrammar")
    from radixserve.constrained import validate_grammar

    loc = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"],
           "additionalProperties": False}
    weather = {"type": "function", "function": {"name": "get_weather", "parameters": {
        "$defs": {"Loc": loc}, "type": "object", "properties": {"loc": {"$ref": "#/$defs/Loc"}}, "required": ["loc"],
        "additionalProperties": False}}}
    tree = {"type": "function", "function": {"name": "tree", "parameters": {
        "type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#"}}}, "required": ["kids"],
        "additionalProperties": False}}}
    for tools in ([weather], [weather, tree], [tree]):
        schema = forced_call_schema(tools, None, True)
        validate_grammar("xgrammar", "json_schema", schema)
        grammar = xgr.Grammar.from_json_schema(schema, any_whitespace=False)
        names = {t["function"]["name"] for t in tools}
        for text, ok in [('[{"name": "get_weather", "parameters": {"loc": {"city": "Oslo"}}}]', "get_weather" in names),
                         ('[{"name": "get_weather", "parameters": {"loc": {"town": "Oslo"}}}]', False),
                         ('[{"name": "tree", "parameters": {"kids": [{"kids": []}]}}]', "tree" in names),
                         ('[{"name": "tree", "parameters": {"kids": [{"kid": []}]}}]', False)]:
            assert xgr.testing._is_grammar_accept_string(grammar, text) == ok, (tools, text)
    assert json.loads(forced_call_schema([weather], "get_weather", True)) == weather["function"]["parameters"]


MISTRAL_TEMPLATE = (  # the id checks of Mistral's templates (Mistral-7B-Instruct-v0.3, Nemo)
    "{%- for m in messages %}{%- if m.role == 'assistant' and m.tool_calls %}[TOOL_CALLS][{%- for c in m.tool_calls %}"
    "{%- if c.id is not defined or c.id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric "
    "strings with length 9!') }}{%- endif %}{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments|tojson }}, \"id\": \"{{ c.id }}\"}{%- endfor %}]</s>{%- elif m.role == 'tool' %}"
    "{%- if m.tool_call_id|length != 9 %}{{ raise_exception('Tool call IDs should be alphanumeric strings with "
    "length 9!') }}{%- endif %}[TOOL_RESULTS]{{ m.content }}[/TOOL_RESULTS]{%- else %}[INST]{{ m.content }}[/INST]"
    "{%- endif %}{%- endfor %}")


@pytest.mark.parametrize("stream", [False, True])
def test_mistral_call_ids_come_back_through_its_template(stream: bool) -> None:
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    from radixserve.entrypoints.openai.chat_tools import template_messages

    user = {"role": "user", "content": "Weather in Paris?"}
    req = ChatCompletionRequest(messages=[user], tools=TOOLS)
    plan = plan_tools(req, None, MISTRAL_TEMPLATE, grammar_ok=True)
    assert plan.format_parser.name == "mistral"
    out = ChoiceOutput(output_config(req, plan, None, ""))
    text = '[TOOL_CALLS][{"name": "get_time", "arguments": {}}]'
    if stream:
        (call_id,) = [c[0] for c in _stream(out, text, 3)[2]]
    else:
        call_id = out.message(text)["tool_calls"][0]["id"]
    assert len(call_id) == 9 and call_id.isalnum()
    history = ChatCompletionRequest(messages=[user, {"role": "assistant", "tool_calls": [
        {"id": call_id, "type": "function", "function": {"name": "get_time", "arguments": "{}"}}]},
        {"role": "tool", "tool_call_id": call_id, "content": "12:00"}], tools=TOOLS)
    messages = template_messages(history, plan, MISTRAL_TEMPLATE, lambda m, i: m.content or "")
    env = ImmutableSandboxedEnvironment()
    env.globals["raise_exception"] = lambda msg: (_ for _ in ()).throw(ValueError(msg))
    assert "[TOOL_RESULTS]12:00" in env.from_string(MISTRAL_TEMPLATE).render(messages=messages)
