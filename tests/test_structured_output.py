"""Structured output (JSON schema, regex, EBNF through xgrammar) on the embedded SmolLM2, with sampling on.

In-process schedulers (normal loop, overlap loop, a tiny pool with chunked prefill that forces retraction) check
that every constrained output parses and validates, that plain neighbours are untouched, that a bad grammar is a 400
for its request alone, that compiles are cached and that overlap changes nothing; a real HTTP server checks the
OpenAI and native request shapes end to end."""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
from collections.abc import Iterator
from concurrent.futures import Future
from typing import Any

import httpx
import jsonschema
import pytest
import torch
from grammar_utils import (
    ARITH_EBNF,
    BOOK,
    COLORS,
    MAX_NEW,
    PERSON,
    PLAIN_PROMPTS,
    REGEXES,
    SCHEMAS,
    WEATHER,
    all_live_reqs,
    chat_ids,
    drain,
    mixed_workload,
    submit,
)
from server_utils import wait_healthy

from radixserve.constrained import GrammarError, bitmask_to_vocab_mask, create_grammar_backend, validate_grammar
from radixserve.managers.scheduler import Scheduler
from radixserve.server_args import ServerArgs
from radixserve.utils import free_port, kill_process_tree

pytest.importorskip("xgrammar")

def text_of(s: Scheduler, r: dict[str, Any]) -> str:
    return s.tokenizer.decode(r["ids"], skip_special_tokens=True)


def assert_grammar_stop(r: dict[str, Any], eos: set[int]) -> None:
    fin = r["finish"]
    assert fin["type"] == "stop" and fin["matched"] in eos, fin
    assert r["ids"][-1] in eos


def parse_arith(text: str) -> int:
    """Recursive descent over ARITH_EBNF (whole input); returns the value, raises ValueError if it does not
    parse."""
    pos = 0

    def eat(s: str) -> bool:
        nonlocal pos
        if text.startswith(s, pos):
            pos += len(s)
            return True
        return False

    def num() -> int:
        nonlocal pos
        if pos >= len(text) or text[pos] not in "123456789":
            raise ValueError(f"number expected at {pos} in {text!r}")
        start = pos
        pos += 1
        if pos < len(text) and text[pos].isdigit():
            pos += 1
        return int(text[start:pos])

    def op() -> str | None:
        for o in (" + ", " - ", " * "):
            if eat(o):
                return o.strip()
        return None

    def apply(a: int, o: str, b: int) -> int:
        return a + b if o == "+" else a - b if o == "-" else a * b

    def term() -> int:
        if eat("("):
            a = num()
            o = op()
            if o is None:
                raise ValueError(f"operator expected at {pos} in {text!r}")
            b = num()
            if not eat(")"):
                raise ValueError(f"')' expected at {pos} in {text!r}")
            return apply(a, o, b)
        return num()

    value = term()
    for _ in range(2):
        o = op()
        if o is None:
            break
        value = apply(value, o, term())  # left to right; the value only shows the parse went through
    if pos != len(text):
        raise ValueError(f"trailing input at {pos} in {text!r}")
    return value


def make_scheduler(path: str, **kw: Any) -> Scheduler:
    args = dict(model_path=path, device="cpu", max_total_tokens=8192, random_seed=0, disable_overlap_schedule=True)
    args.update(kw)
    return Scheduler(ServerArgs(**args), port_args={})


@pytest.fixture(scope="module", autouse=True)
def one_torch_thread() -> Iterator[None]:
    """Two intra-op threads on a 2-core machine shared with other work can be many times slower than one."""
    before = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(before)


@pytest.fixture(scope="module")
def sched(embedded_model_path: str) -> Scheduler:
    return make_scheduler(embedded_model_path)


@pytest.fixture(scope="module")
def sched_overlap(embedded_model_path: str) -> Scheduler:
    return make_scheduler(embedded_model_path, disable_overlap_schedule=False, enable_overlap_schedule=True)


@pytest.fixture(scope="module")
def mixed_normal(sched: Scheduler) -> dict[str, dict[str, Any]]:
    return mixed_workload(sched, "m")


# ====================================================================== unit level
def test_bitmask_unpacks_to_the_samplers_vocab_mask() -> None:
    g = torch.Generator().manual_seed(0)
    vocab = 77
    allowed = torch.rand(3, vocab, generator=g) < 0.4
    words = (vocab + 31) // 32
    packed = torch.zeros(3, words, dtype=torch.int64)
    for t in range(vocab):
        packed[:, t // 32] |= allowed[:, t].to(torch.int64) << (t % 32)
    packed = torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)
    mask = bitmask_to_vocab_mask(packed, vocab, "cpu")
    assert mask.dtype == torch.bool and mask.shape == (3, vocab)
    assert torch.equal(mask, ~allowed)
    with pytest.raises(ValueError, match="words per row"):
        bitmask_to_vocab_mask(packed, vocab + 64, "cpu")


@pytest.mark.parametrize("kind,text,needle", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": "objectx"}', "objectx"),
    ("json_schema", "[1, 2]", "must be an object"),
    ("regex", "(ab", "parenthesis"),
    ("ebnf", "root ::= foo", "foo"),
    ("ebnf", 'root ::= "a" |', "EBNF"),
])
def test_validate_rejects_bad_grammars_with_clear_messages(kind: str, text: str, needle: str) -> None:
    with pytest.raises(GrammarError, match=re.escape(needle)) as info:
        validate_grammar("xgrammar", kind, text)
    msg = str(info.value)
    assert msg.startswith(kind + ":") and "/project/" not in msg and len(msg) < 400


@pytest.mark.parametrize("schema,keyword,where", [
    ({"type": "array", "items": {"type": "integer"}, "uniqueItems": True}, "uniqueItems", "#"),
    ({"type": "array", "contains": {"const": 7}}, "contains", "#"),
    ({"allOf": [{"type": "integer", "minimum": 3}, {"maximum": 4}]}, "allOf", "#"),
    ({"type": "object", "properties": {"t": {"type": "string"}}, "if": {"properties": {"t": {"const": "a"}}},
      "then": {"required": ["v"]}}, "if", "#"),
    ({"type": "object", "properties": {"a": {"not": {"type": "string"}}}}, "not", "#/properties/a"),
    ({"$defs": {"d": {"type": "object", "dependentRequired": {"a": ["b"]}}}, "$ref": "#/$defs/d"},
     "dependentRequired", "#/$defs/d"),
    ({"type": "object", "patternProperties": {"^x": {"type": "integer"}}}, "patternProperties", "#"),
])
def test_keywords_the_backend_would_not_enforce_are_refused(schema: dict, keyword: str, where: str) -> None:
    """xgrammar compiles these keywords without enforcing them (an instance that breaks them matches): a 400 naming
    the keyword and where it is, not an output that ignores it. A property *named* like a keyword is fine, and so
    are allOf with one subschema (pydantic's field wrappers) and uniqueItems false."""
    with pytest.raises(GrammarError, match=re.escape(f"{keyword!r} (at {where})")):
        validate_grammar("xgrammar", "json_schema", json.dumps(schema))
    fine = {"type": "object", "properties": {"not": {"type": "integer"}, "if": {"allOf": [{"type": "string"}]},
                                             "xs": {"type": "array", "uniqueItems": False}}}
    validate_grammar("xgrammar", "json_schema", json.dumps(fine))


def test_validate_accepts_good_grammars() -> None:
    validate_grammar("xgrammar", "json_schema", json.dumps(PERSON))
    validate_grammar("xgrammar", "regex", REGEXES[0][0])
    validate_grammar("xgrammar", "ebnf", ARITH_EBNF)


def test_matcher_accepts_rolls_back_and_masks_padded_vocab(sched: Scheduler) -> None:
    """A model vocabulary wider than the tokenizer's: the extra ids are never allowed."""
    tok = sched.tokenizer
    vocab = sched.vocab_size + 40
    backend = create_grammar_backend(ServerArgs(device="cpu"), tok, vocab, eos_token_ids=[tok.eos_token_id])
    try:
        template = backend.get_future("regex", "ab+").result(timeout=60)
        m = template.copy()
        ids_a, ids_b = tok.encode("a", add_special_tokens=False), tok.encode("b", add_special_tokens=False)
        assert len(ids_a) == 1 and len(ids_b) == 1
        mask = backend.allocate_vocab_mask(2)
        m.fill_vocab_mask(mask, 1)
        vm = bitmask_to_vocab_mask(mask, vocab, "cpu")
        assert not vm[0].any()  # row 0 untouched: everything allowed
        assert not vm[1, ids_a[0]] and vm[1, ids_b[0]] and vm[1, sched.vocab_size:].all()
        assert vm[1, tok.eos_token_id]  # nothing matched yet: cannot stop
        assert m.accept_token(ids_a[0]) and m.accept_token(ids_b[0]) and not m.accept_token(ids_a[0])
        assert m.num_accepted == 2 and not m.is_terminated()
        m.rollback(1)
        assert m.num_accepted == 1
        assert m.sync_to(ids_a + ids_b + ids_b) and m.num_accepted == 3
        assert m.accept_token(tok.eos_token_id) and m.is_terminated()
        with pytest.raises(ValueError):
            m.rollback(5)
        assert template.copy().num_accepted == 0  # copies start fresh
    finally:
        backend.shutdown()


# ====================================================================== in-process scheduler
def test_json_outputs_validate_against_their_schemas(sched: Scheduler, mixed_normal) -> None:
    eos = sched.model_config.eos_token_ids
    for k, (schema, _) in enumerate(SCHEMAS):
        r = mixed_normal[f"m-json{k}"]
        assert_grammar_stop(r, eos)
        jsonschema.validate(json.loads(text_of(sched, r)), schema)


def test_regex_outputs_full_match(sched: Scheduler, mixed_normal) -> None:
    for k, (rx, _) in enumerate(REGEXES):
        r = mixed_normal[f"m-rx{k}"]
        assert_grammar_stop(r, sched.model_config.eos_token_ids)
        assert re.fullmatch(rx, text_of(sched, r)), text_of(sched, r)


def test_ebnf_output_parses(sched: Scheduler, mixed_normal) -> None:
    r = mixed_normal["m-ebnf"]
    assert_grammar_stop(r, sched.model_config.eos_token_ids)
    parse_arith(text_of(sched, r))


def test_many_seeds_all_valid(sched: Scheduler) -> None:
    """Same schema, many samples in one batch (one compile, one matcher each)."""
    tok = sched.tokenizer
    before = sched.grammar_backend.stats()
    schema = json.dumps({**PERSON, "title": "many-seeds"})
    for seed in range(6):
        submit(sched, f"seed{seed}", chat_ids(tok, SCHEMAS[0][1]), json_schema=schema, temperature=0.8, seed=seed,
               top_p=0.95)
    res = drain(sched)
    texts = set()
    for seed in range(6):
        r = res[f"seed{seed}"]
        assert_grammar_stop(r, sched.model_config.eos_token_ids)
        texts.add(text_of(sched, r))
        jsonschema.validate(json.loads(text_of(sched, r)), PERSON)
    assert len(texts) > 1  # sampling is on
    after = sched.grammar_backend.stats()
    assert after["grammar_compiles"] == before["grammar_compiles"] + 1
    assert after["grammar_cache_hits"] == before["grammar_cache_hits"] + 5


def test_plain_requests_unaffected_by_constrained_neighbours(sched: Scheduler, mixed_normal) -> None:
    tok = sched.tokenizer
    assert sched.flush_cache()
    for k, text in enumerate(PLAIN_PROMPTS[:2]):
        submit(sched, f"alone{k}", chat_ids(tok, text), temperature=0, max_new_tokens=24, ignore_eos=True)
    alone = drain(sched)
    for k in range(2):
        assert alone[f"alone{k}"]["ids"] == mixed_normal[f"m-plain{k}"]["ids"]
        assert len(alone[f"alone{k}"]["ids"]) == 24


def test_same_schema_twice_hits_the_compile_cache(sched: Scheduler) -> None:
    tok = sched.tokenizer
    schema = json.dumps({**COLORS, "title": "cache-test"})
    before = sched.grammar_backend.stats()
    submit(sched, "c1", chat_ids(tok, SCHEMAS[2][1]), json_schema=schema, temperature=0)
    res1 = drain(sched)
    mid = sched.grammar_backend.stats()
    submit(sched, "c2", chat_ids(tok, SCHEMAS[2][1]), json_schema=schema, temperature=0)
    res2 = drain(sched)
    after = sched.grammar_backend.stats()
    assert mid["grammar_compiles"] == before["grammar_compiles"] + 1
    assert after["grammar_compiles"] == mid["grammar_compiles"]
    assert after["grammar_cache_hits"] == mid["grammar_cache_hits"] + 1
    assert res1["c1"]["ids"] == res2["c2"]["ids"]  # greedy, a fresh matcher each time
    jsonschema.validate(json.loads(text_of(sched, res2["c2"])), COLORS)


@pytest.mark.parametrize("kind,text,needle", [
    ("json_schema", "{not json", "not valid JSON"),
    ("json_schema", '{"type": "objectx"}', "objectx"),
    ("regex", "(ab", "parenthesis"),
    ("ebnf", "root ::= foo", "foo"),
])
def test_invalid_grammar_is_a_400_for_that_request_alone(sched: Scheduler, kind: str, text: str,
                                                         needle: str) -> None:
    """The scheduler compiles what it is given (the tokenizer manager's check is bypassed here)."""
    tok = sched.tokenizer
    submit(sched, "ok-before", chat_ids(tok, "Hi"), temperature=0, max_new_tokens=4, ignore_eos=True)
    submit(sched, "bad", chat_ids(tok, "Hi"), **{kind: text})
    submit(sched, "ok-json", chat_ids(tok, SCHEMAS[0][1]), json_schema=json.dumps(PERSON), temperature=0)
    res = drain(sched)
    fin = res["bad"]["finish"]
    assert fin["type"] == "abort" and fin["status_code"] == 400 and needle in fin["message"], fin
    assert res["bad"]["ids"] == []
    assert len(res["ok-before"]["ids"]) == 4
    jsonschema.validate(json.loads(text_of(sched, res["ok-json"])), PERSON)
    assert sched.is_idle()


def test_grammar_queue_does_not_block_other_requests(sched: Scheduler) -> None:
    tok = sched.tokenizer
    backend = sched.grammar_backend
    template = backend.get_future("regex", r"[0-9]{3}").result(timeout=60)
    pending: Future = Future()
    real_get_future = backend.get_future
    backend.get_future = lambda kind, text: pending  # a compile that takes its time
    try:
        submit(sched, "slow", chat_ids(tok, "Pick a number."), regex=r"[0-9]{3}", temperature=0)
    finally:
        backend.get_future = real_get_future
    submit(sched, "fast", chat_ids(tok, "Hi"), temperature=0, max_new_tokens=8, ignore_eos=True)
    for _ in range(30):
        sched.step()
    assert sched.grammar_queue and sched.grammar_queue[0].rid == "slow"
    assert not sched.is_idle()
    done = [m for m in sched.outbox if "fast" in m.rids and m.finished_reasons[m.rids.index("fast")]]
    assert done, "the plain request did not finish while the other one waited for its grammar"
    pending.set_result(template)
    res = drain(sched)
    assert re.fullmatch(r"[0-9]{3}", text_of(sched, res["slow"]))


def test_abort_in_grammar_queue_and_while_running(sched: Scheduler) -> None:
    tok = sched.tokenizer
    submit(sched, "a-queued", chat_ids(tok, SCHEMAS[1][1]), json_schema=json.dumps(WEATHER))
    sched.abort_request("a-queued", "stop it")
    submit(sched, "a-running", chat_ids(tok, SCHEMAS[1][1]), json_schema=json.dumps(WEATHER), temperature=0.8,
           seed=1)
    for _ in range(4):
        sched.step()
    assert any(r.rid == "a-running" and r.grammar is not None for r in all_live_reqs(sched))
    sched.abort_request("a-running", "stop it too")
    res = drain(sched)
    assert res["a-queued"]["finish"]["type"] == "abort" and res["a-queued"]["ids"] == []
    assert res["a-running"]["finish"]["type"] == "abort"
    assert not sched.grammar_queue


def test_grammar_request_without_backend_is_a_400(embedded_model_path: str) -> None:
    s = make_scheduler(embedded_model_path, grammar_backend="none", max_total_tokens=512)
    submit(s, "g", [1, 2, 3], regex="a+")
    submit(s, "p", [1, 2, 3], temperature=0, max_new_tokens=2, ignore_eos=True)
    res = drain(s)
    assert res["g"]["finish"]["status_code"] == 400 and "not available" in res["g"]["finish"]["message"]
    assert len(res["p"]["ids"]) == 2


# ====================================================================== overlap, chunked prefill, retraction
def test_overlap_gives_identical_constrained_outputs(sched: Scheduler, sched_overlap: Scheduler,
                                                     mixed_normal) -> None:
    assert sched_overlap.enable_overlap
    deferred = []  # masks handed to the forward thread after launch (the overlap path, no flush before a batch)
    inner = sched_overlap.fulfill_grammar_masks

    def counting(bid: int) -> None:
        deferred.extend(f for b, _, f in sched_overlap.pending_grammar_masks if b <= bid)
        inner(bid)

    sched_overlap.fulfill_grammar_masks = counting
    try:
        res = mixed_workload(sched_overlap, "m")
    finally:
        sched_overlap.fulfill_grammar_masks = inner
    assert len(deferred) > 10 and all(f.done() and f.exception() is None for f in deferred)
    assert not sched_overlap.pending_grammar_masks
    assert set(res) == set(mixed_normal)
    for rid in res:
        assert res[rid]["ids"] == mixed_normal[rid]["ids"], rid
        assert res[rid]["finish"] == mixed_normal[rid]["finish"], rid


def test_tiny_pool_retraction_and_chunked_prefill_keep_grammars_exact(embedded_model_path: str,
                                                                      mixed_normal) -> None:
    """Overlap on, a KV pool too small for the batch (retraction) and 16-token prefill chunks mixed into decode:
    every matcher stays in step with its output (checked after every step) and every output is valid."""
    # a low reservation ratio admits more than fits, so decoding must retract
    s = make_scheduler(embedded_model_path, max_total_tokens=256, chunked_prefill_size=16, enable_mixed_chunk=True,
                       schedule_conservativeness=0.05, disable_overlap_schedule=False, enable_overlap_schedule=True)
    for k in range(4):  # long plain neighbours: decoding outgrows the pool
        submit(s, f"long{k}", chat_ids(s.tokenizer, PLAIN_PROMPTS[k % 3]), temperature=0.8, seed=k,
               ignore_eos=True)
    retracted: set[str] = set()
    res = mixed_workload(s, "m", retracted)
    assert s.num_retractions > 0 and retracted, s.get_internal_state()
    assert all(len(res[f"long{k}"]["ids"]) == MAX_NEW for k in range(4))
    eos = s.model_config.eos_token_ids
    for k, (schema, _) in enumerate(SCHEMAS):
        r = res[f"m-json{k}"]
        assert_grammar_stop(r, eos)
        jsonschema.validate(json.loads(text_of(s, r)), schema)
    for k, (rx, _) in enumerate(REGEXES):
        assert re.fullmatch(rx, text_of(s, res[f"m-rx{k}"]))
    parse_arith(text_of(s, res["m-ebnf"]))
    for k in range(2):
        assert len(res[f"m-plain{k}"]["ids"]) == 24


# ====================================================================== HTTP
@pytest.fixture(scope="module")
def server(embedded_model_path: str, tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    port = free_port()
    log_path = str(tmp_path_factory.mktemp("server") / "server.log")
    cmd = [sys.executable, "-m", "radixserve.launch_server", "--host", "127.0.0.1", "--port", str(port),
           "--max-total-tokens", "4096", "--log-level", "warning"]
    # one intra-op thread: with two on a 2-core machine, the scheduler's spinning threads and the other processes
    # of the server fight over the cores and decoding gets many times slower
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    base = f"http://127.0.0.1:{port}"
    try:
        wait_healthy(base, [proc], lambda: open(log_path).read()[-3000:])
        yield base
    finally:
        if proc.poll() is None:
            kill_process_tree(proc.pid)


@pytest.fixture(scope="module")
def http(server: str) -> Iterator[httpx.Client]:
    with httpx.Client(base_url=server, timeout=180) as c:
        yield c


def _chat(http: httpx.Client, content: str, **kw: Any) -> httpx.Response:
    body = {"messages": [{"role": "user", "content": content}], "max_tokens": MAX_NEW, "temperature": 0.8,
            "seed": 5, **kw}
    return http.post("/v1/chat/completions", json=body)


@pytest.mark.integration
def test_http_reports_structured_output(http: httpx.Client) -> None:
    assert http.get("/get_server_info").json()["structured_output"] is True


@pytest.mark.integration
def test_http_chat_response_format_json_schema(http: httpx.Client) -> None:
    r = _chat(http, SCHEMAS[1][1], n=2, response_format={"type": "json_schema",
                                                         "json_schema": {"name": "weather", "schema": WEATHER}})
    assert r.status_code == 200, r.text
    choices = r.json()["choices"]
    assert len(choices) == 2
    for c in choices:
        assert c["finish_reason"] == "stop"
        jsonschema.validate(json.loads(c["message"]["content"]), WEATHER)


@pytest.mark.integration
def test_http_chat_json_object(http: httpx.Client) -> None:
    r = _chat(http, "Reply with a JSON object with one key ok set to true.", temperature=0,
              response_format={"type": "json_object"})
    assert r.status_code == 200, r.text
    choice = r.json()["choices"][0]
    assert choice["finish_reason"] == "stop"
    assert isinstance(json.loads(choice["message"]["content"]), dict)


@pytest.mark.integration
def test_http_completions_response_format_and_regex_extra(http: httpx.Client) -> None:
    r = http.post("/v1/completions", json={
        "prompt": "A person, as JSON:", "max_tokens": MAX_NEW, "temperature": 0.8, "seed": 1,
        "response_format": {"type": "json_schema", "json_schema": {"name": "p", "schema": PERSON}}})
    assert r.status_code == 200, r.text
    jsonschema.validate(json.loads(r.json()["choices"][0]["text"]), PERSON)
    r = http.post("/v1/completions", json={"prompt": "Call me at", "max_tokens": 32, "temperature": 0.8,
                                           "seed": 2, "regex": REGEXES[0][0]})
    assert r.status_code == 200, r.text
    assert re.fullmatch(REGEXES[0][0], r.json()["choices"][0]["text"])


@pytest.mark.integration
def test_http_native_generate_schema_object_and_ebnf(http: httpx.Client) -> None:
    r = http.post("/generate", json={"text": "A book review as JSON:", "sampling_params": {
        "max_new_tokens": MAX_NEW, "temperature": 0.8, "seed": 3, "json_schema": BOOK}})
    assert r.status_code == 200, r.text
    out = r.json()
    jsonschema.validate(json.loads(out["text"]), BOOK)
    assert out["meta_info"]["finish_reason"]["type"] == "stop"
    r = http.post("/generate", json={"text": "2 + 2 =", "stream": True, "sampling_params": {
        "max_new_tokens": 32, "temperature": 0.8, "seed": 4, "ebnf": ARITH_EBNF}})
    assert r.status_code == 200, r.text
    events = [json.loads(line[6:]) for line in r.text.splitlines()
              if line.startswith("data: ") and line != "data: [DONE]"]
    parse_arith(events[-1]["text"])


@pytest.mark.parametrize("path,body,needle", [
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": "x"}],
                              "response_format": {"type": "json_schema",
                                                  "json_schema": {"name": "b", "schema": {"type": "objectx"}}}},
     "objectx"),
    ("/v1/completions", {"prompt": "x", "regex": "(ab", "stream": True}, "parenthesis"),
    ("/v1/completions", {"prompt": "x", "json_schema": "{oops"}, "not valid JSON"),
    ("/v1/completions", {"prompt": "x", "regex": "a+", "response_format": {"type": "json_object"}}, "at most one"),
    ("/generate", {"text": "x", "sampling_params": {"ebnf": "root ::= foo"}}, "foo"),
    ("/generate", {"text": "x", "sampling_params": {"regex": "a", "ebnf": "root ::= \"a\""}}, "at most one"),
])
@pytest.mark.integration
def test_http_invalid_grammar_is_400_and_server_stays_healthy(http: httpx.Client, path: str, body: dict,
                                                             needle: str) -> None:
    r = http.post(path, json=body)
    assert r.status_code == 400, r.text
    assert needle in r.json()["error"]["message"]
    assert http.get("/health").status_code == 200
    ok = http.post("/v1/completions", json={"prompt": "Hello", "max_tokens": 2, "temperature": 0})
    assert ok.status_code == 200


def test_deferred_mask_failure_reaches_the_forward_thread(sched: Scheduler) -> None:
    """Under overlap a batch's mask is built after launch; if building it fails, the waiting forward thread gets
    the error (and fails that batch) instead of waiting for ever; masks of later batches stay queued."""
    from concurrent.futures import Future
    from types import SimpleNamespace

    broken = SimpleNamespace(grammar=object(), finished=lambda: False, output_ids=[1])  # no matcher API
    first, later = Future(), Future()
    sched.pending_grammar_masks.extend([(5, [broken], first), (6, [], later)])
    try:
        sched.fulfill_grammar_masks(5)
        assert first.done() and isinstance(first.exception(), AttributeError)
        assert not later.done() and len(sched.pending_grammar_masks) == 1
        sched.fulfill_grammar_masks(6)
        assert later.result() is None  # no constrained row: no mask
    finally:
        sched.pending_grammar_masks.clear()
