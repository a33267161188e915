"""Sampling through the scheduler: a mixed batch gives each request what it gets alone, seeds reproduce, greedy
logprobs equal transformers' log-softmax, and stop strings are matched on text across token boundaries."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_tiny_model
from test_scheduler import drain, make_scheduler

from radixserve.managers import io_struct as io
from radixserve.managers.detokenizer_manager import DetokenizerManager
from radixserve.sampling.sampling_params import SamplingParams

MIXED = [
    ("greedy", {"temperature": 0}),
    ("seeded", {"temperature": 1.0, "seed": 1234, "top_p": 0.95}),
    ("seeded-topk", {"temperature": 0.8, "seed": 7, "top_k": 16, "min_p": 0.02}),
    ("freq", {"temperature": 0, "frequency_penalty": 1.2, "presence_penalty": 0.4}),
    ("rep", {"temperature": 0, "repetition_penalty": 1.5}),
    ("bias", {"temperature": 0, "logit_bias": {"42": 100.0}}),
    ("min-new", {"temperature": 0, "min_new_tokens": 10, "stop_token_ids": list(range(0, 400))}),
    ("plain", {}),  # default temperature 1.0, unseeded: only checked for length
]


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    path = str(tmp_path_factory.mktemp("tiny_sampling"))
    hf = make_tiny_model("qwen2", path, seed=4, vocab_size=512)
    return path, hf


def submit(s, rid: str, prompt: list[int], sp: dict, **kw) -> None:
    s.process_input_requests([io.TokenizedGenerateReqInput(
        rid=rid, input_text=None, input_ids=prompt, sampling_params=SamplingParams.from_dict(sp), **kw)])


def test_mixed_batch_equals_each_alone(tiny) -> None:
    path, _ = tiny
    prompt = [5, 9, 200, 31, 7, 7, 7, 64]
    together = make_scheduler(path)
    for rid, sp in MIXED:
        submit(together, rid, prompt, {**sp, "max_new_tokens": 16})
    got = drain(together)
    for rid, sp in MIXED[:-1]:
        alone = make_scheduler(path)
        submit(alone, rid, prompt, {**sp, "max_new_tokens": 16})
        assert drain(alone)[rid]["ids"] == got[rid]["ids"], rid
    assert got["bias"]["ids"] == [42] * 16  # +100 forces the token
    assert len(got["min-new"]["ids"]) >= 10  # every token is a stop id, yet at least 10 come out
    assert len(got["plain"]["ids"]) == 16


def test_min_new_tokens_suppresses_a_stop_token_until_reached(tiny) -> None:
    path, _ = tiny
    prompt = [8, 8, 9]
    s = make_scheduler(path)
    submit(s, "g", prompt, {"temperature": 0, "max_new_tokens": 4})
    first = drain(s)["g"]["ids"][0]
    submit(s, "stop-now", prompt, {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [first]})
    submit(s, "stop-later", prompt, {"temperature": 0, "max_new_tokens": 20, "stop_token_ids": [first],
                                     "min_new_tokens": 5})
    out = drain(s)
    assert out["stop-now"]["ids"] == [first] and out["stop-now"]["finish"] == {"type": "stop", "matched": first}
    later = out["stop-later"]["ids"]
    assert len(later) >= 5 and first not in later[:4]


def test_seeds_reproduce_and_differ(tiny) -> None:
    path, _ = tiny
    s = make_scheduler(path)
    hot = {"temperature": 2.0, "max_new_tokens": 24}
    submit(s, "a", [3, 4, 5], {**hot, "seed": 1})
    submit(s, "b", [3, 4, 5], {**hot, "seed": 1})
    submit(s, "c", [3, 4, 5], {**hot, "seed": 2})
    out = drain(s)
    assert out["a"]["ids"] == out["b"]["ids"]
    assert out["a"]["ids"] != out["c"]["ids"]


def test_greedy_logprobs_match_transformers(tiny) -> None:
    path, hf = tiny
    prompt = [11, 22, 33, 44, 55, 66]
    s = make_scheduler(path)
    submit(s, "lp", prompt, {"temperature": 0, "max_new_tokens": 8, "ignore_eos": True}, return_logprob=True,
           top_logprobs_num=3, logprob_start_len=0)
    out = drain(s)["lp"]
    ids = out["ids"]
    meta = out["meta"]
    with torch.no_grad():
        logits = hf(torch.tensor([prompt + ids])).logits[0].float()
    ref = torch.log_softmax(logits, dim=-1)
    got = meta["output_token_logprobs"]
    assert [t for _, t in got] == ids
    for k, (lp, tok) in enumerate(got):
        assert lp == pytest.approx(ref[len(prompt) - 1 + k, tok].item(), abs=1e-4)
    top = meta["output_top_logprobs"][0]
    want = ref[len(prompt) - 1].topk(3)
    assert [t for _, t in top] == want.indices.tolist()
    # prompt logprobs: the first token has none, then each token given what precedes it
    inp = meta["input_token_logprobs"]
    assert inp[0][0] is None and [t for _, t in inp] == prompt
    for j in range(1, len(prompt)):
        assert inp[j][0] == pytest.approx(ref[j - 1, prompt[j]].item(), abs=1e-4)


@pytest.mark.parametrize("bad", [{"temperature": -0.5}, {"top_p": 0}, {"top_k": 0}, {"min_p": 1.5},
                                 {"frequency_penalty": 3}, {"repetition_penalty": 0}, {"max_new_tokens": -1},
                                 {"min_new_tokens": 5, "max_new_tokens": 2}, {"n": 0}, {"logit_bias": {"9999": 1}},
                                 {"stop": [""]}, {"temperature": "hot"}, {"seed": -1}, {"bogus": 1}])
def test_invalid_values_rejected_with_the_field_named(bad) -> None:
    field = next(iter(bad))
    with pytest.raises((ValueError, TypeError), match=field if field != "bogus" else "unknown"):
        sp = SamplingParams.from_dict(bad)
        sp.normalize(None)
        sp.verify(512)


class _CharTokenizer:
    """One token per character (ids = code points); enough to test text-level stop handling."""

    def decode(self, ids: list[int], **_: object) -> str:
        return "".join(chr(i) for i in ids)


def _out(rid: str, ids: list[int], finished: dict | None, stops: list[str], no_trim: bool = False):
    return io.BatchTokenIDOut([rid], [ids], [finished], [{}], [True], [True], [no_trim], [stops])


def test_stop_string_across_tokens_is_held_back_and_trimmed() -> None:
    d = DetokenizerManager(_CharTokenizer())
    text = ""
    for ch in "Hello ST":  # "ST" may start the stop string "STOP": held back
        text += d.handle(_out("r", [ord(ch)], None, ["STOP"])).text_deltas[0]
    assert text == "Hello "
    final = d.handle(_out("r", [ord("O"), ord("P")], {"type": "stop", "matched": "STOP"}, ["STOP"]))
    assert text + final.text_deltas[0] == "Hello "  # the stop string is trimmed
    d2 = DetokenizerManager(_CharTokenizer())
    whole = d2.handle(_out("q", [ord(c) for c in "ab STOP"], {"type": "stop", "matched": "STOP"}, ["STOP"],
                           no_trim=True))
    assert whole.text_deltas[0] == "ab STOP"
    d3 = DetokenizerManager(_CharTokenizer())  # a held-back prefix that turns out not to be a stop is released
    a = d3.handle(_out("x", [ord(c) for c in "go S"], None, ["STOP"])).text_deltas[0]
    b = d3.handle(_out("x", [ord(c) for c in "ure"], None, ["STOP"])).text_deltas[0]
    assert (a, a + b) == ("go ", "go Sure")


def test_scheduler_finishes_on_stop_string_spanning_tokens(embedded_model_path) -> None:
    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.tokenizer_utils import get_tokenizer
    from radixserve.server_args import ServerArgs

    tok = get_tokenizer(embedded_model_path)
    s = Scheduler(ServerArgs(model_path=embedded_model_path, max_total_tokens=2048), port_args={})
    prompt = tok.encode("Count: one, two, three, four, five, six, seven,")
    sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 30, "stop": ["nine,"]})
    sp.normalize(tok)
    s.process_input_requests([io.TokenizedGenerateReqInput(rid="c", input_text=None, input_ids=prompt,
                                                           sampling_params=sp)])
    out = drain(s)["c"]
    assert out["finish"] == {"type": "stop", "matched": "nine,"}
    assert "nine," in tok.decode(out["ids"]) and len(out["ids"]) < 30


def test_grammar_complete_before_min_new_tokens_ends_as_stop(embedded_model_path) -> None:
    """min_new_tokens holds EOS back while a regex is already complete: the request ends with the complete text
    (finish_reason stop), not with an abort."""
    import re
    import time

    from radixserve.managers.scheduler import Scheduler
    from radixserve.managers.tokenizer_utils import get_tokenizer
    from radixserve.server_args import ServerArgs

    tok = get_tokenizer(embedded_model_path)
    s = Scheduler(ServerArgs(model_path=embedded_model_path, max_total_tokens=2048), port_args={})
    sp = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 12, "min_new_tokens": 6,
                                   "regex": "(yes|no)"})
    sp.normalize(tok)
    s.process_input_requests([io.TokenizedGenerateReqInput(
        rid="g", input_text=None, input_ids=tok.encode("Is the sky blue? Answer:"), sampling_params=sp)])
    deadline = time.monotonic() + 60
    while s.grammar_queue and time.monotonic() < deadline:  # the grammar compiles on a worker thread
        s.step()
        time.sleep(0.01)
    out = drain(s)["g"]
    assert out["finish"]["type"] == "stop", out["finish"]
    assert re.fullmatch("(yes|no)", tok.decode(out["ids"], skip_special_tokens=True))
