"""The HTTP server as users see it: a real `python -m radixserve.launch_server` process on a free loopback port
(the embedded SmolLM2, a small KV pool), driven with the official `openai` client, httpx and raw SSE.

Order matters only at the end: the last test stops the server with SIGTERM."""

from __future__ import annotations

import asyncio
import json
import os
import random
import signal
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families
from server_utils import Server, serving

from radixserve.bench_serving import scrape_ttft_stages, stage_means_ms

pytestmark = pytest.mark.integration  # every test here starts processes

API_KEY = "sk-test-radixserve"
AUTH = {"Authorization": f"Bearer {API_KEY}"}
MAX_QUEUED = 100
MODEL = "SmolLM2-135M-Instruct"
COUNT_PROMPT = "1, 2, 3, 4, 5,"
GRACE_S = 20.0  # ample for a 3-token request on a loaded CI machine


@pytest.fixture(scope="module")
def server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    args = ["--max-total-tokens", "4096", "--enable-metrics", "--api-key", API_KEY, "--max-queued-requests",
            str(MAX_QUEUED), "--watchdog-timeout", "5", "--graceful-shutdown-timeout", str(GRACE_S)]
    with serving(str(tmp_path_factory.mktemp("server") / "server.log"), args) as srv:
        yield srv


@pytest.fixture(scope="module")
def http(server: Server) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server.base, headers=AUTH, timeout=120) as c:
        yield c


@pytest.fixture(scope="module")
def client(server: Server) -> openai.OpenAI:
    return openai.OpenAI(base_url=server.base + "/v1", api_key=API_KEY, max_retries=0, timeout=120)


def internal_state(http: httpx.Client) -> dict[str, Any]:
    r = http.get("/get_internal_state")
    assert r.status_code == 200, r.text
    return r.json()


def wait_idle(http: httpx.Client, timeout: float = 30.0) -> dict[str, Any]:
    deadline = time.monotonic() + timeout
    while True:
        st = internal_state(http)
        if st["idle"] and st["num_inflight_requests"] == 0:
            return st
        if time.monotonic() > deadline:
            raise AssertionError(f"server not idle after {timeout} s: {st}")
        time.sleep(0.1)


def assert_no_leak(http: httpx.Client) -> None:
    st = wait_idle(http)
    assert st["memory_ok"] is True, st
    assert st["protected_tokens"] == 0, st
    assert st["free_tokens"] + st["evictable_tokens"] == st["max_total_num_tokens"], st


def sse_payloads(lines: Iterator[str]) -> list[Any]:
    """The data payloads of an SSE stream; the last one must be [DONE]."""
    out: list[Any] = []
    for line in lines:
        if not line.startswith("data: "):
            assert line == "", line
            continue
        data = line[len("data: "):]
        out.append(data if data == "[DONE]" else json.loads(data))
    return out


# ====================================================================== basics
def test_health_models_and_info(server: Server, http: httpx.Client) -> None:
    assert httpx.get(server.base + "/health").status_code == 200  # no key needed
    models = http.get("/v1/models").json()
    assert models["object"] == "list" and models["data"][0]["id"] == MODEL
    assert http.get(f"/v1/models/{MODEL}").json()["id"] == MODEL
    info = http.get("/get_model_info").json()
    assert info["is_generation"] is True and info["context_length"] == 8192 and info["vocab_size"] == 49152
    sinfo = http.get("/get_server_info").json()
    assert sinfo["api_key"] == "***" and sinfo["max_total_tokens"] == 4096
    assert http.get("/version").json()["version"]
    hg = http.get("/health_generate")
    assert hg.status_code == 200 and len(hg.json()["output_ids"]) == 1


def concurrently(*calls: Callable[[], Any]) -> list[Any]:
    """Run independent requests at once (the engine batches them; greedy output does not depend on batching)."""
    with ThreadPoolExecutor(len(calls)) as pool:
        return [f.result() for f in [pool.submit(c) for c in calls]]


def test_completions_openai_client(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": "The capital of France is", "max_tokens": 8, "temperature": 0}
    r, chunks = concurrently(
        lambda: client.completions.create(**kw),
        lambda: list(client.completions.create(**kw, stream=True, stream_options={"include_usage": True})))
    assert r.object == "text_completion" and len(r.choices) == 1
    assert "Paris" in r.choices[0].text and r.choices[0].finish_reason == "length"
    assert r.usage.prompt_tokens == 5 and r.usage.completion_tokens == 8 and r.usage.total_tokens == 13
    assert r.usage.prompt_tokens_details.cached_tokens >= 0
    # greedy streaming concatenates to exactly the non-streamed text; include_usage adds a final usage chunk
    text = "".join(c.choices[0].text for c in chunks if c.choices)
    assert text == r.choices[0].text
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 8
    assert chunks[-1].usage.prompt_tokens == 5
    # a second identical request hits the radix cache
    again = client.completions.create(**{**kw, "max_tokens": 1})
    assert again.usage.prompt_tokens_details.cached_tokens > 0


def test_chat_openai_client(client: openai.OpenAI) -> None:
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "What is 2+2?"}]
    parts = [msgs[0], {"role": "user", "content": [{"type": "text", "text": "What is "},
                                                   {"type": "text", "text": "2+2?"}]}]
    kw = {"model": MODEL, "max_tokens": 8, "temperature": 0}
    r, chunks, r2 = concurrently(
        lambda: client.chat.completions.create(messages=msgs, **kw),
        lambda: list(client.chat.completions.create(messages=msgs, **kw, stream=True,
                                                    stream_options={"include_usage": True})),
        lambda: client.chat.completions.create(messages=parts, **kw))
    assert r.object == "chat.completion"
    msg = r.choices[0].message
    assert msg.role == "assistant" and msg.content
    assert r.usage.completion_tokens <= 8 and r.usage.prompt_tokens > 10
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == msg.content
    assert chunks[-1].usage.completion_tokens == r.usage.completion_tokens
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == r.choices[0].finish_reason
    assert r2.choices[0].message.content == msg.content  # content as a list of text parts means the same


def test_n2_sampling(client: openai.OpenAI) -> None:
    r, rc, chunks = concurrently(
        lambda: client.completions.create(model=MODEL, prompt="My favourite animal is", max_tokens=5,
                                          temperature=1.0, n=2, seed=7),
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Name a colour."}],
                                               max_tokens=5, temperature=1.0, n=2, seed=3),
        lambda: list(client.completions.create(model=MODEL, prompt="My favourite pet is", max_tokens=4, n=2,
                                               temperature=0, stream=True)))
    assert sorted(c.index for c in r.choices) == [0, 1]
    assert 2 <= r.usage.completion_tokens <= 10 and r.usage.prompt_tokens == 4
    assert [c.index for c in rc.choices] == [0, 1] and all(c.message.content is not None for c in rc.choices)
    # streamed n=2: every index gets its own finish reason
    finished = {c.choices[0].index for c in chunks if c.choices and c.choices[0].finish_reason}
    assert finished == {0, 1}
    texts = ["".join(c.choices[0].text for c in chunks if c.choices and c.choices[0].index == i) for i in (0, 1)]
    assert texts[0] == texts[1] and texts[0]  # greedy: both samples agree


def test_stop_strings(client: openai.OpenAI) -> None:
    kw = {"model": MODEL, "prompt": COUNT_PROMPT, "max_tokens": 10, "temperature": 0}
    full, r, chunks, chat = concurrently(
        lambda: client.completions.create(**kw),
        lambda: client.completions.create(**kw, stop=[" 8"]),
        lambda: list(client.completions.create(**kw, stop=" 8", stream=True)),
        lambda: client.chat.completions.create(model=MODEL, messages=[{"role": "user", "content": "Count: 1, 2, 3"}],
                                               max_tokens=10, temperature=0, stop=["4"]))
    assert full.choices[0].text.startswith(" 6, 7, 8"), full.choices[0].text
    assert r.choices[0].text == " 6, 7," and r.choices[0].finish_reason == "stop"
    assert "".join(c.choices[0].text for c in chunks) == " 6, 7,"
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert "4" not in chat.choices[0].message.content


def test_logprobs(client: openai.OpenAI) -> None:
    hi = [{"role": "user", "content": "Hi"}]
    r, echo, chat, streamed = concurrently(
        lambda: client.completions.create(model=MODEL, prompt=COUNT_PROMPT, max_tokens=5, temperature=0, logprobs=2),
        lambda: client.completions.create(model=MODEL, prompt=COUNT_PROMPT, max_tokens=2, temperature=0, logprobs=1,
                                          echo=True),
        lambda: client.chat.completions.create(model=MODEL, messages=hi, max_tokens=4, temperature=0, logprobs=True,
                                               top_logprobs=3),
        lambda: list(client.chat.completions.create(model=MODEL, messages=hi, max_tokens=4, temperature=0,
                                                    logprobs=True, stream=True)))
    lp = r.choices[0].logprobs
    assert len(lp.tokens) == len(lp.token_logprobs) == len(lp.top_logprobs) == 5
    assert "".join(lp.tokens) == r.choices[0].text
    for tok, val, top in zip(lp.tokens, lp.token_logprobs, lp.top_logprobs, strict=True):
        assert val <= 0 and len(top) <= 2
        assert abs(max(top.values()) - val) < 1e-4 and tok in top  # greedy picks the top token
    text = r.choices[0].text
    assert lp.text_offset[0] == 0  # counted from the start of the returned text
    for tok, off in zip(lp.tokens, lp.text_offset, strict=True):
        assert text[off:].startswith(tok)
    assert echo.choices[0].text.startswith(COUNT_PROMPT)
    elp = echo.choices[0].logprobs
    assert elp.token_logprobs[0] is None and len(elp.tokens) == echo.usage.prompt_tokens + 2
    for tok, off in zip(elp.tokens, elp.text_offset, strict=True):
        assert echo.choices[0].text[off:].startswith(tok)
    assert elp.text_offset[echo.usage.prompt_tokens] == len(COUNT_PROMPT)
    content = chat.choices[0].logprobs.content
    assert len(content) == chat.usage.completion_tokens
    assert "".join(c.token for c in content) == chat.choices[0].message.content
    assert all(len(c.top_logprobs) == 3 and c.top_logprobs[0].logprob >= c.logprob - 1e-4 for c in content)
    toks = [e.token for c in streamed if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    assert toks == [c.token for c in content]


# ====================================================================== native API
def test_native_generate(http: httpx.Client) -> None:
    greedy = {"max_new_tokens": 6, "temperature": 0}

    def stream() -> list[Any]:
        with http.stream("POST", "/generate", json={"text": COUNT_PROMPT, "sampling_params": greedy,
                                                    "stream": True}) as r:
            assert r.headers["content-type"].startswith("text/event-stream")
            return sse_payloads(r.iter_lines())

    one, batch, by_ids, lp, payloads = concurrently(
        lambda: http.post("/generate", json={"text": COUNT_PROMPT, "sampling_params": greedy}).json(),
        lambda: http.post("/generate", json={"text": [COUNT_PROMPT, "Hello"], "sampling_params": greedy}).json(),
        lambda: http.post("/generate", json={"input_ids": [[16, 28, 216, 17, 28]], "sampling_params": greedy}),
        lambda: http.post("/generate", json={"text": COUNT_PROMPT, "sampling_params": greedy, "return_logprob": True,
                                             "top_logprobs_num": 2, "return_text_in_logprobs": True}).json(),
        stream)
    assert one["meta_info"]["completion_tokens"] == 6 and one["meta_info"]["finish_reason"]["type"] == "length"
    assert not any(k.startswith("_") for k in one["meta_info"])  # the scheduler's time stamps stay internal
    assert isinstance(batch, list) and batch[0]["text"] == one["text"] and batch[1]["index"] == 1
    assert by_ids.status_code == 200 and by_ids.json()[0]["meta_info"]["prompt_tokens"] == 5
    entries = lp["meta_info"]["output_token_logprobs"]
    assert len(entries) == 6 and "".join(e[2] for e in entries) == one["text"]
    assert payloads[-1] == "[DONE]" and len(payloads) > 2
    assert payloads[-2]["text"] == one["text"]  # cumulative chunks
    assert payloads[-2]["meta_info"]["finish_reason"]["type"] == "length"


def test_abort_request_endpoint(http: httpx.Client) -> None:
    body = {"text": "Tell me a long story.", "rid": "abort-me", "stream": True,
            "sampling_params": {"max_new_tokens": 2000, "ignore_eos": True, "temperature": 0}}
    start = time.monotonic()
    with http.stream("POST", "/generate", json=body) as r:
        lines = r.iter_lines()
        first = next(line for line in lines if line.startswith("data: "))
        assert json.loads(first[6:])["meta_info"]["finish_reason"] is None
        assert http.post("/abort_request", json={"rid": "abort-me"}).json()["success"] is True
        payloads = sse_payloads(lines)
    assert payloads[-1] == "[DONE]"
    assert payloads[-2]["meta_info"]["finish_reason"]["type"] == "abort"
    assert time.monotonic() - start < 30
    assert_no_leak(http)


@pytest.mark.parametrize("n", [1, 2])
def test_abort_request_spares_a_rid_that_only_starts_with_it(server: Server, http: httpx.Client, n: int) -> None:
    """Aborting rid `job` aborts that request (with n = 2: both its samples, `job-0` and `job-1`), not another
    client's `job-2` (a prefix match for n > 1's samples aborted it too)."""
    def run(rid: str, n: int) -> Any:
        body = {"text": "Tell me a long story.", "rid": rid,
                "sampling_params": {"max_new_tokens": 48, "ignore_eos": True, "temperature": 0, "n": n}}
        return httpx.post(server.base + "/generate", json=body, headers=AUTH, timeout=120).json()

    with ThreadPoolExecutor(2) as pool:
        futures = [pool.submit(run, "job", n), pool.submit(run, "job-2", 1)]
        deadline = time.monotonic() + 30
        while internal_state(http)["num_inflight_requests"] < n + 1 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.post("/abort_request", json={"rid": "job"}).json() == {"success": True, "aborted": n}
        job, other = (f.result() for f in futures)
    for out in job if n > 1 else [job]:
        assert out["meta_info"]["finish_reason"]["type"] == "abort"
    assert other["meta_info"]["finish_reason"]["type"] == "length", other
    assert_no_leak(http)


def test_abort_request_of_an_openai_batch_aborts_its_prompts(server: Server, http: httpx.Client) -> None:
    """A completions request with several prompts runs them under `rid-p0`, `rid-p1`: aborting its rid aborts both
    (and the samples of each with n = 2)."""
    def run() -> Any:
        body = {"model": MODEL, "prompt": ["Tell me a story.", "Write a poem."], "rid": "batch", "n": 2,
                "max_tokens": 48, "ignore_eos": True, "temperature": 0}
        return httpx.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=120).json()

    with ThreadPoolExecutor(1) as pool:
        future = pool.submit(run)
        deadline = time.monotonic() + 30
        while internal_state(http)["num_inflight_requests"] < 4 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert http.post("/abort_request", json={"rid": "batch"}).json() == {"success": True, "aborted": 4}
        out = future.result()
    assert out["error"]["code"] == "request_aborted", out  # a non-streamed OpenAI answer that was aborted
    assert_no_leak(http)


def test_nonstream_disconnect_aborts(server: Server, http: httpx.Client) -> None:
    """A client that goes away before a (long) non-streamed answer aborts its request."""
    body = {"model": MODEL, "prompt": "Write an essay.", "max_tokens": 3000, "ignore_eos": True}
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(server.base + "/v1/completions", json=body, headers=AUTH, timeout=1.5)
    st = wait_idle(http, timeout=20)  # 3000 tokens would take minutes on the CPU
    assert st["memory_ok"] is True


@pytest.mark.parametrize("rids", [["dup", "dup", "dup"], ["par", "par-0"]], ids=["same-rid", "child-rid"])
def test_concurrent_requests_under_one_rid_never_hang(server: Server, http: httpx.Client, rids: list[str]) -> None:
    """Concurrent n > 1 requests under one rid (or a rid one of them gives a sample, `rid-0`): one is served, the
    others get a 400 naming the rid. (They registered their rids only after the shared prefill: the later one took
    the first one's state, which then waited forever.)"""
    def run(rid: str) -> tuple[int, str]:
        body = {"text": "Hello there", "rid": rid, "sampling_params": {"max_new_tokens": 16, "n": 2}}
        r = httpx.post(server.base + "/generate", json=body, headers=AUTH, timeout=60)
        return r.status_code, r.text

    with ThreadPoolExecutor(len(rids)) as pool:
        results = list(pool.map(run, rids))
    assert sorted(status for status, _ in results)[0] == 200, results
    for status, text in results:
        assert status in (200, 400), text
        if status == 400:
            assert "already in use" in json.loads(text)["error"]["message"], text
    assert_no_leak(http)


# ====================================================================== what real clients send
def test_sdk_multi_turn_chat(client: openai.OpenAI, http: httpx.Client) -> None:
    """The SDK's own response message appended to the history (refusal/annotations/audio/function_call/tool_calls
    as null), plus null or default values of fields we do not implement: accepted, and they change nothing."""
    history = [{"role": "user", "content": "Say hi."}]
    first = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0)
    history += [first.choices[0].message.model_dump(), {"role": "user", "content": "Again."}]
    assert history[1]["refusal"] is None and "tool_calls" in history[1]
    second = client.chat.completions.create(model=MODEL, messages=history, max_tokens=4, temperature=0, user="u1",
                                            store=False, metadata={"k": "v"}, parallel_tool_calls=False)
    assert second.choices[0].finish_reason in ("stop", "length")
    body = {"model": MODEL, "messages": history, "max_tokens": 4, "temperature": 0}
    plain = http.post("/v1/chat/completions", json=body).json()
    noop = {"tools": None, "tool_choice": "none", "functions": None, "function_call": None,
            "reasoning_effort": None, "service_tier": "auto", "modalities": ["text"], "lora_path": None}
    with_noop = http.post("/v1/chat/completions", json={**body, **noop}).json()
    assert with_noop["choices"][0]["message"]["content"] == plain["choices"][0]["message"]["content"]
    assert with_noop["choices"][0]["message"]["content"] == second.choices[0].message.content


def test_sglang_native_client(http: httpx.Client) -> None:
    """SGLang's bench_serving: /generate with its fields (text or input_ids, streamed) and /get_server_info's
    internal_states."""
    body = {"text": COUNT_PROMPT, "sampling_params": {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True},
            "stream": True, "lora_path": None, "return_logprob": False, "logprob_start_len": -1}
    with http.stream("POST", "/generate", json=body) as r:
        assert r.status_code == 200
        payloads = sse_payloads(r.iter_lines())
    assert payloads[-1] == "[DONE]" and payloads[-2]["meta_info"]["completion_tokens"] == 3
    ids = http.post("/generate", json={**body, "stream": False}).json()
    assert ids["text"] == payloads[-2]["text"]
    body_ids = {**body, "stream": False, "text": None, "input_ids": ids["output_ids"]}
    del body_ids["text"]
    assert http.post("/generate", json=body_ids).status_code == 200
    info = http.get("/get_server_info").json()
    state = info["internal_states"][0]
    assert "avg_spec_accept_length" in state and state["last_gen_throughput"] >= 0
    assert info["engine_alive"] is True


# ====================================================================== bad requests
_LONG = "hello " * 9000
C, CH, G = "/v1/completions", "/v1/chat/completions", "/generate"
OK_MSGS = [{"role": "user", "content": "hi"}]
BAD: list[tuple[str, str, str, Any, int, str]] = [
    # (id, method, path, body, status, substring of the message)
    ("max_tokens-string", "POST", C, {"prompt": "x", "max_tokens": "5"}, 400, "max_tokens"),
    ("temperature-high", "POST", C, {"prompt": "x", "temperature": 5}, 400, "temperature"),
    ("temperature-negative", "POST", C, {"prompt": "x", "temperature": -1}, 400, "temperature"),
    ("top_p-zero", "POST", C, {"prompt": "x", "top_p": 0}, 400, "top_p"),
    ("top_p-high", "POST", C, {"prompt": "x", "top_p": 1.5}, 400, "top_p"),
    ("n-zero", "POST", C, {"prompt": "x", "n": 0}, 400, "n:"),
    ("n-huge", "POST", C, {"prompt": "x", "n": 1000}, 400, "n:"),
    ("presence-range", "POST", C, {"prompt": "x", "presence_penalty": 3}, 400, "presence_penalty"),
    ("frequency-type", "POST", C, {"prompt": "x", "frequency_penalty": "a"}, 400, "frequency_penalty"),
    ("logprobs-range", "POST", C, {"prompt": "x", "logprobs": 50}, 400, "logprobs"),
    ("unknown-field", "POST", C, {"prompt": "x", "foo": 1}, 400, "foo"),
    ("suffix-unsupported", "POST", C, {"prompt": "x", "suffix": "y"}, 400, "suffix"),
    ("prompt-empty", "POST", C, {"prompt": ""}, 400, "prompt"),
    ("prompt-empty-list", "POST", C, {"prompt": []}, 400, "prompt"),
    ("prompt-int", "POST", C, {"prompt": 5}, 400, "prompt"),
    ("prompt-missing", "POST", C, {"max_tokens": 3}, 400, "prompt"),
    ("token-out-of-range", "POST", C, {"prompt": [1, 99999999]}, 400, "input_ids"),
    ("prompt-too-long", "POST", C, {"prompt": _LONG, "max_tokens": 1}, 400, "maximum context length"),
    ("completion-too-long", "POST", C, {"prompt": "x", "max_tokens": 100000}, 400, "maximum context length"),
    ("unknown-model", "POST", C, {"prompt": "x", "model": "gpt-9"}, 404, "does not exist"),
    ("stop-type", "POST", C, {"prompt": "x", "stop": 5}, 400, "stop"),
    ("stop-token-ids", "POST", C, {"prompt": "x", "stop_token_ids": [-1]}, 400, "stop_token_ids"),
    ("logit-bias-key", "POST", C, {"prompt": "x", "logit_bias": {"abc": 1}}, 400, "logit_bias"),
    ("logit-bias-value", "POST", C, {"prompt": "x", "logit_bias": {"5": 1000}}, 400, "logit_bias"),
    ("seed-negative", "POST", C, {"prompt": "x", "seed": -1}, 400, "seed"),
    ("top_k-zero", "POST", C, {"prompt": "x", "top_k": 0}, 400, "top_k"),
    ("min-above-max", "POST", C, {"prompt": "x", "min_tokens": 50, "max_tokens": 5}, 400, "min_tokens"),
    ("stream-options-no-stream", "POST", C, {"prompt": "x", "stream_options": {"include_usage": True}}, 400,
     "stream_options"),
    ("best_of", "POST", C, {"prompt": "x", "best_of": 3}, 400, "best_of"),
    ("stream-type", "POST", C, {"prompt": "x", "stream": "yes"}, 400, "stream"),
    ("repetition-zero", "POST", C, {"prompt": "x", "repetition_penalty": 0}, 400, "repetition_penalty"),
    ("regex-invalid", "POST", C, {"prompt": "x", "regex": "(ab"}, 400, "regex"),
    ("chat-empty-messages", "POST", CH, {"messages": []}, 400, "messages"),
    ("chat-missing-messages", "POST", CH, {"max_tokens": 3}, 400, "messages"),
    ("chat-bad-role", "POST", CH, {"messages": [{"role": "wizard", "content": "x"}]}, 400, "role"),
    ("chat-content-int", "POST", CH, {"messages": [{"role": "user", "content": 5}]}, 400, "content"),
    ("chat-content-none", "POST", CH, {"messages": [{"role": "user"}]}, 400, "content"),
    ("chat-image", "POST", CH, {"messages": [{"role": "user", "content": [{"type": "image_url",
                                                                          "image_url": {"url": "x"}}]}]}, 400,
     "only 'text'"),
    ("chat-top-logprobs-alone", "POST", CH, {"messages": OK_MSGS, "top_logprobs": 2}, 400, "top_logprobs"),
    ("chat-max-completion-zero", "POST", CH, {"messages": OK_MSGS, "max_completion_tokens": 0}, 400,
     "max_completion_tokens"),
    ("chat-response-format", "POST", CH, {"messages": OK_MSGS, "response_format": {"type": "xml"}}, 400,
     "response_format"),
    ("chat-tools", "POST", CH, {"messages": OK_MSGS, "tools": [{"type": "function", "function": {"name": "a b"}}]},
     400, "tools"),
    ("chat-tool-choice", "POST", CH, {"messages": OK_MSGS, "tool_choice": "required"}, 400, "tool_choice"),
    ("embeddings-on-generation-server", "POST", "/v1/embeddings", {"input": "x"}, 400, "--is-embedding"),
    ("chat-store", "POST", CH, {"messages": OK_MSGS, "store": True}, 400, "store"),
    ("chat-lora", "POST", CH, {"messages": OK_MSGS, "lora_path": "x"}, 400, "LoRA"),
    ("chat-history-tool-calls", "POST", CH, {"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "f", "arguments": "[1]"}}]}]}, 400, "tool_calls"),
    ("chat-schema-description", "POST", CH, {"messages": OK_MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "x", "description": "a person", "schema": {"type": "object"}}}},
     400, "description"),
    ("chat-schema-on-json-object", "POST", CH, {"messages": OK_MSGS, "response_format": {
        "type": "json_object", "json_schema": {"name": "x", "schema": {"type": "object"}}}}, 400,
     "only with type 'json_schema'"),
    ("chat-text-part-with-image", "POST", CH, {"messages": [{"role": "user", "content": [
        {"type": "text", "text": "x", "image_url": {"url": "http://a/b.png"}}]}]}, 400, "carries only text"),
    ("chat-schema-name", "POST", CH, {"messages": OK_MSGS, "response_format": {
        "type": "json_schema", "json_schema": {"name": "no spaces allowed", "schema": {"type": "object"}}}}, 400,
     "json_schema.name"),
    ("chat-too-long", "POST", CH, {"messages": [{"role": "user", "content": _LONG}]}, 400, "maximum context length"),
    ("native-text-and-ids", "POST", G, {"text": "x", "input_ids": [1]}, 400, "exactly one"),
    ("native-unknown-sampling", "POST", G, {"text": "x", "sampling_params": {"bogus": 1}}, 400, "bogus"),
    ("native-negative-max", "POST", G, {"text": "x", "sampling_params": {"max_new_tokens": -1}}, 400,
     "max_new_tokens"),
    ("native-batch-one-rid", "POST", G, {"text": ["a", "b"], "rid": "r"}, 400, "rid"),
    ("native-batch-same-rids", "POST", G, {"text": ["a", "b"], "rid": ["d", "d"],
                                           "sampling_params": {"max_new_tokens": 1}}, 400, "more than one request"),
    ("native-batch-n-rids", "POST", G, {"text": ["a", "b"], "rid": ["e", "e-0"],
                                        "sampling_params": [{"n": 2, "max_new_tokens": 1}, {"max_new_tokens": 1}]},
     400, "more than one request"),
    ("native-logprob-start", "POST", G, {"text": "x", "return_logprob": True, "logprob_start_len": -100}, 400,
     "logprob_start_len"),
    ("native-top-logprobs", "POST", G, {"text": "x", "return_logprob": True, "top_logprobs_num": 50}, 400,
     "top_logprobs_num"),
    ("native-empty-ids", "POST", G, {"input_ids": []}, 400, "empty"),
    ("native-unknown-field", "POST", G, {"text": "x", "max_tokens": 3}, 400, "max_tokens"),
    ("native-too-long", "POST", G, {"input_ids": [16] * 10, "sampling_params": {"max_new_tokens": 9000}}, 400,
     "maximum context length"),
    ("native-lora", "POST", G, {"text": "x", "lora_path": "adapter"}, 400, "LoRA"),
    ("native-logit-processor", "POST", G, {"text": "x", "custom_logit_processor": "p"}, 400,
     "custom_logit_processor"),
    ("malformed-json", "POST", C, b'{"prompt": "x",', 400, "malformed JSON"),
    ("json-array", "POST", C, b'[1, 2]', 400, "JSON object"),
    ("empty-body", "POST", CH, b"", 400, "empty"),
    ("unknown-route", "POST", "/v1/nope", {}, 404, "Invalid URL"),
    ("wrong-method", "GET", C, None, 405, "not allowed"),
    ("unknown-model-card", "GET", "/v1/models/gpt-9", None, 404, "does not exist"),
    ("abort-without-rid", "POST", "/abort_request", {}, 400, "rid"),
    ("overloaded-n", "POST", C, {"prompt": "x", "n": MAX_QUEUED + 1, "max_tokens": 1}, 503, "overloaded"),
    ("overloaded-batch", "POST", G, {"text": ["x"] * (MAX_QUEUED + 1)}, 503, "overloaded"),
]


@pytest.mark.parametrize("method,path,body,status,needle", [b[1:] for b in BAD], ids=[b[0] for b in BAD])
def test_bad_request(http: httpx.Client, method: str, path: str, body: Any, status: int, needle: str) -> None:
    if isinstance(body, bytes):
        r = http.request(method, path, content=body, headers={"Content-Type": "application/json"})
    else:
        r = http.request(method, path, json=body)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert needle in err["message"], err


@pytest.mark.parametrize("headers", [{}, {"Authorization": "Bearer wrong"}, {"Authorization": API_KEY}],
                         ids=["missing-key", "wrong-key", "no-bearer"])
def test_bad_api_key(server: Server, headers: dict[str, str]) -> None:
    r = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=headers)
    assert r.status_code == 401 and "API key" in r.json()["error"]["message"]
    assert httpx.get(server.base + "/get_model_info", headers=headers).status_code == 401
    assert httpx.get(server.base + "/health", headers=headers).status_code == 200


def test_bad_requests_leave_server_healthy(server: Server, http: httpx.Client, client: openai.OpenAI) -> None:
    assert len(BAD) + 3 >= 30
    assert httpx.get(server.base + "/health").status_code == 200
    head = httpx.head(server.base + "/health")
    assert head.status_code == 200 and head.content == b""
    r = client.completions.create(model=MODEL, prompt=COUNT_PROMPT, max_tokens=3, temperature=0)
    assert r.choices[0].text.startswith(" 6")
    with pytest.raises(openai.BadRequestError) as ei:
        client.chat.completions.create(model=MODEL, messages=[], max_tokens=3)
    assert ei.value.status_code == 400
    with pytest.raises(openai.NotFoundError):
        client.completions.create(model="nope", prompt="x", max_tokens=1)
    assert_no_leak(http)


def test_scheduler_rejection_while_streaming(http: httpx.Client) -> None:
    # input ids that only the scheduler rejects (the KV pool is 4096 tokens, the context 8192). The server waits
    # for the first output before answering, so this is a plain 400; were it later, an SSE error event + [DONE]
    ids = [16] * 5000
    with http.stream("POST", "/generate", json={"input_ids": ids, "stream": True,
                                                "sampling_params": {"max_new_tokens": 1}}) as r:
        if r.status_code == 200:
            payloads = sse_payloads(r.iter_lines())
            assert payloads[-1] == "[DONE]" and "error" in payloads[-2]
        else:
            r.read()
            assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]
    # in a batch, the good prompt may already be streaming when the bad one fails: then the error is an event
    with http.stream("POST", "/generate", json={"input_ids": [[16, 17, 18], ids], "stream": True,
                                                "sampling_params": {"max_new_tokens": 4}}) as r:
        if r.status_code == 200:
            payloads = sse_payloads(r.iter_lines())
            assert payloads[-1] == "[DONE]" and "KV pool" in payloads[-2]["error"]["message"]
        else:
            r.read()
            assert r.status_code == 400 and "KV pool" in r.json()["error"]["message"]
    assert_no_leak(http)


# ====================================================================== load
async def _stream_client(ac: httpx.AsyncClient, i: int, prompt: str, rng: random.Random) -> tuple[str, str | None]:
    """One streaming client; returns (text, finish_reason) or (partial, None) when it hung up on purpose."""
    hang_up_after = rng.choice([None, None, 1, 2, 3])
    body = {"model": MODEL, "prompt": prompt, "max_tokens": 8, "temperature": 0, "stream": True}
    text, reason, n = "", None, 0
    async with ac.stream("POST", "/v1/completions", json=body) as r:
        assert r.status_code == 200, await r.aread()
        async for line in r.aiter_lines():
            if not line.startswith("data: "):
                continue
            if line == "data: [DONE]":
                return text, reason
            chunk = json.loads(line[6:])
            assert "error" not in chunk, chunk
            text += chunk["choices"][0]["text"]
            reason = chunk["choices"][0]["finish_reason"] or reason
            n += 1
            if hang_up_after is not None and n >= hang_up_after:
                return text, None  # leaving the block closes the connection mid-stream
    raise AssertionError(f"client {i}: stream ended without [DONE]")


def test_64_concurrent_streams_with_disconnects(client: openai.OpenAI, http: httpx.Client) -> None:
    prompts = [COUNT_PROMPT, "The capital of France is", "Once upon a time", "def fibonacci(n):"]
    ref = client.completions.create(model=MODEL, prompt=prompts, max_tokens=8, temperature=0)
    expected = {p: c.text for p, c in zip(prompts, ref.choices, strict=True)}
    http.post("/flush_cache")
    rng = random.Random(1234)

    async def run() -> list[tuple[str, str, str | None]]:
        limits = httpx.Limits(max_connections=80, max_keepalive_connections=0)
        async with httpx.AsyncClient(base_url=str(http.base_url), headers=AUTH, timeout=120, limits=limits) as ac:
            order = [prompts[i % len(prompts)] for i in range(64)]
            results = await asyncio.gather(*(_stream_client(ac, i, p, rng) for i, p in enumerate(order)))
        return [(p, t, r) for p, (t, r) in zip(order, results, strict=True)]

    results = asyncio.run(run())
    completed = [(p, t, r) for p, t, r in results if r is not None]
    hung_up = len(results) - len(completed)
    assert 10 <= hung_up <= 54 and completed
    for p, text, reason in completed:
        assert reason in ("length", "stop")
        assert text == expected[p], (p, text, expected[p])
    assert_no_leak(http)
    assert http.post("/flush_cache").json()["success"] is True
    st = internal_state(http)
    assert st["free_tokens"] == st["max_total_num_tokens"], st


# ====================================================================== metrics, cache, health
def _scrape(http: httpx.Client) -> dict[str, float]:
    r = http.get("/metrics")
    assert r.status_code == 200
    out: dict[str, float] = {}
    for fam in text_string_to_metric_families(r.text):
        for s in fam.samples:
            out[s.name] = out.get(s.name, 0.0) + s.value
    return out


def test_metrics_move(server: Server, client: openai.OpenAI, http: httpx.Client) -> None:
    before = _scrape(http)
    stages_before = scrape_ttft_stages(server.base, API_KEY) or {}
    stages_before = {k: stages_before.get(k, (0.0, 0.0)) for k in ("dispatch", "queue", "prefill", "deliver")}
    for name in ("radixserve:num_running_reqs", "radixserve:num_queue_reqs", "radixserve:token_usage",
                 "radixserve:cache_hit_rate", "radixserve:time_to_first_token_seconds_count",
                 "radixserve:inter_token_latency_seconds_count", "radixserve:e2e_request_latency_seconds_count"):
        assert name in before, name
    chunks = list(client.completions.create(model=MODEL, prompt="Metrics test prompt", max_tokens=5, temperature=0,
                                            stream=True, stream_options={"include_usage": True},
                                            extra_body={"ignore_eos": True}))
    prompt_tokens = chunks[-1].usage.prompt_tokens
    client.completions.create(model=MODEL, prompt="Metrics test prompt", max_tokens=3, temperature=0,
                              extra_body={"ignore_eos": True})
    after = _scrape(http)
    stages_after = scrape_ttft_stages(server.base, API_KEY)
    assert stages_after is not None

    def delta(name: str) -> float:
        return after.get(name, 0.0) - before.get(name, 0.0)

    assert delta("radixserve:generation_tokens_total") == 8
    assert delta("radixserve:prompt_tokens_total") == 2 * prompt_tokens
    assert delta("radixserve:num_requests_total") == 2
    assert delta("radixserve:time_to_first_token_seconds_count") == 2
    assert delta("radixserve:e2e_request_latency_seconds_count") == 2
    assert delta("radixserve:inter_token_latency_seconds_count") >= 4  # the streamed request's 4 gaps
    assert delta("radixserve:cached_tokens_total") > 0  # the second request reused the first's prompt
    assert 0.0 <= after["radixserve:cache_hit_rate"] <= 1.0
    # each TTFT is split into four stages at the scheduler's stamps; the stages add up to the TTFT observed
    stage_sum = 0.0
    for stage in ("dispatch", "queue", "prefill", "deliver"):
        assert stages_after[stage][1] - stages_before[stage][1] == 2, stage
        stage_sum += stages_after[stage][0] - stages_before[stage][0]
    ttft_sum = delta("radixserve:time_to_first_token_seconds_sum")
    assert ttft_sum > 0 and abs(stage_sum - ttft_sum) < 1e-3, (stage_sum, ttft_sum)
    means = stage_means_ms(stages_before, stages_after)
    assert list(means) == ["dispatch", "queue", "prefill", "deliver"] and means["prefill"] > 0

    # A client that hangs up mid-stream is counted as an aborted request.
    stream = client.completions.create(model=MODEL, prompt="Metrics abort prompt", max_tokens=2000, temperature=0,
                                       stream=True, extra_body={"ignore_eos": True})
    next(iter(stream))
    stream.close()
    deadline = time.monotonic() + 30
    while _scrape(http)["radixserve:num_aborted_requests_total"] <= after.get(
            "radixserve:num_aborted_requests_total", 0.0):
        assert time.monotonic() < deadline, "the hung-up stream was never counted as aborted"
        time.sleep(0.2)


def test_health_reports_a_stuck_scheduler(server: Server, http: httpx.Client) -> None:
    sched = psutil.Process(internal_state(http)["pid"])
    sched.suspend()  # SIGSTOP: alive but not answering
    try:
        r = httpx.get(server.base + "/health", timeout=30)
        assert r.status_code == 503 and "did not answer" in r.json()["error"]["message"]
    finally:
        sched.resume()
    deadline = time.monotonic() + 15
    while httpx.get(server.base + "/health", timeout=30).status_code != 200:
        assert time.monotonic() < deadline
        time.sleep(0.2)


def test_bench_serving_against_the_server(server: Server, tmp_path: Any) -> None:
    from radixserve import bench_serving

    common = ["--base-url", server.base, "--api-key", API_KEY, "--num-prompts", "4", "--max-concurrency", "4",
              "--disable-tqdm"]
    out, png = tmp_path / "bench.json", tmp_path / "bench.png"
    rc = bench_serving.main(common + ["--backend", "openai", "--dataset", "random", "--random-input-len", "16",
                                      "--random-output-len", "4", "--random-range-ratio", "1.0",
                                      "--output-file", str(out), "--plot", str(png)])
    assert rc == 0
    summary = json.loads(out.read_text())["summary"]
    assert summary["completed"] == 4 and summary["failed"] == 0 and summary["total_output_tokens"] == 16
    assert summary["ttft_ms"]["p99"] > 0 and summary["output_throughput"] > 0
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    out2 = tmp_path / "bench2.json"
    rc = bench_serving.main(common + ["--backend", "radixserve", "--dataset", "shared-prefix",
                                      "--shared-prefix-groups", "1", "--shared-prefix-len", "24",
                                      "--shared-question-len", "4", "--shared-output-len", "3",
                                      "--request-rate", "50", "--output-file", str(out2)])
    assert rc == 0
    assert json.loads(out2.read_text())["summary"]["total_output_tokens"] == 12


def test_launch_refuses_a_busy_port(server: Server) -> None:
    from radixserve.launch_server import main

    port = int(server.base.rsplit(":", 1)[1])
    assert main(["--port", str(port)]) == 1  # fails before loading the model


def test_zz_sigterm_drains(server: Server, http: httpx.Client) -> None:
    """SIGTERM: /health and new requests get 503 while in-flight requests run to their end; one that outlives
    --graceful-shutdown-timeout is aborted (an OpenAI stream ends with an error event, not a finish_reason); the
    process exits 0 and no child is left."""
    children = psutil.Process(server.proc.pid).children(recursive=True)
    assert children
    short = {"text": "Count to ten:", "stream": True,
             "sampling_params": {"max_new_tokens": 3, "ignore_eos": True, "temperature": 0}}
    long = {"model": MODEL, "messages": OK_MSGS, "max_tokens": 4000, "stream": True, "ignore_eos": True}
    with http.stream("POST", "/v1/chat/completions", json=long) as rl, \
            http.stream("POST", "/generate", json=short) as rs:
        long_lines, short_lines = rl.iter_lines(), rs.iter_lines()
        next(line for line in long_lines if line.startswith("data: "))
        next(line for line in short_lines if line.startswith("data: "))
        t0 = time.monotonic()
        os.kill(server.proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 10
        while httpx.get(server.base + "/health", timeout=10).status_code != 503:
            assert time.monotonic() < deadline
            time.sleep(0.05)
        refused = httpx.post(server.base + "/v1/completions", json={"prompt": "x", "max_tokens": 1}, headers=AUTH)
        assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
        done = sse_payloads(short_lines)
        assert done[-1] == "[DONE]" and done[-2]["meta_info"]["finish_reason"]["type"] == "length", done[-2]
        assert done[-2]["meta_info"]["completion_tokens"] == 3
        aborted = sse_payloads(long_lines)
    assert aborted[-1] == "[DONE]" and aborted[-2]["error"]["code"] == "request_aborted", aborted[-2]
    assert all(c.get("choices", [{}])[0].get("finish_reason") != "abort" for c in aborted[:-1])
    assert time.monotonic() - t0 >= GRACE_S - 0.5  # it was given the whole grace period
    assert server.proc.wait(timeout=30) == 0, server.log_tail()
    _, alive = psutil.wait_procs(children, timeout=10)
    assert not alive, alive
    log = server.log_tail(400)
    assert "is ready on http://127.0.0.1:" in log and "draining 2 in-flight request(s)" in log
