"""GPT-OSS's harmony output format: the `gpt-oss` reasoning and tool-call parsers on crafted outputs (the whole text,
and streamed one prefix at a time adding up to the same message), malformed output (never an exception, never a
marker in the content), the request-level wiring (special tokens kept, harmony read without a parser flag), and
one chat request end to end through `OpenAIServingChat` and the real detokenizer, with a byte-level tokenizer whose
harmony markers are special tokens and a scripted model output (no model, no process)."""

from __future__ import annotations

import asyncio
import json
import random
from collections.abc import AsyncIterator
from typing import Any

import pytest

from radixserve.entrypoints.openai.chat_output import ChoiceOutput, OutputConfig
from radixserve.entrypoints.openai.chat_tools import output_config, plan_tools
from radixserve.entrypoints.openai.harmony import MARKERS, read_messages
from radixserve.entrypoints.openai.protocol import ChatCompletionRequest
from radixserve.entrypoints.openai.reasoning_parsers import REASONING_PARSERS, get_reasoning_parser
from radixserve.entrypoints.openai.tool_parsers import TOOL_PARSERS, detect_tool_parser, get_tool_parser
from radixserve.server_args import ServerArgs

A = "<|channel|>analysis<|message|>"
NEXT = "<|end|><|start|>assistant"
WEATHER_ARGS = '{"location": "Paris", "note": "a } brace, a \\"quote\\" and <b>"}'

# name -> (model output, reasoning, content, calls [(name, arguments)])
CASES: dict[str, tuple[str, str, str, list[tuple[str, str]]]] = {
    "answer": (A + "Let me think... 2 + 2.\n" + NEXT + "<|channel|>final<|message|>The answer is 4.<|return|>",
               "Let me think... 2 + 2.\n", "The answer is 4.", []),
    "call, recipient after the channel": (
        A + "Need weather." + NEXT + "<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + WEATHER_ARGS + "<|call|>", "Need weather.", "", [("get_weather", WEATHER_ARGS)]),
    "call, recipient before the channel": (
        A + "Need weather." + NEXT + " to=functions.get_weather<|channel|>commentary json<|message|>" + WEATHER_ARGS
        + "<|call|>", "Need weather.", "", [("get_weather", WEATHER_ARGS)]),
    "preamble and two calls": (
        A + "Two lookups." + NEXT + "<|channel|>commentary<|message|>Checking both.<|end|>"
        + "<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>"
        + WEATHER_ARGS + "<|call|><|start|>assistant to=functions.get_time<|channel|>commentary json<|message|>"
        + "{}<|call|>", "Two lookups.", "Checking both.", [("get_weather", WEATHER_ARGS), ("get_time", "{}")]),
    "only analysis (cut off by max_tokens)": (A + "Still thinking about it", "Still thinking about it", "", []),
    "a header cut off": (A + "Done." + NEXT + "<|channel|>fin", "Done.", "", []),
    "no reasoning": ("<|channel|>final<|message|>Hi!<|return|>", "", "Hi!", []),
    "two analysis messages": (A + "one" + NEXT + "<|channel|>analysis<|message|>two" + NEXT
                              + "<|channel|>final<|message|>Yes.<|return|>", "one\ntwo", "Yes.", []),
    "no <|end|> before the next channel": (A + "hmm<|channel|>final<|message|>ok<|endoftext|>", "hmm", "ok", []),
    "no harmony markers": ("Just plain text, with <b>tags</b> and <|odd|> bits.", "",
                           "Just plain text, with <b>tags</b> and <|odd|> bits.", []),
}
TOOL_NAMES = frozenset({"get_weather", "get_time"})


def _cfg(reasoning: bool = True, names: frozenset[str] | None = TOOL_NAMES) -> OutputConfig:
    tools = get_tool_parser("gpt-oss")
    tools.tool_names = names
    return OutputConfig(reasoning=get_reasoning_parser("gpt-oss") if reasoning else None, tools=tools,
                        keep_special_tokens=True)


def _stream(cfg: OutputConfig, text: str, cuts: list[int]) -> tuple[str, str, list[tuple[str, str]]]:
    """(reasoning, content, calls) as a client adds up the deltas of the text cut at `cuts` (the last: len(text))."""
    out = ChoiceOutput(cfg)
    deltas = [d for end in cuts for d in out.deltas(text[:end], end == len(text))]
    calls: dict[int, list[str]] = {}
    for d in deltas:
        for tc in d.get("tool_calls", []):
            if "id" in tc:
                calls[tc["index"]] = [tc["function"]["name"], ""]
            calls[tc["index"]][1] += tc["function"]["arguments"]
    return ("".join(d.get("reasoning_content", "") for d in deltas), "".join(d.get("content", "") for d in deltas),
            [(n, a) for n, a in (calls[k] for k in sorted(calls))])


def _no_markers(*texts: str | None) -> None:
    for t in texts:
        assert t is None or not any(m in t for m in MARKERS), t


@pytest.mark.parametrize("case", sorted(CASES))
def test_whole_text(case: str) -> None:
    text, reasoning, content, calls = CASES[case]
    msg = ChoiceOutput(_cfg()).message(text)
    assert (msg["reasoning_content"] or "", msg["content"] or "") == (reasoning, content)
    assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])] == calls
    assert get_tool_parser("gpt-oss").parse(get_reasoning_parser("gpt-oss").split(text, True)[1]) == (content, calls)
    # without the reasoning parser the analysis is still never content
    alone = ChoiceOutput(_cfg(reasoning=False)).message(text)
    assert (alone["content"] or "", len(alone.get("tool_calls", []))) == (content, len(calls))
    _no_markers(msg["content"], msg["reasoning_content"], alone["content"])


@pytest.mark.parametrize("case", sorted(CASES))
def test_every_prefix_streams_to_the_final_message(case: str) -> None:
    text = CASES[case][0]
    r = get_reasoning_parser("gpt-oss")
    final = r.split(text, True)
    before = ("", "")
    for end in range(len(text) + 1):  # each split only grows, up to the final one
        now = r.split(text[:end], end == len(text))
        assert all(now[k].startswith(before[k]) and final[k].startswith(now[k]) for k in (0, 1)), (end, now)
        before = now
    msg = ChoiceOutput(_cfg()).message(text)
    want = (msg["reasoning_content"] or "", msg["content"] or "",
            [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls", [])])
    for cuts in (list(range(1, len(text) + 1)), list(range(7, len(text), 7)) + [len(text)]):
        got = _stream(_cfg(), text, cuts)
        assert got == want
        _no_markers(got[0], got[1])


def test_malformed_calls_are_content_and_never_raise() -> None:
    head = A + "x" + NEXT + "<|channel|>commentary to=functions."
    for text, content in [
        (head + 'get_weather <|constrain|>json<|message|>{"location": "Par<|call|>', '{"location": "Par'),
        (head + "get_weather json<|message|>[1, 2]<|call|>", "[1, 2]"),  # not an object
        (head + "nope json<|message|>{}<|call|>", "{}"),  # a function the request does not offer
        ("<|channel|>commentary to=python<|message|>print(1)<|call|>", "print(1)"),  # a built-in tool
        ("<|channel|>commentary<|message|>Let me look.<|end|>" + head.split(NEXT)[1] + "get_time json<|message|>"
         + "{oops}<|call|>", "Let me look.\n\n{oops}"),
    ]:
        cfg = _cfg()
        msg = ChoiceOutput(cfg).message(text)
        assert msg["content"] == content and "tool_calls" not in msg, text
        for step in (1, 5):
            _, s_content, _ = _stream(cfg, text, list(range(step, len(text), step)) + [len(text)])
            _no_markers(s_content)
            assert content.startswith(s_content)  # what was streamed before the bad call stays; nothing taken back


def test_noise_never_raises_nor_shows_markers() -> None:
    rng = random.Random(0)
    words = [*MARKERS, "analysis", "final", "commentary", " to=functions.get_time", " json", "{", "}", "{}", "hi",
             " ", "\n", "<|", "|>", "to=", "assistant"]
    for _ in range(300):
        text = "".join(rng.choice(words) for _ in range(rng.randint(0, 14)))
        for reasoning in (True, False):
            msg = ChoiceOutput(_cfg(reasoning)).message(text)
            streamed = _stream(_cfg(reasoning), text, list(range(1, len(text) + 1)) or [0])
            if any(m in text for m in MARKERS):  # (without any, the text is the content as it is)
                _no_markers(msg["content"], msg.get("reasoning_content"), *streamed[:2])


def test_messages_read() -> None:
    msgs = read_messages(CASES["preamble and two calls"][0], True)
    assert [(m.channel, m.function, m.closed) for m in msgs] == [
        ("analysis", None, True), ("commentary", None, True), ("commentary", "get_weather", True),
        ("commentary", "get_time", True)]
    # streaming: a half-written marker is held back, a header counts once `<|message|>` came
    assert read_messages(A + "abc<|e", False)[0].body == "abc"
    assert [m.channel for m in read_messages(A + "abc<|end|><|start|>assistant<|channel|>final", False)] == \
        ["analysis"]
    assert read_messages("<|channel|>final<|message|>x<|ret", True)[0].body == "x<|ret"


def test_without_tools_a_call_is_content_and_render_parses_back() -> None:
    text = "<|channel|>commentary to=functions.get_time json<|message|>{}<|call|>"
    msg = ChoiceOutput(_cfg(names=frozenset())).message(text)
    assert msg["content"] == "{}" and "tool_calls" not in msg
    p = get_tool_parser("gpt-oss")
    calls = [("get_weather", '{"city": "Paris"}'), ("get_time", "{}")]
    assert p.parse(p.render_calls(calls)) == ("", calls)
    assert "functions.<function name>" in p.format_instructions([{"function": {"name": "f"}}])


TEMPLATE = ("{% for m in messages %}<|start|>{{ m.role }}{% if m.role == 'assistant' %}<|channel|>final{% endif %}"
            "<|message|>{{ m.content }}<|end|>{% endfor %}{% if tools %}{{ tools | length }} tools{% endif %}"
            "<|start|>assistant")


def test_registry_detection_and_request_wiring() -> None:
    assert "gpt-oss" in TOOL_PARSERS and "gpt-oss" in REASONING_PARSERS
    assert detect_tool_parser(TEMPLATE) == "gpt-oss"
    assert ServerArgs(tool_call_parser="gpt-oss", reasoning_parser="gpt-oss").reasoning_parser == "gpt-oss"
    req = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}])
    # a harmony template without any parser flag: read as harmony, reasoning separated, special tokens kept
    cfg = output_config(req, plan_tools(req, None, TEMPLATE, grammar_ok=False), None, "")
    assert cfg.keep_special_tokens and cfg.reasoning is not None and cfg.tools is not None
    assert cfg.tools.tool_names == frozenset()
    # separate_reasoning false: the analysis is left out, not shown without its markers
    off = ChatCompletionRequest(messages=[{"role": "user", "content": "x"}], separate_reasoning=False)
    cfg = output_config(off, plan_tools(off, None, TEMPLATE, grammar_ok=False), "gpt-oss", "")
    msg = ChoiceOutput(cfg).message(CASES["answer"][0])
    assert cfg.keep_special_tokens and msg == {"role": "assistant", "content": "The answer is 4.", "refusal": None}
    # a JSON-schema grammar shapes the answer from its first token: no harmony
    assert not output_config(req, plan_tools(req, None, TEMPLATE, False), "gpt-oss", "", json_output=True
                             ).keep_special_tokens
    # other families are untouched
    plain = output_config(req, plan_tools(req, None, "<tool_call>", grammar_ok=False), "qwen3", "")
    assert not plain.keep_special_tokens and plain.tools is None


# ------------------------------------------------------------------------------------- end to end (no model)
def _harmony_tokenizer() -> Any:
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {ch: i for i, ch in enumerate(sorted(pre_tokenizers.ByteLevel.alphabet()))}
    tk = Tokenizer(models.BPE(vocab=vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    tok = PreTrainedTokenizerFast(tokenizer_object=tk, eos_token="<|return|>",
                                  additional_special_tokens=[m for m in MARKERS if m != "<|return|>"])
    tok.chat_template = TEMPLATE
    return tok


class _ScriptedEngine:
    """The tokenizer manager's part: every request "generates" `script` (token ids of the tokenizer), decoded by
    the real DetokenizerManager with the request's skip_special_tokens, a few tokens per step."""

    def __init__(self, tok: Any, server_args: ServerArgs) -> None:
        self.tokenizer, self.server_args = tok, server_args
        self.context_len, self.rid_to_state, self.lora_names, self.metrics = 4096, {}, None, None
        self.script: list[int] = []
        self.sampling: list[dict[str, Any]] = []

    def check_text_length(self, num_chars: int, param: str = "text") -> None:
        pass

    async def run_on_tokenizer_thread(self, fn: Any, *args: Any) -> Any:
        return fn(*args)

    async def generate_request(self, obj: Any) -> AsyncIterator[dict[str, Any]]:
        from radixserve.managers import io_struct as io
        from radixserve.managers.detokenizer_manager import DetokenizerManager

        sp = obj.sampling_params
        self.sampling.append(sp)
        detok = DetokenizerManager(self.tokenizer)
        text = ""
        for i in range(0, len(self.script), 3):
            done = i + 3 >= len(self.script)
            reason = {"type": "stop", "matched": self.script[-1]} if done else None
            out = detok.handle(io.BatchTokenIDOut(
                ["r"], [self.script[i:i + 3]], [reason], [{}], [sp.get("skip_special_tokens", True)],
                [sp.get("spaces_between_special_tokens", True)], [False], [[]]))
            text += out.text_deltas[0]
            if obj.stream or done:
                yield {"text": text, "index": 0, "meta_info": {"finish_reason": reason, "prompt_tokens": 1,
                                                               "completion_tokens": i + 3, "cached_tokens": 0}}


class _Client:
    async def receive(self) -> dict[str, Any]:
        await asyncio.Event().wait()  # never disconnects
        return {}


async def _chat(serving: Any, body: dict[str, Any]) -> Any:
    resp = await serving.create(_Client(), body)
    if not body.get("stream"):
        return json.loads(resp.body)
    chunks = [c async for c in resp.body_iterator]
    events = b"".join(c if isinstance(c, bytes) else c.encode() for c in chunks).decode().split("\n\n")
    return [json.loads(e[len("data: "):]) for e in events if e.startswith("data: {")]


@pytest.mark.parametrize("parser_flags", [{}, {"tool_call_parser": "gpt-oss", "reasoning_parser": "gpt-oss"}])
def test_chat_request_end_to_end(parser_flags: dict[str, str]) -> None:
    from radixserve.entrypoints.openai.serving_chat import OpenAIServingChat

    tok = _harmony_tokenizer()
    engine = _ScriptedEngine(tok, ServerArgs(**parser_flags))
    serving = OpenAIServingChat(engine, "gpt-oss", (), grammar_ok=False)  # type: ignore[arg-type]
    tools = [{"type": "function", "function": {"name": n, "parameters": {"type": "object"}}} for n in TOOL_NAMES]
    base: dict[str, Any] = {"model": "gpt-oss", "messages": [{"role": "user", "content": "Weather in Paris?"}]}

    async def scenario() -> None:
        for case, body in [("answer", base), ("preamble and two calls", {**base, "tools": tools})]:
            text, reasoning, content, calls = CASES[case]
            engine.script = tok.encode(text, add_special_tokens=False)
            assert engine.script[-1] in tok.all_special_ids  # the stop token, generated as one special token
            resp = await _chat(serving, body)
            choice = resp["choices"][0]
            msg = choice["message"]
            # (with the markers skipped, the parsers would see "analysisLet me think...assistantfinalThe answer")
            assert (msg["reasoning_content"], msg["content"]) == (reasoning, content)
            assert engine.sampling[-1]["skip_special_tokens"] is False
            assert [(c["function"]["name"], c["function"]["arguments"]) for c in msg.get("tool_calls") or []] == calls
            assert choice["finish_reason"] == ("tool_calls" if calls else "stop")
            chunks = await _chat(serving, {**body, "stream": True})
            deltas = [c["choices"][0] for c in chunks if c["choices"]]
            got = {k: "".join(d["delta"].get(k) or "" for d in deltas) for k in ("reasoning_content", "content")}
            assert got == {"reasoning_content": reasoning, "content": content}
            args = [tc["function"]["arguments"] for d in deltas for tc in d["delta"].get("tool_calls", [])]
            assert "".join(args) == "".join(a for _, a in calls)
            assert deltas[-1]["finish_reason"] == ("tool_calls" if calls else "stop")

    asyncio.run(scenario())
