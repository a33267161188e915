"""The structured-output test workload (schemas, regexes, an EBNF grammar, plain prompts) and the in-process
scheduler helpers that drive it, shared by tests/test_structured_output.py and tests/gpu/test_gpu_structured.py.
Only the engine's own dependencies: no jsonschema or httpx, so it runs on the GPU machine too."""

from __future__ import annotations

import json
import time
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams

MAX_NEW = 64
PERSON = {"type": "object", "properties": {"name": {"type": "string", "minLength": 1, "maxLength": 20},
                                           "age": {"type": "integer", "minimum": 0, "maximum": 150}},
          "required": ["name", "age"]}
WEATHER = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 24},
                                            "unit": {"enum": ["celsius", "fahrenheit"]},
                                            "temperature": {"type": "number", "minimum": -90, "maximum": 60},
                                            "sunny": {"type": "boolean"}},
           "required": ["city", "unit", "temperature", "sunny"]}
COLORS = {"type": "object", "properties": {"colors": {"type": "array", "items": {"type": "string", "maxLength": 12},
                                                      "minItems": 1, "maxItems": 3}},
          "required": ["colors"]}
BOOK = {"type": "object", "properties": {"book": {"type": "object",
                                                  "properties": {"title": {"type": "string", "maxLength": 30},
                                                                 "year": {"type": "integer", "minimum": 1000,
                                                                          "maximum": 2100}},
                                                  "required": ["title", "year"]},
                                         "rating": {"type": "integer", "enum": [1, 2, 3, 4, 5]}},
        "required": ["book", "rating"]}
SCHEMAS = [(PERSON, "Describe a person as JSON with a name and an age."),
           (WEATHER, "Give the weather in a city as JSON."),
           (COLORS, "List some colors as JSON."),
           (BOOK, "Recommend a book as JSON.")]
REGEXES = [(r"\(\d{3}\) \d{3}-\d{4}", "What is your phone number?"),
           (r"(yes|no), because [a-z ]{3,20}\.", "Is the sky blue? Answer yes or no and say why."),
           (r"[A-Z][a-z]{2,9}-[0-9]{2}", "Invent a product code.")]
# a small arithmetic language; `parse_arith` below is an independent recursive-descent parser for it
ARITH_EBNF = r"""root ::= expr
expr ::= term (op term)? (op term)?
term ::= num | "(" num op num ")"
num ::= [1-9] [0-9]?
op ::= " + " | " - " | " * "
"""
PLAIN_PROMPTS = ["Tell me a story about a dragon.", "What is the capital of France?", "Write a haiku about rain."]


# ====================================================================== helpers
def chat_ids(tok: Any, text: str) -> list[int]:
    prompt = tok.apply_chat_template([{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False)
    return tok.encode(prompt, add_special_tokens=False)


def submit(s: Scheduler, rid: str, ids: list[int], **sp: Any) -> None:
    params = SamplingParams.from_dict({"max_new_tokens": MAX_NEW, **sp})
    params.normalize(s.tokenizer)
    s.process_input_requests([io.TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=ids,
                                                           sampling_params=params)])


def all_live_reqs(s: Scheduler) -> list[Any]:
    reqs = list(s.waiting_queue)
    for b in (s.running_batch, s.last_batch):
        if b is not None:
            reqs += b.reqs
    if s.chunked_req is not None:
        reqs.append(s.chunked_req)
    return reqs


def drain(s: Scheduler, timeout_s: float = 600.0, retracted: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """Step until idle; checks after every step that each matcher has accepted exactly its request's output
    (and collects the constrained requests that were retracted into `retracted`)."""
    deadline = time.monotonic() + timeout_s
    while True:
        busy = s.step()
        for r in all_live_reqs(s):
            if r.grammar is not None and not r.finished():
                assert r.grammar.num_accepted == len(r.output_ids), (r, r.grammar.num_accepted)
                if r.num_retractions and retracted is not None:
                    retracted.add(r.rid)
        if not busy and s.is_idle():
            break
        if not busy:
            time.sleep(0.001)  # only grammars being compiled
        if time.monotonic() > deadline:
            raise RuntimeError("the scheduler did not go idle")
    results: dict[str, dict[str, Any]] = {}
    for msg in s.outbox:
        if isinstance(msg, io.BatchTokenIDOut):
            for rid, ids, fin in zip(msg.rids, msg.new_token_ids, msg.finished_reasons, strict=True):
                r = results.setdefault(rid, {"ids": [], "finish": None})
                r["ids"] += ids
                r["finish"] = fin
    s.outbox.clear()
    assert s.check_memory(), s.get_internal_state()
    assert s.invariant_violations == 0
    return results


def mixed_workload(s: Scheduler, tag: str, retracted: set[str] | None = None) -> dict[str, dict[str, Any]]:
    """JSON, regex and EBNF requests (sampled, seeded) plus greedy plain ones, all in one batch."""
    tok = s.tokenizer
    for k, (schema, text) in enumerate(SCHEMAS):
        submit(s, f"{tag}-json{k}", chat_ids(tok, text), json_schema=json.dumps(schema), temperature=0.8, seed=k)
    for k, (rx, text) in enumerate(REGEXES):
        submit(s, f"{tag}-rx{k}", chat_ids(tok, text), regex=rx, temperature=0.8, seed=10 + k)
    submit(s, f"{tag}-ebnf", chat_ids(tok, "Write a small arithmetic expression."), ebnf=ARITH_EBNF,
           temperature=0.8, seed=20)
    for k, text in enumerate(PLAIN_PROMPTS[:2]):
        submit(s, f"{tag}-plain{k}", chat_ids(tok, text), temperature=0, max_new_tokens=24, ignore_eos=True)
    return drain(s, retracted=retracted)
