"""Speculative decoding (n-gram drafting, one verify pass): the tokens are those of plain decoding, the pool's
accounting holds after many rejected drafts, and a prompt that repeats itself is drafted well."""

from __future__ import annotations

import random

import pytest
from model_utils import make_tiny_model
from test_scheduler import drain, make_scheduler, submit, workload

from radixserve.speculative.ngram import NgramIndex
from radixserve.speculative.verify import accept


@pytest.fixture(scope="module")
def tiny_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_spec"))
    make_tiny_model("llama", path, seed=1, vocab_size=512)
    return path


def repeat_workload(seed: int = 0, n: int = 6) -> list[tuple[str, list[int], int]]:
    """Prompts that contain a repeated passage (the model is random: it only sometimes copies it)."""
    rng = random.Random(seed)
    out = []
    for i in range(n):
        passage = [rng.randrange(3, 500) for _ in range(rng.randrange(4, 20))]
        prompt = passage * 3 + passage[: rng.randrange(1, len(passage))]
        out.append((f"p{i}", prompt, rng.randrange(4, 30)))
    return out


def run(path: str, reqs, **kw) -> tuple[dict[str, dict], object]:
    s = make_scheduler(path, **kw)
    for rid, prompt, n, *sp in reqs:
        submit(s, rid, prompt, n, **(sp[0] if sp else {}))
    res = drain(s)
    assert s.invariant_violations == 0
    return res, s


def test_ngram_index_proposes_latest_continuation() -> None:
    idx = NgramIndex(2, 3)
    assert idx.propose([1, 2, 3], 2) == []
    assert idx.propose([1, 2, 3, 4, 1, 2], 3) == [3, 4, 1]
    # incremental: the same index, more tokens; the latest occurrence wins
    assert idx.propose([1, 2, 3, 4, 1, 2, 9, 1, 2], 2) == [9, 1]
    assert idx.propose([1, 2, 3, 4, 1, 2, 9, 1, 2], 0) == []


def test_accept_rule() -> None:
    assert accept([[5, 6, 7]], [[5, 6, 8, 1]]) == [[5, 6, 8]]
    assert accept([[5, 6]], [[5, 6, 2]]) == [[5, 6, 2]]  # all accepted: a bonus token
    assert accept([[], [4]], [[9], [3, 7]]) == [[9], [3]]


@pytest.mark.parametrize("kw", [
    {},
    {"disable_radix_cache": True},
    {"chunked_prefill_size": 16},
    {"attention_backend": "torch_native"},
    {"max_running_requests": 2, "speculative_num_draft_tokens": 2},
], ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()) or "default")
def test_greedy_tokens_identical_with_ngram(tiny_path, kw) -> None:
    reqs = repeat_workload() + workload(n=6)
    plain, _ = run(tiny_path, reqs, **kw)
    spec, s = run(tiny_path, reqs, speculative_algorithm="ngram", **kw)
    assert {r: v["ids"] for r, v in spec.items()} == {r: v["ids"] for r, v in plain.items()}
    assert s.spec_num_verify > 0


def test_stops_and_logprobs_match_plain_decoding(tiny_path) -> None:
    reqs = []
    for rid, prompt, n in repeat_workload(seed=3):
        reqs.append((rid, prompt, n, {"stop_token_ids": [prompt[2]], "ignore_eos": False}))
    for rid, prompt, n in repeat_workload(seed=4):
        reqs.append((rid + "b", prompt, n, {"logit_bias": {str(prompt[1]): 2.0}}))
    plain, _ = run(tiny_path, reqs)
    spec, _ = run(tiny_path, reqs, speculative_algorithm="ngram")
    for rid in plain:
        assert spec[rid]["ids"] == plain[rid]["ids"], rid
        assert spec[rid]["finish"] == plain[rid]["finish"], rid


def test_pool_accounting_after_many_rejected_drafts(tiny_path) -> None:
    # random prompts with many repeated bigrams: drafts are found often and almost always rejected
    rng = random.Random(7)
    reqs = [(f"x{i}", [rng.randrange(3, 8) for _ in range(40)], 40) for i in range(8)]
    _, s = run(tiny_path, reqs, speculative_algorithm="ngram", speculative_num_draft_tokens=6,
               max_total_tokens=600)
    assert s.spec_num_verify > 20
    assert s.check_memory()
    state = s.get_internal_state()
    assert state["free_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]


def test_repeat_prompt_accepts_more_than_one_token_per_step(embedded_model_path) -> None:
    from transformers import AutoTokenizer

    path = embedded_model_path

    tok = AutoTokenizer.from_pretrained(path)
    passage = ("The quick brown fox jumps over the lazy dog. A journey of a thousand miles begins with a single "
               "step. To be or not to be, that is the question.")
    msgs = [{"role": "user", "content": f"Repeat this text exactly: {passage}"}]
    text = tok.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    prompt = tok.encode(text, add_special_tokens=False)
    res, s = run(path, [("rep", prompt, 32)], speculative_algorithm="ngram")
    plain, _ = run(path, [("rep", prompt, 32)])
    assert res["rep"]["ids"] == plain["rep"]["ids"]
    meta = res["rep"]["meta"]
    assert meta["spec_accept_length"] > 1.5, meta
    assert s.spec_accept_length() > 1.5


def test_accept_length_reaches_metrics() -> None:
    from prometheus_client import CollectorRegistry

    from radixserve.metrics.collector import MetricsCollector

    m = MetricsCollector("m", registry=CollectorRegistry())
    m.update_scheduler_state({"avg_spec_accept_length": 2.5})
    assert "spec_accept_length{" in m.render().decode() and " 2.5" in m.render().decode()
