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
    res, s = run(path, [("rep", prompt, 24)], speculative_algorithm="ngram")
    plain, _ = run(path, [("rep", prompt, 24)])
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


def _chi2_critical(df: int, z: float = 3.09) -> float:
    """The chi-square quantile at 1 - 0.001 (Wilson-Hilferty; z = the normal quantile)."""
    a = 2.0 / (9.0 * df)
    return df * (1.0 - a + z * a ** 0.5) ** 3


def test_sampling_with_speculation_keeps_the_target_distribution(tmp_path) -> None:
    """Temperature 1 on an 8-token vocabulary, three tokens per request; whatever the first token t1 is, the
    prompt's n-grams draft 6 for the second: the joint distribution of the second and third tokens matches the
    model's exact one, sum over t1 of p(t1) p(t2 | t1) p(t3 | t1, t2) (chi-square, 64 cells)."""
    import torch

    model = make_tiny_model("llama", str(tmp_path), seed=3, vocab_size=8)
    prompt = [t for x in range(8) for t in (5, x, 6)] + [5]  # (5, x) -> 6 for every x
    with torch.no_grad():
        p1 = torch.softmax(model(torch.tensor([prompt])).logits[0, -1].double(), -1)
        seqs = torch.tensor([prompt + [a, b] for a in range(8) for b in range(8)])
        logits = model(seqs).logits.double()
        p2 = torch.softmax(logits[::8, -2], -1)  # [t1, t2]
        p3 = torch.softmax(logits[:, -1], -1).view(8, 8, 8)  # [t1, t2, t3]
        joint = (p1.view(8, 1, 1) * p2.view(8, 8, 1) * p3).sum(0)
    n = 1500
    s = make_scheduler(str(tmp_path), speculative_algorithm="ngram", random_seed=5)
    for i in range(n):
        submit(s, f"s{i}", prompt, 3, temperature=1.0)
    res = drain(s)
    assert s.spec_num_verify > 0
    counts = torch.zeros(8, 8, dtype=torch.float64)
    for r in res.values():
        _, a, b = r["ids"]
        counts[a, b] += 1
    expected = joint * n
    keep = expected >= 5  # cells too rare for the statistic are pooled into one
    stat = float((((counts - expected) ** 2 / expected)[keep]).sum())
    rest_e, rest_c = float(expected[~keep].sum()), float(counts[~keep].sum())
    cells = int(keep.sum())
    if rest_e > 0:
        stat += (rest_c - rest_e) ** 2 / rest_e
        cells += 1
    assert stat < _chi2_critical(cells - 1), (stat, cells)
    # the draft was right in some requests and wrong in others: both paths ran
    assert 0 < int(counts[6].sum()) < n


def test_backoff_pauses_a_request_whose_drafts_fail() -> None:
    from radixserve.speculative.scheduler_mixin import (
        BACKOFF_FIRST_PAUSE,
        BACKOFF_WINDOW,
        SchedulerSpeculativeMixin,
    )

    class Fake(SchedulerSpeculativeMixin):
        spec_k, context_len = 4, 1000

    from radixserve.managers.schedule_batch import Req
    from radixserve.sampling.sampling_params import SamplingParams

    f = Fake()
    req = Req("r", [1, 2, 3], SamplingParams.from_dict({"max_new_tokens": 100, "temperature": 0}))
    assert f.spec_num_to_draft(req, 3) == 4
    for _ in range(BACKOFF_WINDOW):
        f.spec_backoff(req, 0)
    assert [f.spec_num_to_draft(req, 3) for _ in range(BACKOFF_FIRST_PAUSE)] == [0] * BACKOFF_FIRST_PAUSE
    assert f.spec_num_to_draft(req, 3) == 4  # then it tries again
    for _ in range(BACKOFF_WINDOW):
        f.spec_backoff(req, 0)
    assert req.spec_pause == 2 * BACKOFF_FIRST_PAUSE  # a second failure pauses twice as long
    req2 = Req("q", [1], SamplingParams.from_dict({"max_new_tokens": 3, "temperature": 0}))
    assert f.spec_num_to_draft(req2, 1) == 2  # never drafts past max_new_tokens
    req3 = Req("p", [1], SamplingParams.from_dict({"max_new_tokens": 30, "frequency_penalty": 0.5}))
    assert f.spec_num_to_draft(req3, 1) == 0  # penalties: plain decoding for this request


def test_logprobs_match_plain_decoding(tiny_path) -> None:
    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    out = {}
    for spec in (None, "ngram"):
        s = make_scheduler(tiny_path, speculative_algorithm=spec)
        for rid, prompt, n in repeat_workload(seed=5, n=4):
            params = SamplingParams.from_dict({"max_new_tokens": n, "temperature": 0, "ignore_eos": True})
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=rid, input_text=None, input_ids=prompt, sampling_params=params, return_logprob=True,
                top_logprobs_num=2)])
        out[spec] = drain(s)
    assert out["ngram"].keys() == out[None].keys()
    for rid, plain in out[None].items():
        spec = out["ngram"][rid]
        assert spec["ids"] == plain["ids"]
        a, b = plain["meta"]["output_token_logprobs"], spec["meta"]["output_token_logprobs"]
        assert [t for _, t in a] == [t for _, t in b] and len(a) == len(plain["ids"])
        assert all(abs(x - y) < 1e-4 for (x, _), (y, _) in zip(a, b, strict=True))
        ta, tb = plain["meta"]["output_top_logprobs"], spec["meta"]["output_top_logprobs"]
        assert [[i for _, i in row] for row in ta] == [[i for _, i in row] for row in tb]


@pytest.fixture(scope="module")
def tiny_draft_path(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny_draft"))
    make_tiny_model("llama", path, seed=2, vocab_size=512, num_hidden_layers=1)
    return path


@pytest.mark.parametrize("same", [False, True], ids=["other_draft", "draft_is_target"])
def test_draft_model_greedy_tokens_identical(tiny_path, tiny_draft_path, same) -> None:
    reqs = repeat_workload(seed=9, n=3) + workload(seed=9, n=4)
    plain, _ = run(tiny_path, reqs)
    draft = tiny_path if same else tiny_draft_path
    spec, s = run(tiny_path, reqs, speculative_algorithm="draft_model", speculative_draft_model_path=draft,
                  speculative_num_draft_tokens=3)
    assert {r: v["ids"] for r, v in spec.items()} == {r: v["ids"] for r, v in plain.items()}
    assert s.spec_num_verify > 0
    if same:  # the draft is the target: (nearly) every draft is accepted
        assert s.spec_accept_length() > 2.5
    d = s.spec_drafter
    d.gc()
    assert not d.states
    assert d.token_to_kv_pool.available_size() == d.token_to_kv_pool.size
    assert d.req_to_token_pool.available_size() == d.req_to_token_pool.size


def test_draft_model_flags_are_checked(tiny_path) -> None:
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="draft-model-path"):
        ServerArgs(model_path=tiny_path, speculative_algorithm="draft_model")
    with pytest.raises(ValueError, match="draft-model-path"):
        ServerArgs(model_path=tiny_path, speculative_algorithm="ngram", speculative_draft_model_path=tiny_path)


def test_verify_through_the_triton_extend_kernel(tiny_path) -> None:
    """The verify step is an extend over each request's drafts: through the Triton backend (interpreted on the
    CPU) the tokens are those of plain decoding on the same backend."""
    reqs = [(rid, prompt, min(n, 10)) for rid, prompt, n in repeat_workload(seed=11, n=2)]
    plain, _ = run(tiny_path, reqs, attention_backend="triton")
    spec, s = run(tiny_path, reqs, attention_backend="triton", speculative_algorithm="ngram")
    assert {r: v["ids"] for r, v in spec.items()} == {r: v["ids"] for r, v in plain.items()}
    assert s.spec_num_verify > 0


def test_streaming_emits_each_steps_accepted_tokens(tiny_path) -> None:
    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    s = make_scheduler(tiny_path, speculative_algorithm="ngram")
    prompt = [7, 8, 9, 10, 11] * 6
    params = SamplingParams.from_dict({"max_new_tokens": 24, "temperature": 0, "ignore_eos": True})
    s.process_input_requests([io.TokenizedGenerateReqInput(rid="st", input_text=None, input_ids=prompt,
                                                           sampling_params=params, stream=True)])
    chunks = []
    while s.step() or not s.is_idle():
        for msg in s.outbox:
            if isinstance(msg, io.BatchTokenIDOut):
                chunks += [ids for rid, ids in zip(msg.rids, msg.new_token_ids, strict=True) if rid == "st"]
        s.outbox.clear()
    plain, _ = run(tiny_path, [("st", prompt, 24)])
    assert [t for c in chunks for t in c] == plain["st"]["ids"]
    assert len(chunks) == s.forward_ct  # one message per step (the prefill, then each verify or plain decode)
    if s.spec_accept_length() > 1:
        assert max(len(c) for c in chunks) > 1  # a step that accepted drafts streamed them together


def test_requests_that_cannot_draft_decode_plainly_in_the_same_batches(tiny_path) -> None:
    """Penalties, seeded sampling and min_new_tokens ride in verify batches as one-token rows: their tokens are those
    of plain decoding, next to drafting requests."""
    extra = [{"frequency_penalty": 0.8}, {"repetition_penalty": 1.3}, {"temperature": 0.9, "seed": 11},
             {"min_new_tokens": 12, "ignore_eos": False}, {}]
    reqs = [(rid, prompt, n, extra[i % len(extra)]) for i, (rid, prompt, n) in enumerate(repeat_workload(seed=6,
                                                                                                       n=10))]
    plain, _ = run(tiny_path, reqs)
    spec, s = run(tiny_path, reqs, speculative_algorithm="ngram")
    assert {r: v["ids"] for r, v in spec.items()} == {r: v["ids"] for r, v in plain.items()}
    assert s.spec_num_verify > 0


def test_constrained_requests_draft_within_their_grammar(embedded_model_path) -> None:
    """Greedy requests with a regex / JSON schema draft too: each draft is cut at the first token the matcher
    rejects and every drafted position is masked by the grammar; the tokens are those of plain decoding."""
    pytest.importorskip("xgrammar")
    import json

    from grammar_utils import chat_ids
    from grammar_utils import drain as grammar_drain
    from grammar_utils import submit as grammar_submit

    schema = {"type": "array", "minItems": 3, "maxItems": 3,
              "items": {"type": "object", "properties": {"name": {"type": "string", "maxLength": 8},
                                                         "age": {"type": "integer"}},
                        "required": ["name", "age"]}}
    outs, drafted = {}, []
    for spec in (None, "ngram"):
        s = make_scheduler(embedded_model_path, speculative_algorithm=spec, skip_tokenizer_init=False,
                           dtype="float32", max_total_tokens=8192)
        if spec:
            inner = s.spec_grammar_masks

            def record(reqs, drafts, inner=inner):
                m = inner(reqs, drafts)
                drafted.append(0 if m is None else int(m.shape[0]))
                return m

            s.spec_grammar_masks = record
        tok = s.tokenizer
        grammar_submit(s, "rx", chat_ids(tok, "Say 'the cat sat' three times."), regex=r"(the cat sat\. ){3}",
                       temperature=0, max_new_tokens=40)
        grammar_submit(s, "js", chat_ids(tok, "List three people as JSON."), json_schema=json.dumps(schema),
                       temperature=0, max_new_tokens=60)
        outs[spec] = {rid: r["ids"] for rid, r in grammar_drain(s).items()}
        assert s.check_memory()
    assert outs["ngram"] == outs[None]
    assert sum(drafted) > 0  # constrained requests did draft


def test_verify_batch_becomes_one_decode_row_per_token() -> None:
    """A verify of prefixes 5 and 9 with 3 and 1 new tokens: 3 + 1 decode rows of the two requests, row j of a
    request at position prefix + j reading seq_len prefix + j + 1 (causal over the drafts), LoRA slots repeated."""
    import torch

    from radixserve.managers.schedule_batch import ModelWorkerBatch
    from radixserve.model_executor.forward_batch_info import ForwardMode
    from radixserve.speculative.verify import as_decode_rows

    mwb = ModelWorkerBatch(
        forward_mode=ForwardMode.TARGET_VERIFY, input_ids=torch.arange(4), req_pool_indices=torch.tensor([3, 7]),
        seq_lens=torch.tensor([8, 10]), seq_lens_cpu=[8, 10], out_cache_loc=torch.arange(100, 104), seq_lens_sum=18,
        extend_seq_lens=[3, 1], extend_prefix_lens=[5, 9], return_logprob=False, top_logprobs_nums=None,
        extend_logprob_start_lens_cpu=None, sampling_info=None, sampling_ops=[], req_to_token_writes=[],
        lora_slots=[2, -1])
    rows = as_decode_rows(mwb)
    assert rows.forward_mode == ForwardMode.DECODE
    assert rows.req_pool_indices.tolist() == [3, 3, 3, 7]
    assert rows.seq_lens.tolist() == rows.seq_lens_cpu == [6, 7, 8, 10]
    assert rows.positions.tolist() == [5, 6, 7, 9] and rows.seq_lens_sum == 31
    assert rows.input_ids is mwb.input_ids  # tokens and their KV slots keep the extend's order
    assert rows.lora_slots == [2, 2, 2, -1]
    assert rows.out_cache_loc is mwb.out_cache_loc and rows.extend_seq_lens is None
    with pytest.raises(ValueError, match="extend batch"):
        as_decode_rows(rows)


def test_draft_model_decodes_each_request_only_for_its_own_drafts(tiny_path, tiny_draft_path) -> None:
    """A request near the context length may draft one token while another drafts k: the draft model's k - 1 decode
    steps run only for the requests still drafting (they wrote past the first one's request-table row and crashed)."""
    from types import SimpleNamespace

    s = make_scheduler(tiny_path, context_length=64, speculative_algorithm="draft_model",
                       speculative_draft_model_path=tiny_draft_path, speculative_num_draft_tokens=12)
    d = s.spec_drafter
    near = SimpleNamespace(origin_input_ids=list(range(10, 70)), output_ids=[3, 4], finished=lambda: False)
    far = SimpleNamespace(origin_input_ids=[5, 6, 7], output_ids=[8], finished=lambda: False)
    drafts = d.propose_batch([near, far], [1, 12])
    assert [len(x) for x in drafts] == [1, 12]
    for r in (near, far):
        d.release(r)
    assert d.token_to_kv_pool.available_size() == d.token_to_kv_pool.size
    assert d.req_to_token_pool.available_size() == d.req_to_token_pool.size
    # and through the scheduler: the same tokens as plain decoding
    reqs = [("near", list(range(10, 70)), 4), ("far", [5, 6, 7], 40)]
    plain, _ = run(tiny_path, reqs, context_length=64)
    spec, _ = run(tiny_path, reqs, context_length=64, speculative_algorithm="draft_model",
                  speculative_draft_model_path=tiny_draft_path, speculative_num_draft_tokens=12)
    assert {r: v["ids"] for r, v in spec.items()} == {r: v["ids"] for r, v in plain.items()}


def test_draft_model_pool_is_free_when_idle(tiny_path, tiny_draft_path) -> None:
    """Requests that finish outside a verify step (an abort; a last token decoded plainly, with nothing left to
    draft) gave their draft KV back only at the next round of drafting: an idle server held it. The idle memory
    check releases it and counts the draft model's pools."""
    from radixserve.managers import io_struct as io

    s = make_scheduler(tiny_path, speculative_algorithm="draft_model", speculative_draft_model_path=tiny_draft_path)
    submit(s, "a", [5, 6, 7, 8] * 5, 12)
    submit(s, "b", [9, 10, 11] * 5, 30)
    for _ in range(3):
        s.step()
    s.process_input_requests([io.AbortReq("b")])
    res = drain(s)  # checks s.check_memory()
    assert res["b"]["finish"]["type"] == "abort" and res["a"]["finish"]["type"] == "length"
    d = s.spec_drafter
    assert not d.states
    assert d.token_to_kv_pool.available_size() == d.token_to_kv_pool.size
    assert d.req_to_token_pool.available_size() == d.req_to_token_pool.size
    assert s.invariant_violations == 0 and s.get_internal_state()["memory_ok"]
    # a leak in the draft model's pool is one the check reports
    d.token_to_kv_pool.alloc(3)
    assert not s.check_memory() and s.invariant_violations == 1
