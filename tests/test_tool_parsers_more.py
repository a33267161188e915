"""The tool-call parsers of the newer families (pythonic, DeepSeek-V3 / V3.1, GLM-4.5, Qwen3-Coder, Kimi-K2,
MiniMax-M2) and their reasoning parsers, on crafted model outputs: one call, two calls, content before the calls,
the stream (fed in small pieces) adding up to the final message with no marker in the content, unfinished or
malformed calls staying content, values converted by the request's schemas, detection from chat-template snippets,
and the request wiring that keeps the markers' special tokens (and drops the other special tokens)."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import pytest
from test_harmony import _chat, _ScriptedEngine
from test_tool_parsers import _stream

from radixserve.entrypoints.openai.chat_output import ChoiceOutput, OutputConfig
from radixserve.entrypoints.openai.chat_tools import output_config, plan_tools
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from radixserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, detect_tool_parser, get_tool_parser
from radixserve.entrypoints.openai.tool_parsers.markup import convert_value
from radixserve.server_args import ServerArgs

WEATHER = ("get_weather", {"city": "Paris", "days": [1, 2], "note": 'a "quoted" } <b> brace'})
TIME = ("get_time", {})
DS_CALLS, DS_CALL, DS_SEP, DS_END, DS_CALLS_END = ("<｜tool▁calls▁begin｜>", "<｜tool▁call▁begin｜>", "<｜tool▁sep｜>",
                                                  "<｜tool▁call▁end｜>", "<｜tool▁calls▁end｜>")
KIMI = ("<|tool_calls_section_begin|>", "<|tool_call_begin|>", "<|tool_call_argument_begin|>", "<|tool_call_end|>",
        "<|tool_calls_section_end|>")


def _one(family: str, name: str, args: dict[str, Any], k: int = 0) -> str:
    """One call written the way `family` writes it (values as the model would write them)."""
    a = json.dumps(args)
    if family == "pythonic":
        return f"{name}(" + ", ".join(f"{key}={v!r}" for key, v in args.items()) + ")"
    if family == "deepseekv3":
        return f"{DS_CALL}function{DS_SEP}{name}\n```json\n{a}\n```{DS_END}"
    if family == "deepseekv31":
        return f"{DS_CALL}{name}{DS_SEP}{a}{DS_END}"
    if family == "kimi_k2":
        return f"{KIMI[1]}functions.{name}:{k}{KIMI[2]}{a}{KIMI[3]}"
    text = {key: v if isinstance(v, str) else json.dumps(v) for key, v in args.items()}
    if family == "glm45":
        return f"<tool_call>{name}\n" + "".join(f"<arg_key>{key}</arg_key>\n<arg_value>{v}</arg_value>\n"
                                                for key, v in text.items()) + "</tool_call>"
    if family == "qwen3_coder":
        return f"<tool_call>\n<function={name}>\n" + "".join(f"<parameter={key}>\n{v}\n</parameter>\n"
                                                             for key, v in text.items()) + "</function>\n</tool_call>"
    if family == "minimax-m2":
        return f'<invoke name="{name}">\n' + "".join(f'<parameter name="{key}">{v}</parameter>\n'
                                                      for key, v in text.items()) + "</invoke>"
    raise ValueError(family)


def _answer(family: str, calls: list[tuple[str, dict[str, Any]]], content: str = "") -> str:
    """An answer: `content` then the calls, in `family`'s section / block markup."""
    parts = [_one(family, n, a, k) for k, (n, a) in enumerate(calls)]
    if family == "pythonic":
        body = "[" + ", ".join(parts) + "]"
        return f"{content}<|python_start|>{body}<|python_end|>" if content else body
    if family.startswith("deepseek"):
        return content + DS_CALLS + "\n".join(parts) + DS_CALLS_END
    if family == "kimi_k2":
        return content + KIMI[0] + "".join(parts) + KIMI[4]
    if family == "minimax-m2":
        return content + "<minimax:tool_call>\n" + "\n".join(parts) + "\n</minimax:tool_call>"
    return content + "\n".join(parts)


FAMILIES = ["pythonic", "deepseekv3", "deepseekv31", "glm45", "qwen3_coder", "kimi_k2", "minimax-m2"]
# texts that must never reach the content of a well-formed answer
MARKER_BITS = ("<|python", "｜", "<|tool", "<tool_call", "<arg_", "<function", "<parameter", "invoke", "minimax:",
               "```")


def _check(family: str, text: str, content: str, calls: list[tuple[str, dict[str, Any]]]) -> None:
    parser = get_tool_parser(family)
    got_content, got = parser.parse(text)
    assert got_content == content
    assert [(n, json.loads(a)) for n, a in got] == calls
    msg = ChoiceOutput(OutputConfig(tools=get_tool_parser(family))).message(text)
    assert msg["content"] == (content or None)
    for step in (1, 3, 8):
        s_content, _, s_calls = _stream(ChoiceOutput(OutputConfig(tools=get_tool_parser(family))), text, step)
        assert s_content.strip() == content, (family, step)
        assert not any(bit in s_content for bit in MARKER_BITS), s_content
        assert [(n, json.loads(a)) for _, n, a in s_calls] == calls, (family, step)


@pytest.mark.parametrize("family", FAMILIES)
def test_one_call(family: str) -> None:
    _check(family, _answer(family, [WEATHER]), "", [WEATHER])


@pytest.mark.parametrize("family", FAMILIES)
def test_two_calls_after_content(family: str) -> None:
    _check(family, _answer(family, [WEATHER, TIME]), "", [WEATHER, TIME])
    _check(family, _answer(family, [WEATHER, TIME], "Let me check.\n"), "Let me check.", [WEATHER, TIME])


@pytest.mark.parametrize("family", FAMILIES)
def test_unfinished_or_malformed_call_stays_content(family: str) -> None:
    parser = get_tool_parser(family)
    full = _answer(family, [WEATHER], "Let me check.\n")
    cut = full[: full.index("Paris") + 3]  # cut off inside the arguments
    assert parser.parse(cut) == (cut, [])
    # while streaming, the content before the call goes out, the call is announced: nothing is taken back
    s_content, _, _ = _stream(ChoiceOutput(OutputConfig(tools=get_tool_parser(family))), cut, 2)
    assert s_content.strip() == "Let me check."
    bad = {"pythonic": "[get_weather(city=Paris)]",  # a name, not a literal
           "deepseekv3": f"{DS_CALLS}{DS_CALL}function{DS_SEP}get_weather\n```json\n[1]\n```{DS_END}{DS_CALLS_END}",
           "deepseekv31": f"{DS_CALLS}{DS_CALL}get_weather{DS_SEP}not json{DS_END}{DS_CALLS_END}",
           "kimi_k2": f"{KIMI[0]}{KIMI[1]}functions.get_weather:0{KIMI[2]}{{\"a\": }}{KIMI[3]}{KIMI[4]}",
           "glm45": "<tool_call>get_weather\n<arg_value>Paris</arg_value>\n</tool_call>",  # no key
           "qwen3_coder": "<tool_call>\n<parameter=city>\nParis\n</parameter>\n</tool_call>",  # no function
           "minimax-m2": "<minimax:tool_call>\n<parameter name=\"city\">x</parameter>\n</minimax:tool_call>"}[family]
    assert parser.parse(bad) == (bad, [])


@pytest.mark.parametrize("family", FAMILIES)
def test_function_not_offered_and_render_parse_back(family: str) -> None:
    parser = get_tool_parser(family)
    parser.tool_names = frozenset({"get_time"})
    text = _answer(family, [WEATHER])
    assert parser.parse(text) == (text, [])
    calls = [("get_weather", json.dumps(WEATHER[1])), ("get_time", "{}")]
    written = get_tool_parser(family).render_calls(calls)
    assert [(n, json.loads(a)) for n, a in get_tool_parser(family).parse(written)[1]] == [WEATHER, TIME]
    assert get_tool_parser(family).call_format_hint()


SCHEMA = {"type": "object", "properties": {
    "city": {"type": "string"}, "zip": {"type": "string"}, "days": {"type": "integer"}, "temp": {"type": "number"},
    "metric": {"type": "boolean"}, "opts": {"type": "object"}, "tags": {"type": "array"},
    "maybe": {"type": ["integer", "null"]}, "unit": {"enum": ["c", "f"]}}}


@pytest.mark.parametrize("family", ["glm45", "qwen3_coder", "minimax-m2"])
def test_values_follow_the_request_schema(family: str) -> None:
    written = {"city": "Paris", "zip": "01234", "days": "3", "temp": "21.5", "metric": "true",
               "opts": "{'deep': {'a': 1}}", "tags": '["x", 2]', "maybe": "null", "unit": "c"}
    text = _answer(family, [("f", written)])
    parser = get_tool_parser(family)
    parser.tool_params = {"f": SCHEMA}
    (_, args), = parser.parse(text)[1]
    assert json.loads(args) == {"city": "Paris", "zip": "01234", "days": 3, "temp": 21.5, "metric": True,
                                "opts": {"deep": {"a": 1}}, "tags": ["x", 2], "maybe": None, "unit": "c"}
    # no schema: JSON when it reads as JSON, else the text
    (_, args), = get_tool_parser(family).parse(text)[1]
    assert json.loads(args)["zip"] == "01234" and json.loads(args)["days"] == 3 and json.loads(args)["city"] == "Paris"


def test_convert_value_edge_cases() -> None:
    assert convert_value("3.0", {"type": "integer"}) == 3
    assert convert_value("three", {"type": "integer"}) == "three"  # not the type: kept as written
    assert convert_value("7", {"anyOf": [{"type": "integer"}, {"type": "string"}]}) == 7
    assert convert_value("  x \n", {"type": "string"}) == "  x \n"
    assert convert_value("[1,", None) == "[1,"
    assert convert_value("__import__('os')", {"type": "object"}) == "__import__('os')"


def test_pythonic_details() -> None:
    p = get_tool_parser("pythonic")
    assert p.parse('[f(a=true, b=null, c=-2, d=(1, 2), e={"k": [None]}),]') == (
        "", [("f", '{"a": true, "b": null, "c": -2, "d": [1, 2], "e": {"k": [null]}}')])
    assert p.parse("<|python_start|>f(x='a)b')<|python_end|> done") == ("done", [("f", '{"x": "a)b"}')])
    for text in ("[1, 2, 3]", "[link](http://x)", "[f(1)]", "[f(x=y)]", "[f(x=1)] and more", "[f(**k)]",
                 "Call [f(x=1)]"):
        assert p.parse(text) == (text, []), text
        assert _stream(ChoiceOutput(OutputConfig(tools=get_tool_parser("pythonic"))), text, 1)[0] in ("", text)


def test_kimi_call_ids_name_the_function() -> None:
    text = _answer("kimi_k2", [WEATHER, TIME])
    msg = ChoiceOutput(OutputConfig(tools=get_tool_parser("kimi_k2"),
                                    call_id=get_tool_parser("kimi_k2").call_id)).message(text)
    assert [c["id"] for c in msg["tool_calls"]] == ["functions.get_weather:0", "functions.get_time:1"]


def test_detection_from_chat_templates() -> None:
    snippets = {
        "pythonic": "{%- if tools %}<|python_start|>{{ tool_call }}<|python_end|>{% endif %}"
                    "<|header_start|>ipython<|header_end|>",
        "deepseekv3": "{{'<｜Assistant｜><｜tool▁calls▁begin｜><｜tool▁call▁begin｜>' + tool['type'] + "
                      "'<｜tool▁sep｜>' + "
                      "tool['function']['name'] + '\\n' + '```json' + '\\n' + tool['function']['arguments'] + '\\n' + "
                      "'```' + '<｜tool▁call▁end｜>'}}",
        "deepseekv31": "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>' + "
                       "tool['function']['arguments'] + '<｜tool▁call▁end｜>'}}",
        "glm45": "<tool_call>{{ tc.name }}\n{% for k, v in tc.arguments.items() %}<arg_key>{{ k }}</arg_key>\n"
                 "<arg_value>{{ v }}</arg_value>\n{% endfor %}</tool_call>",
        "qwen3_coder": "{{- '<tool_call>\\n<function=' + tool_call.name + '>\\n' }}{{- '<parameter=' + args_name + "
                       "'>\\n' }}",
        "kimi_k2": "<|tool_calls_section_begin|>{% for tc in message.tool_calls %}<|tool_call_begin|>{{ tc.id }}"
                   "<|tool_call_argument_begin|>{{ tc.function.arguments }}<|tool_call_end|>{% endfor %}",
        "minimax-m2": "{{- '<minimax:tool_call>' + '\\n' }}{{- '<invoke name=\"' + tool_call.name + '\">' }}",
    }
    for family, template in snippets.items():
        assert detect_tool_parser(template) == family, family
    assert detect_tool_parser("<|start_header_id|>ipython<|end_header_id|>") == "llama3"
    assert detect_tool_parser("{% if tools %}<tool_call>{% endif %}") == "hermes"
    for name in FAMILIES + ["deepseek_v3", "deepseek_v31", "minimax_m2", "llama4_pythonic"]:
        assert name in TOOL_PARSERS and ServerArgs(tool_call_parser=name).tool_call_parser == name


# ---------------------------------------------------------------------------------------------- reasoning
@pytest.mark.parametrize("name,start,end", [("glm45", "<think>", "</think>"), ("kimi", "◁think▷", "◁/think▷"),
                                            ("minimax-m2", "<think>", "</think>")])
def test_reasoning_parsers(name: str, start: str, end: str) -> None:
    r = get_reasoning_parser(name)
    text = f"{start}\nLet me think.\n{end}\n\nThe answer is 4."
    assert r.split(text, True) == ("Let me think.\n", "The answer is 4.")
    assert r.split("The answer is 4.", True) == ("", "The answer is 4.")
    assert r.split(f"Let me think.{end}Four.", True, r.prompt_opens_reasoning(f"prompt{start}\n")) == (
        "Let me think.", "Four.")
    _, reasoning, _ = _stream(ChoiceOutput(OutputConfig(reasoning=r)), text, 1)
    assert reasoning == "Let me think.\n"
    for alias in ("deepseek-v3", "qwen3-thinking", "minimax_m2"):
        assert alias in REASONING_PARSERS and get_reasoning_parser(alias)


def test_reasoning_then_glm_call() -> None:
    text = "<think>Weather.</think>\n" + _answer("glm45", [WEATHER])
    msg = ChoiceOutput(OutputConfig(reasoning=get_reasoning_parser("glm45"),
                                    tools=get_tool_parser("glm45"))).message(text)
    assert msg["reasoning_content"] == "Weather." and msg["content"] is None
    assert json.loads(msg["tool_calls"][0]["function"]["arguments"]) == WEATHER[1]


# ------------------------------------------------------------------------------------- special tokens kept
TOOLS = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}}
         for n in ("get_weather", "get_time")]


def test_output_config_keeps_markers_and_hides_other_special_tokens() -> None:
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS)
    specials = ["<|im_end|>", "<|tool_call_begin|>", "<|tool_calls_section_begin|>", "<|im_middle|>"]
    cfg = output_config(req, plan_tools(req, "kimi_k2", None, grammar_ok=False), None, "", special_tokens=specials)
    assert cfg.keep_special_tokens and set(cfg.hidden_tokens) == {"<|im_end|>", "<|im_middle|>"}
    text = "Sure." + _answer("kimi_k2", [WEATHER]) + "<|im_end|>"
    msg = ChoiceOutput(cfg).message(text)
    assert msg["content"] == "Sure." and msg["tool_calls"][0]["id"] == "functions.get_weather:0"
    out = ChoiceOutput(cfg)  # (the detokenizer gives a special token's text whole)
    deltas = [d for text, final in [("Plain ", False), ("Plain answer.", False), ("Plain answer.<|im_end|>", True)]
              for d in out.deltas(text, final)]
    assert "".join(d.get("content", "") for d in deltas) == "Plain answer."
    # tool_choice none, or a family whose markers are plain text: special tokens skipped as usual
    none = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], tools=TOOLS, tool_choice="none")
    assert not output_config(none, plan_tools(none, "kimi_k2", None, False), None, "").keep_special_tokens
    assert not output_config(req, plan_tools(req, "qwen3_coder", None, False), "qwen3", "").keep_special_tokens


def _tokenizer(specials: list[str]) -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|im_end|>", additional_special_tokens=specials)
    tok.chat_template = ("{% for m in messages %}{{ m.role }}: {{ m.content }}\n{% endfor %}"
                         "{% if tools %}<|tool_calls_section_begin|>{% endif %}assistant:")
    return tok


def test_chat_request_keeps_kimi_markers_through_the_detokenizer() -> None:
    from radixserve.entrypoints.openai.serving_chat import OpenAIServingChat

    tok = _tokenizer(list(KIMI))
    engine = _ScriptedEngine(tok, ServerArgs())  # the parser detected from the template
    serving = OpenAIServingChat(engine, "kimi", (), grammar_ok=False)  # type: ignore[arg-type]
    body: dict[str, Any] = {"model": "kimi", "messages": [{"role": "user", "content": "Weather?"}], "tools": TOOLS}
    text = "Let me check." + _answer("kimi_k2", [WEATHER, TIME]) + "<|im_end|>"

    async def scenario() -> None:
        engine.script = tok.encode(text, add_special_tokens=False)
        skipped = tok.decode(engine.script, skip_special_tokens=True)  # what the parser would see by default
        assert not any(m in skipped for m in KIMI) and "functions.get_weather:0" in skipped
        resp = await _chat(serving, body)
        msg = resp["choices"][0]["message"]
        assert engine.sampling[-1]["skip_special_tokens"] is False
        assert msg["content"] == "Let me check." and resp["choices"][0]["finish_reason"] == "tool_calls"
        assert [(c["id"], c["function"]["name"], json.loads(c["function"]["arguments"])) for c in msg["tool_calls"]
                ] == [("functions.get_weather:0", *WEATHER), ("functions.get_time:1", *TIME)]
        chunks = await _chat(serving, {**body, "stream": True})
        deltas = [c["choices"][0]["delta"] for c in chunks if c["choices"]]
        assert "".join(d.get("content") or "" for d in deltas) == "Let me check."
        args = "".join(tc["function"]["arguments"] for d in deltas for tc in d.get("tool_calls", []))
        assert args == json.dumps(WEATHER[1]) + "{}"

    asyncio.run(scenario())
