"""Sampling: parameters, penalties, batch info and the sampler, on logits directly (CPU, no model)."""

from __future__ import annotations

import math
import os
import random
from dataclasses import dataclass, field

import pytest
import torch

from radixserve.layers.logits_processor_output import LogitsProcessorOutput
from radixserve.layers.sampler import Sampler, seeded_exponential_noise
from radixserve.sampling.penaltylib import (
    BatchedFrequencyPenalizer,
    BatchedMinNewTokensPenalizer,
    BatchedPenalizerOrchestrator,
    BatchedPresencePenalizer,
    BatchedRepetitionPenalizer,
)
from radixserve.sampling.sampling_batch_info import SamplingBatchInfo
from radixserve.sampling.sampling_params import SamplingParams

V = 32
DEVICE = os.environ.get("RADIXSERVE_TEST_DEVICE", "cpu")  # the sampling state lives here


@dataclass
class FakeReq:
    sampling_params: SamplingParams
    origin_input_ids: list[int] = field(default_factory=list)
    output_ids: list[int] = field(default_factory=list)
    eos_token_ids: set[int] = field(default_factory=set)


@dataclass
class FakeBatch:
    reqs: list[FakeReq]
    device: str = DEVICE


def req(prompt: list[int] | None = None, output: list[int] | None = None, eos: set[int] | None = None,
        **params: object) -> FakeReq:
    p = SamplingParams(**params)
    p.verify(V)
    p.normalize(None)
    return FakeReq(p, list(prompt or [0]), list(output or []), set(eos or ()))


def info_of(*reqs: FakeReq, vocab: int = V) -> SamplingBatchInfo:
    return SamplingBatchInfo.from_schedule_batch(FakeBatch(list(reqs)), vocab)


def sample(info: SamplingBatchInfo, logits: torch.Tensor, return_logprob: bool = False,
           nums: list[int] | None = None) -> tuple[torch.Tensor, LogitsProcessorOutput]:
    out = LogitsProcessorOutput(next_token_logits=logits.clone())
    ids = Sampler()(out, info, return_logprob, nums)
    return ids, out


def processed(info: SamplingBatchInfo, logits: torch.Tensor) -> torch.Tensor:
    x = logits.clone()
    info.apply_logits_bias(x)
    return x


def counts_of(ids: torch.Tensor, vocab: int = V) -> torch.Tensor:
    return torch.bincount(ids, minlength=vocab).float()


def logits_from_probs(probs: list[float], vocab: int = V) -> torch.Tensor:
    """A row whose softmax puts these probabilities on the first tokens and (almost) nothing elsewhere."""
    row = torch.full((vocab,), -1e4)
    row[: len(probs)] = torch.log(torch.tensor(probs))
    return row


# ---------------------------------------------------------------------------------------------- SamplingParams
BAD_PARAMS = [
    ("temperature", -0.1),
    ("temperature", 100.5),
    ("temperature", "hot"),
    ("temperature", float("nan")),
    ("temperature", True),
    ("top_p", 0.0),
    ("top_p", 1.5),
    ("top_p", None),
    ("top_k", 0),
    ("top_k", -2),
    ("top_k", 2.5),
    ("top_k", True),
    ("min_p", -0.01),
    ("min_p", 1.01),
    ("frequency_penalty", 2.5),
    ("frequency_penalty", -2.01),
    ("presence_penalty", -3),
    ("presence_penalty", "x"),
    ("repetition_penalty", 0.0),
    ("repetition_penalty", 2.01),
    ("repetition_penalty", -1.0),
    ("max_new_tokens", -1),
    ("max_new_tokens", 1.5),
    ("max_new_tokens", False),
    ("max_new_tokens", None),
    ("n", 0),
    ("n", 129),
    ("n", "2"),
    ("seed", -1),
    ("seed", 1.0),
    ("seed", 2**63),
    ("logit_bias", {5: 101.0}),
    ("logit_bias", {5: -100.5}),
    ("logit_bias", {-1: 1.0}),
    ("logit_bias", {V: 1.0}),
    ("logit_bias", {"abc": 1.0}),
    ("logit_bias", {1.5: 1.0}),
    ("logit_bias", {3: "big"}),
    ("logit_bias", [1, 2]),
    ("stop", ""),
    ("stop", ["ok", ""]),
    ("stop", ["s"] * 17),
    ("stop", 5),
    ("stop", ["ok", 3]),
    ("stop_token_ids", [V]),
    ("stop_token_ids", [-1]),
    ("stop_token_ids", ["3"]),
    ("stop_token_ids", 3),
    ("ignore_eos", "yes"),
    ("skip_special_tokens", 1),
    ("no_stop_trim", None),
    ("json_schema", {"type": "object"}),
    ("regex", 5),
]


@pytest.mark.parametrize(("name", "value"), BAD_PARAMS, ids=[f"{n}={v!r}"[:40] for n, v in BAD_PARAMS])
def test_verify_rejects_bad_value_naming_field(name: str, value: object) -> None:
    p = SamplingParams(**{name: value})
    with pytest.raises(ValueError) as exc:
        p.verify(V)
    assert str(exc.value).startswith(name), str(exc.value)


def test_verify_rejects_min_new_tokens_above_max_and_two_grammars() -> None:
    with pytest.raises(ValueError, match=r"^min_new_tokens .*\[0, max_new_tokens=4\]"):
        SamplingParams(max_new_tokens=4, min_new_tokens=5).verify(V)
    with pytest.raises(ValueError, match=r"^min_new_tokens"):
        SamplingParams(min_new_tokens=-1).verify(V)
    with pytest.raises(ValueError, match="at most one of json_schema, regex, ebnf"):
        SamplingParams(regex="a+", ebnf="root ::= 'a'").verify(V)


def test_verify_messages_give_allowed_range() -> None:
    with pytest.raises(ValueError, match=r"top_p must be a number in \(0, 1\]"):
        SamplingParams(top_p=0).verify()
    with pytest.raises(ValueError, match=r"repetition_penalty must be a number in \(0, 2\]"):
        SamplingParams(repetition_penalty=3).verify()
    with pytest.raises(ValueError, match=r"logit_bias must be token ids that are integers in \[0, 32\)"):
        SamplingParams(logit_bias={"40": 1}).verify(V)


def test_verify_accepts_edge_values() -> None:
    SamplingParams().verify(V)
    SamplingParams(
        max_new_tokens=0, min_new_tokens=0, temperature=100, top_p=1, top_k=V * 10, min_p=1.0,
        frequency_penalty=-2, presence_penalty=2, repetition_penalty=2, logit_bias={"0": -100, V - 1: 100},
        stop=["a"] * 16, stop_token_ids=[0, V - 1], n=128, seed=0, json_schema='{"type": "object"}',
    ).verify(V)
    SamplingParams(logit_bias={10**6: 1.0}).verify(None)  # no vocabulary: only the lower bound is checked


def test_greedy_normalisation() -> None:
    p = SamplingParams(temperature=0.0, top_k=50, top_p=0.5)
    assert p.is_greedy and p.top_k == 1 and p.temperature == 1.0
    p = SamplingParams(temperature=0.7, top_k=1)
    assert p.is_greedy and p.temperature == 1.0
    p = SamplingParams(temperature=0.7)
    assert not p.is_greedy and p.top_k == -1
    p = SamplingParams(temperature=-1.0)  # left alone for verify() to reject
    with pytest.raises(ValueError, match="^temperature"):
        p.verify()


def test_from_dict_rejects_unknown_keys_and_round_trips() -> None:
    with pytest.raises(ValueError, match="unknown sampling parameter.*bogus.*max_tokens"):
        SamplingParams.from_dict({"temperature": 0.5, "max_tokens": 3, "bogus": 1})
    with pytest.raises(ValueError, match="unknown sampling parameter.*stop_str_max_len"):
        SamplingParams.from_dict({"stop_str_max_len": 3})
    with pytest.raises(ValueError):
        SamplingParams.from_dict([("temperature", 0.5)])  # type: ignore[arg-type]
    p = SamplingParams.from_dict({"temperature": 0.5, "stop": "x", "seed": 3})
    assert p.temperature == 0.5 and p.seed == 3
    assert SamplingParams.from_dict(p.to_dict()) == p
    assert SamplingParams.from_dict(None) == SamplingParams()
    nulls = {name: None for name in SamplingParams.field_names()}  # null is each field's default
    assert SamplingParams.from_dict(nulls) == SamplingParams()
    with pytest.raises(TypeError):
        SamplingParams(0.5)  # type: ignore[misc]  # keyword-only


class CharTokenizer:
    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        return [ord(c) for c in text] + ([1] if add_special_tokens else [])


@pytest.mark.parametrize(("name", "value"), [("logit_bias", [1, 2]), ("stop", ["a", 3]), ("stop", 5),
                                           ("stop_token_ids", 3), ("stop_token_ids", ["x"]), ("top_p", 2.0)])
def test_normalize_before_verify_raises_value_error_naming_field(name: str, value: object) -> None:
    with pytest.raises(ValueError) as exc:
        SamplingParams(**{name: value}).normalize(CharTokenizer())
    assert str(exc.value).startswith(name)


def test_normalize() -> None:
    p = SamplingParams(stop="END", logit_bias={"3": 1, 4: -2.5}, stop_token_ids=None)
    p.verify(V)
    p.normalize(CharTokenizer())
    assert p.stop == ["END"] and p.stop_token_ids == []
    assert p.logit_bias == {3: 1.0, 4: -2.5}
    assert p.stop_str_max_len == 3  # no special tokens counted
    p = SamplingParams(stop=["a", "hello"])
    p.normalize(None)
    assert p.stop_str_max_len == 5
    p = SamplingParams()
    p.normalize(CharTokenizer())
    assert p.stop == [] and p.stop_str_max_len == 0


# ---------------------------------------------------------------------------------------------- penalties
def test_repetition_penalty_prompt_and_output() -> None:
    info = info_of(req(prompt=[1], output=[2], repetition_penalty=2.0))
    logits = torch.zeros(1, V)
    logits[0, 1], logits[0, 2], logits[0, 3], logits[0, 4] = 2.0, -2.0, 3.0, -3.0
    x = processed(info, logits)
    assert x[0, 1] == 1.0  # seen in the prompt, positive: divided
    assert x[0, 2] == -4.0  # seen in the output, negative: multiplied
    assert x[0, 3] == 3.0 and x[0, 4] == -3.0  # unseen: unchanged
    info.update_penalties(torch.tensor([3]))
    x = processed(info, logits)
    assert x[0, 3] == 1.5 and x[0, 4] == -3.0


def test_frequency_and_presence_count_output_only() -> None:
    info = info_of(
        req(prompt=[6, 6], output=[4, 4, 5], frequency_penalty=0.5, presence_penalty=0.25),
        req(prompt=[6], output=[4, 4, 5], frequency_penalty=1.0),
        req(prompt=[6], output=[4, 4, 5], presence_penalty=-1.0),
    )
    x = processed(info, torch.zeros(3, V))
    torch.testing.assert_close(x[0, [4, 5, 6, 7]], torch.tensor([-1.25, -0.75, 0.0, 0.0]))
    torch.testing.assert_close(x[1, [4, 5, 6]], torch.tensor([-2.0, -1.0, 0.0]))
    torch.testing.assert_close(x[2, [4, 5, 6]], torch.tensor([1.0, 1.0, 0.0]))
    info.update_penalties(torch.tensor([4, 6, 6]))
    x = processed(info, torch.zeros(3, V))
    torch.testing.assert_close(x[0, [4, 5, 6]], torch.tensor([-1.75, -0.75, 0.0]))
    torch.testing.assert_close(x[1, [4, 5, 6]], torch.tensor([-2.0, -1.0, -1.0]))
    torch.testing.assert_close(x[2, [4, 5, 6]], torch.tensor([1.0, 1.0, 1.0]))


def test_min_new_tokens_masks_eos_and_stop_ids_until_reached() -> None:
    info = info_of(
        req(eos={7}, min_new_tokens=2, stop_token_ids=[3], temperature=0),
        req(eos={7}, temperature=0),
    )
    logits = torch.zeros(2, V)
    logits[:, 7], logits[:, 3], logits[:, 9] = 10.0, 9.0, 8.0
    for _ in range(2):
        x = processed(info, logits)
        assert x[0, 7] == -math.inf and x[0, 3] == -math.inf and x[0, 9] == 8.0
        assert x[1, 7] == 10.0  # its neighbour is not masked
        ids, _ = sample(info, logits)
        assert ids.tolist() == [9, 7]
        info.update_penalties(ids)
    x = processed(info, logits)
    assert x[0, 7] == 10.0 and x[0, 3] == 9.0
    ids, _ = sample(info, logits)
    assert ids.tolist() == [7, 7]


def test_min_new_tokens_counts_existing_output() -> None:
    info = info_of(req(output=[1, 2], eos={7}, min_new_tokens=3))
    assert processed(info, torch.zeros(1, V))[0, 7] == -math.inf
    info.update_penalties(torch.tensor([5]))
    assert processed(info, torch.zeros(1, V))[0, 7] == 0.0


def test_penalizers_allocate_only_when_needed() -> None:
    plain = info_of(req(), req(temperature=0.5, top_p=0.9, seed=3))
    orch = plain.penalizer_orchestrator
    assert not orch.is_required and plain.logit_bias is None
    assert all(not p.is_prepared for p in orch.penalizers.values())
    plain.update_penalties(torch.tensor([1, 2]))  # a no-op for penalties, still counts steps
    assert plain.sampling_steps.tolist() == [1, 1]

    needy = info_of(req(repetition_penalty=1.5, prompt=[4]), req(logit_bias={1: 5.0}))
    assert needy.penalizer_orchestrator.get_penalizer(BatchedRepetitionPenalizer).is_prepared
    assert not needy.penalizer_orchestrator.get_penalizer(BatchedFrequencyPenalizer).is_prepared
    plain.merge_batch(needy)
    rep = plain.penalizer_orchestrator.get_penalizer(BatchedRepetitionPenalizer)
    assert rep.is_prepared and rep.seen.shape == (4, V)
    assert plain.logit_bias is not None and plain.logit_bias.shape == (4, V)
    plain.filter_batch([0, 1])  # the rows that needed them are gone: state is released
    assert not plain.penalizer_orchestrator.is_required and plain.logit_bias is None


# ---------------------------------------------------------------------------------------------- filter / merge
def reference_processed(rows: list[dict], logits: torch.Tensor) -> torch.Tensor:
    """Per-row Python reference of penalties + bias, from each row's full history."""
    out = logits.clone()
    for i, r in enumerate(rows):
        p: SamplingParams = r["params"]
        for t in set(r["prompt"]) | set(r["output"]):
            if p.repetition_penalty != 1:
                v = out[i, t]
                out[i, t] = v / p.repetition_penalty if v > 0 else v * p.repetition_penalty
        for t in set(r["output"]):
            out[i, t] -= p.frequency_penalty * r["output"].count(t) + p.presence_penalty
        if len(r["output"]) < p.min_new_tokens:
            for t in r["eos"] | set(p.stop_token_ids or []):
                out[i, t] = -math.inf
        for t, b in (p.logit_bias or {}).items():
            out[i, int(t)] += b
    return out


def random_row(rng: random.Random) -> dict:
    kw: dict = {}
    if rng.random() < 0.5:
        kw["frequency_penalty"] = rng.choice([-0.5, 0.3, 1.0])
    if rng.random() < 0.5:
        kw["presence_penalty"] = rng.choice([-1.0, 0.7])
    if rng.random() < 0.4:
        kw["repetition_penalty"] = rng.choice([0.8, 1.3])
    if rng.random() < 0.4:
        kw["min_new_tokens"] = rng.randint(1, 4)
        kw["stop_token_ids"] = [rng.randrange(V)]
    if rng.random() < 0.3:
        kw["logit_bias"] = {str(rng.randrange(V)): rng.uniform(-5, 5)}
    if rng.random() < 0.5:
        kw["seed"] = rng.randrange(1000)
    kw["temperature"] = rng.choice([0.0, 0.5, 1.0])
    return {"prompt": [rng.randrange(V) for _ in range(rng.randint(1, 6))],
            "output": [rng.randrange(V) for _ in range(rng.randint(0, 3))], "eos": {rng.randrange(V)}, "kw": kw}


def make_batch(rows: list[dict]) -> SamplingBatchInfo:
    reqs = [req(prompt=r["prompt"], output=r["output"], eos=r["eos"], **r["kw"]) for r in rows]
    for r, q in zip(rows, reqs, strict=True):
        r["params"] = q.sampling_params
    return info_of(*reqs)


@pytest.mark.parametrize("seed", range(5))
def test_filter_and_merge_keep_rows_aligned(seed: int) -> None:
    rng = random.Random(seed)
    torch.manual_seed(seed)
    rows = [random_row(rng) for _ in range(rng.randint(1, 5))]
    info = make_batch(rows)
    for _ in range(12):
        logits = torch.randn(len(rows), V)
        torch.testing.assert_close(processed(info, logits), reference_processed(rows, logits))
        steps = [len(r["output"]) for r in rows]
        assert info.sampling_steps.tolist() == steps
        assert info.seeds.tolist() == [r["params"].seed if r["params"].seed is not None else -1 for r in rows]
        ids, _ = sample(info, logits)
        info.update_penalties(ids)
        for r, t in zip(rows, ids.tolist(), strict=True):
            r["output"].append(t)
        action = rng.random()
        if action < 0.35 and rows:
            keep = sorted(rng.sample(range(len(rows)), rng.randint(0, len(rows))))
            rng.shuffle(keep)
            info.filter_batch(keep)
            rows = [rows[i] for i in keep]
        elif action < 0.7:
            new_rows = [random_row(rng) for _ in range(rng.randint(0, 3))]
            info.merge_batch(make_batch(new_rows))
            rows = rows + new_rows
        assert info.batch_size == len(rows) == info.temperatures.shape[0]


def test_orchestrator_directly_and_tensor_keep_indices() -> None:
    reqs = [req(output=[1, 1], frequency_penalty=1.0), req(output=[2], frequency_penalty=2.0), req()]
    orch = BatchedPenalizerOrchestrator(V, DEVICE, reqs)
    assert orch.is_required
    orch.cumulate_output_tokens(torch.tensor([1, 2, 3], dtype=torch.int32))
    orch.filter(torch.tensor([1, 0]))
    x = torch.zeros(2, V)
    orch.apply(x)
    assert x[0, 2] == -4.0 and x[1, 1] == -3.0
    with pytest.raises(ValueError, match="keep_indices"):
        orch.filter([5])
    with pytest.raises(ValueError, match="logits"):
        orch.apply(torch.zeros(3, V))
    pres = BatchedPenalizerOrchestrator(V, DEVICE, [req(output=[9], presence_penalty=1.0)])
    orch.merge(pres)
    x = torch.zeros(3, V)
    orch.apply(x)
    assert x[2, 9] == -1.0 and x[0, 2] == -4.0 and x[2, 2] == 0.0
    assert orch.get_penalizer(BatchedPresencePenalizer).is_prepared
    assert not orch.get_penalizer(BatchedMinNewTokensPenalizer).is_prepared


# ---------------------------------------------------------------------------------------------- sampler
def test_logit_bias_forces_and_bans() -> None:
    torch.manual_seed(0)
    n = 200
    info = info_of(*[req(logit_bias={"5": 100.0})] * n)
    ids, _ = sample(info, torch.randn(n, V) * 3)
    assert (ids == 5).all()
    logits = torch.zeros(n, V)
    logits[:, 4] = 20.0
    info = info_of(*[req(logit_bias={4: -100.0})] * n)
    ids, _ = sample(info, logits)
    assert (ids != 4).all()


def test_top_k_one_and_temperature_zero_equal_argmax() -> None:
    torch.manual_seed(1)
    logits = torch.randn(64, V) * 4
    expected = logits.argmax(-1)
    for kw in ({"top_k": 1, "temperature": 0.8}, {"temperature": 0.0}, {"temperature": 0.0, "top_p": 0.3}):
        info = info_of(*[req(**kw)] * 64)
        assert info.is_all_greedy
        ids, _ = sample(info, logits)
        assert torch.equal(ids, expected)


def test_greedy_rows_in_mixed_batch_are_exact_argmax() -> None:
    torch.manual_seed(2)
    logits = torch.randn(40, V)
    logits[:, 3] = logits[:, 7] = 10.0  # a tie: argmax takes the first
    reqs = [req(temperature=0.0) if i % 2 == 0 else req(temperature=1.5, top_p=0.9, seed=i) for i in range(40)]
    info = info_of(*reqs)
    assert not info.is_all_greedy and info.has_greedy
    ids, _ = sample(info, logits)
    assert (ids[0::2] == 3).all()


def test_top_k_keeps_k_most_likely() -> None:
    n = 4000
    info = info_of(*[req(top_k=2)] * n)
    ids, _ = sample(info, logits_from_probs([0.1, 0.4, 0.3, 0.2]).repeat(n, 1))
    c = counts_of(ids)
    assert c[0] == 0 and c[3] == 0 and c[4:].sum() == 0
    assert abs(c[1] / n - 4 / 7) < 0.04


def test_top_p_keeps_minimal_nucleus() -> None:
    torch.manual_seed(3)
    n = 4000
    logits = logits_from_probs([0.5, 0.3, 0.15, 0.05]).repeat(n, 1)
    ids, _ = sample(info_of(*[req(top_p=0.7)] * n), logits)
    c = counts_of(ids)
    assert c[2:].sum() == 0  # outside the nucleus {0, 1}: never sampled
    assert abs(c[0] / n - 0.5 / 0.8) < 0.04 and c[1] > 0
    ids, _ = sample(info_of(*[req(top_p=0.45)] * n), logits)
    assert (ids == 0).all()
    ids, _ = sample(info_of(*[req(top_p=0.95)] * n), logits)
    c = counts_of(ids)
    assert c[3] == 0 and c[2] > 0


def test_top_p_is_relative_to_top_k_mass() -> None:
    # top-k 2 leaves [0.4, 0.3] -> renormalised [4/7, 3/7]; top-p 0.5 then keeps token 0 only.
    n = 2000
    ids, _ = sample(info_of(*[req(top_k=2, top_p=0.5)] * n), logits_from_probs([0.4, 0.3, 0.2, 0.1]).repeat(n, 1))
    assert (ids == 0).all()


def test_min_p_drops_tokens_below_fraction_of_max() -> None:
    torch.manual_seed(4)
    n = 4000
    ids, _ = sample(info_of(*[req(min_p=0.2)] * n), logits_from_probs([0.5, 0.3, 0.15, 0.05]).repeat(n, 1))
    c = counts_of(ids)
    assert c[3] == 0 and c[4:].sum() == 0  # 0.05 < 0.2 * 0.5
    assert c[2] > 0
    torch.testing.assert_close(c[:3] / n, torch.tensor([0.5, 0.3, 0.15]) / 0.95, atol=0.04, rtol=0)


@pytest.mark.parametrize("temperature", [0.5, 1.0, 2.0])
def test_temperature_shapes_distribution(temperature: float) -> None:
    torch.manual_seed(5)
    n = 20000
    base = torch.full((V,), -1e4)
    base[:3] = torch.tensor([2.0, 1.0, 0.0])
    ids, _ = sample(info_of(*[req(temperature=temperature)] * n), base.repeat(n, 1))
    expected = torch.softmax(torch.tensor([2.0, 1.0, 0.0]) / temperature, dim=0)
    torch.testing.assert_close(counts_of(ids)[:3] / n, expected, atol=0.02, rtol=0)


def run_steps(rows: list[FakeReq], logits_fn, steps: int) -> list[list[int]]:
    """Sample `steps` tokens for a batch; logits_fn(step, bs) gives the logits."""
    info = info_of(*rows)
    out: list[list[int]] = [[] for _ in rows]
    for s in range(steps):
        ids, _ = sample(info, logits_fn(s, len(rows)))
        info.update_penalties(ids)
        for i, t in enumerate(ids.tolist()):
            out[i].append(t)
    return out


def test_seeded_rows_reproducible_across_batch_compositions_and_orders() -> None:
    gen = torch.Generator().manual_seed(6)
    # The same logits for every row at a given step, with ties (as bf16 logits have) at every cut.
    table = torch.randn(20, V, generator=gen, device="cpu").to(torch.bfloat16).float()
    table[:, 8:16] = table[:, 0:1]
    table = table.to(torch.get_default_device())
    fn = lambda s, bs: table[s].repeat(bs, 1)
    target = dict(seed=1234, temperature=0.9)
    alone = run_steps([req(**target)], fn, 20)[0]
    torch.manual_seed(100)
    mixed = run_steps([req(temperature=1.3), req(seed=7, top_p=0.8), req(**target), req(temperature=0),
                       req(top_k=3, frequency_penalty=1.0, logit_bias={2: 3.0})], fn, 20)
    torch.manual_seed(200)
    reversed_ = run_steps([req(min_p=0.3, seed=99), req(**target), req(repetition_penalty=1.5, top_k=5)], fn, 20)
    cut = dict(seed=77, top_k=10, top_p=0.9, min_p=0.05)
    cut_alone = run_steps([req(**cut)], fn, 20)[0]
    cut_mixed = run_steps([req(top_k=3), req(temperature=0), req(**cut), req(top_p=0.5)], fn, 20)[2]
    assert cut_mixed == cut_alone
    assert mixed[2] == alone
    assert reversed_[1] == alone
    assert len(set(alone)) > 3  # it really sampled


def test_different_seeds_differ_and_same_seed_repeats() -> None:
    fn = lambda s, bs: torch.zeros(bs, V)  # uniform: every sequence equally likely
    seqs = run_steps([req(seed=s) for s in range(8)] + [req(seed=3)], fn, 30)
    assert len({tuple(x) for x in seqs[:8]}) == 8
    assert seqs[8] == seqs[3]


def test_seeded_sampling_follows_distribution() -> None:
    probs = [0.6, 0.25, 0.1, 0.05]
    n = 6000
    across = run_steps([req(seed=s) for s in range(n)], lambda s, bs: logits_from_probs(probs).repeat(bs, 1), 1)
    c = counts_of(torch.tensor([x[0] for x in across]))
    torch.testing.assert_close(c[:4] / n, torch.tensor(probs), atol=0.025, rtol=0)
    over_time = run_steps([req(seed=42)], lambda s, bs: logits_from_probs(probs).repeat(bs, 1), 1500)[0]
    c = counts_of(torch.tensor(over_time))
    torch.testing.assert_close(c[:4] / 1500, torch.tensor(probs), atol=0.05, rtol=0)


def test_seeded_noise_is_pure_and_exponential() -> None:
    a = seeded_exponential_noise(torch.tensor([5, 2**62 + 1]), torch.tensor([3, 0]), 4096)
    b = seeded_exponential_noise(torch.tensor([2**62 + 1, 5]), torch.tensor([0, 3]), 4096)
    assert torch.equal(a, b.flip(0))
    assert (a > 0).all() and torch.isfinite(a).all()
    assert abs(a.mean().item() - 1.0) < 0.05
    c = seeded_exponential_noise(torch.tensor([5]), torch.tensor([4]), 4096)
    assert not torch.equal(a[0], c[0])


def test_logprobs_are_log_softmax_of_processed_distribution() -> None:
    torch.manual_seed(8)
    reqs = [
        req(prompt=[1, 2], temperature=0.7, top_k=5, repetition_penalty=1.4, logit_bias={3: 2.0}),
        req(prompt=[4], output=[5], temperature=0, frequency_penalty=1.0),  # greedy: full distribution, T=1
        req(temperature=1.2, top_p=0.6, seed=3),
        req(temperature=0.8, min_p=0.1),
    ]
    info = info_of(*reqs)
    logits = torch.randn(4, V) * 2
    proc = processed(info_of(*reqs), logits)
    expected = torch.empty_like(proc)
    row0 = proc[0] / 0.7
    keep = row0.topk(5).indices
    expected[0] = torch.log_softmax(torch.full_like(row0, -math.inf).index_fill(0, keep, 0) + row0, -1)
    expected[1] = torch.log_softmax(proc[1], -1)
    p2 = torch.softmax(proc[2] / 1.2, -1)
    srt, order = p2.sort(descending=True)
    before = torch.cumsum(srt, 0) - srt
    keep2 = order[before < 0.6]
    expected[2] = torch.log_softmax(torch.full_like(p2, -math.inf).index_fill(0, keep2, 0) + proc[2] / 1.2, -1)
    p3 = torch.softmax(proc[3] / 0.8, -1)
    row3 = (proc[3] / 0.8).masked_fill(p3 < 0.1 * p3.max(), -math.inf)
    expected[3] = torch.log_softmax(row3, -1)

    nums = [8, 0, 5, 1]  # 8 from a row top-k 5 keeps: the removed ones at LOGPROB_FLOOR (-inf is not JSON)
    ids, out = sample(info, logits, return_logprob=True, nums=nums)
    assert ids[1] == proc[1].argmax()
    torch.testing.assert_close(out.next_token_logprobs, expected.gather(1, ids.view(-1, 1)).view(-1))
    assert torch.isfinite(out.next_token_logprobs).all()  # a sampled token is never a filtered one
    for i, k in enumerate(nums):
        vals, idx = expected[i].topk(k) if k else (torch.empty(0), torch.empty(0, dtype=torch.int64))
        finite = int(torch.isfinite(vals).sum())  # (the removed ones tie: any order)
        assert out.next_token_top_logprobs_idx[i][:finite] == idx.tolist()[:finite]
        torch.testing.assert_close(torch.tensor(out.next_token_top_logprobs_val[i]), vals.clamp_min(-9999.0))
    assert out.next_token_top_logprobs_val[0][5:] == [-9999.0] * 3


def test_all_greedy_logprobs_and_no_top_logprobs() -> None:
    logits = torch.randn(3, V)
    info = info_of(*[req(temperature=0)] * 3)
    ids, out = sample(info, logits, return_logprob=True, nums=None)
    torch.testing.assert_close(out.next_token_logprobs, torch.log_softmax(logits, -1).max(-1).values)
    assert out.next_token_top_logprobs_val == [[], [], []]
    with pytest.raises(ValueError, match="top_logprobs_nums"):
        sample(info, logits, return_logprob=True, nums=[1])


def test_vocab_mask_and_bf16_logits() -> None:
    info = info_of(req(temperature=0), req(temperature=1.0))
    info.vocab_mask = torch.ones(2, V, dtype=torch.bool)
    info.vocab_mask[:, 11] = False
    out = LogitsProcessorOutput(next_token_logits=torch.randn(2, V, dtype=torch.bfloat16))
    ids = Sampler()(out, info, False, None)
    assert ids.tolist() == [11, 11] and ids.dtype == torch.int64
    info.filter_batch([1])
    assert info.vocab_mask.shape == (1, V)


def test_empty_batch() -> None:
    info = info_of()
    assert info.batch_size == 0 and info.is_all_greedy
    ids, out = sample(info, torch.zeros(0, V), return_logprob=True, nums=[])
    assert ids.shape == (0,)
    info.merge_batch(info_of(req(seed=1)))
    assert info.has_seeded and info.batch_size == 1
    info.filter_batch([])
    assert info.batch_size == 0 and not info.has_seeded


def test_shape_mismatch_is_an_error() -> None:
    info = info_of(req())
    with pytest.raises(ValueError, match="logits"):
        info.apply_logits_bias(torch.zeros(2, V))
    with pytest.raises(ValueError, match="vocab_size"):
        info.merge_batch(info_of(req(), vocab=V + 1))
    with pytest.raises(ValueError, match="logit_bias"):
        info_of(FakeReq(SamplingParams(logit_bias={V + 3: 1.0})))


def test_in_graph_greedy_ids_used_only_when_nothing_changes_the_logits() -> None:
    """A decode CUDA graph hands the sampler the argmax of its raw logits; the sampler returns it only for an
    all-greedy batch without penalties, bias, grammar mask or logprobs, and samples normally otherwise."""
    logits = torch.randn(2, V, generator=torch.Generator().manual_seed(0)).to(DEVICE)
    marker = torch.tensor([7, 9], device=DEVICE)  # not the argmax: shows which path ran

    def run(info: SamplingBatchInfo, return_logprob: bool = False) -> torch.Tensor:
        out = LogitsProcessorOutput(next_token_logits=logits.clone(), greedy_token_ids=marker)
        return Sampler()(out, info, return_logprob, [0, 0])

    plain = info_of(req(temperature=0), req(temperature=0))
    assert run(plain) is marker
    assert torch.equal(run(plain, return_logprob=True), logits.argmax(-1))
    sampled = info_of(req(temperature=0), req(temperature=1.0, seed=3))
    assert not torch.equal(run(sampled), marker)
    penalised = info_of(req(temperature=0, frequency_penalty=1.0, output=[int(logits[0].argmax())]),
                        req(temperature=0))
    assert penalised.penalizer_orchestrator.is_required
    assert not torch.equal(run(penalised), marker)
    biased = info_of(req(temperature=0, logit_bias={"3": 100.0}), req(temperature=0))
    assert run(biased)[0].item() == 3
    masked = info_of(req(temperature=0), req(temperature=0))
    masked.vocab_mask = torch.zeros(2, V, dtype=torch.bool, device=DEVICE)
    assert not torch.equal(run(masked), marker)
