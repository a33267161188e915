"""Granite 3.x against transformers in float32 on tiny random models: its four multipliers (embedding, attention,
residual, logits) through the cpu and torch_native backends, chunked prefill with prefix-cache hits, TP=2 (each
rank's partial output scaled before the all-reduce), and prompt logprobs from the divided logits."""

from __future__ import annotations

import pytest
import torch
from model_utils import hf_greedy, make_runner, make_tiny_model
from parallel_utils import INIT_RANGE, SERVER_KW, reference_outputs

from radixserve.bench_one_batch import StaticBatch

PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def granite(path: str, **over: object) -> torch.nn.Module:
    return make_tiny_model("granite", path, initializer_range=INIT_RANGE, **over)  # varied, decided tokens


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_greedy_matches_transformers(backend: str, tmp_path) -> None:  # noqa: ANN001
    hf = granite(str(tmp_path))
    runner = make_runner(str(tmp_path), attention_backend=backend)
    assert StaticBatch(runner).generate(PROMPTS, 12) == [hf_greedy(hf, p, 12) for p in PROMPTS]


@pytest.mark.parametrize("name", ["embedding_multiplier", "attention_multiplier", "residual_multiplier"])
def test_each_multiplier_changes_the_tokens(name: str, tmp_path) -> None:  # noqa: ANN001
    """The case above could not pass with any of them left out (logits_scaling keeps the argmax: see below)."""
    hf = granite(str(tmp_path))
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    assert len({t for w in want for t in w}) > 6  # not one token repeated
    granite(str(tmp_path / "off"), **{name: 1.0 if name != "attention_multiplier" else 0.25})
    assert StaticBatch(make_runner(str(tmp_path / "off"))).generate(PROMPTS, 12) != want


def test_prompt_logprobs_come_from_the_divided_logits(tmp_path) -> None:  # noqa: ANN001
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.managers.tp_worker import run_model_worker_batch
    from radixserve.sampling.sampling_params import SamplingParams

    hf = granite(str(tmp_path))
    ids = PROMPTS[2]
    with torch.no_grad():
        logits = hf(torch.tensor([ids])).logits[0, :-1].float()
    want = torch.log_softmax(logits, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    runner = make_runner(str(tmp_path))
    req = Req("lp", ids, SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1}), return_logprob=True,
              logprob_start_len=0, top_logprobs_num=0)
    req.init_next_round_input(None)
    batch = ScheduleBatch([req], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                          runner.model_config.vocab_size)
    batch.prepare_for_extend()
    got = run_model_worker_batch(runner, batch.get_model_worker_batch()).logits_output.input_token_logprobs[0]
    torch.testing.assert_close(got.float(), want, atol=1e-4, rtol=1e-4)
    undivided = torch.log_softmax(logits * 4.0, -1).gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    assert not torch.allclose(undivided, want, atol=1e-2)


def test_scheduler_chunked_prefill_and_prefix_cache(tmp_path) -> None:  # noqa: ANN001
    from radixserve.managers import io_struct as io
    from radixserve.managers.scheduler import Scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    hf = granite(str(tmp_path))
    head = [9, 8, 7, 6, 5, 4, 3, 2, 1, 11, 12]
    prompts = [head + [40, 41], head + [50], PROMPTS[2], head + [60, 61, 62, 63, 64, 65]]
    s = Scheduler(ServerArgs(model_path=str(tmp_path), device="cpu", dtype="float32", max_total_tokens=2048,
                             skip_tokenizer_init=True, chunked_prefill_size=5, enable_mixed_chunk=True), port_args={})
    got: dict[str, list[int]] = {}
    for wave in (prompts[:2], prompts[2:]):  # the second wave finds the first one's prefixes cached
        for i, p in enumerate(wave):
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=f"{len(got)}-{i}", input_text=None, input_ids=p,
                sampling_params=SamplingParams.from_dict({"max_new_tokens": 12, "temperature": 0,
                                                          "ignore_eos": True}))])
        while s.step() or not s.is_idle():
            pass
        for msg in s.outbox:
            for rid, ids in zip(msg.rids, msg.new_token_ids, strict=True):
                got.setdefault(rid, []).extend(ids)
        s.outbox.clear()
    assert s.cache_hit_tokens > 0 and s.check_memory()
    assert [got["0-0"], got["0-1"], got["2-0"], got["2-1"]] == [hf_greedy(hf, p, 12) for p in prompts]


@pytest.mark.integration
def test_tp2_matches_tp1(tmp_path) -> None:  # noqa: ANN001
    from radixserve import Engine

    path = str(tmp_path)
    granite(path, seed=4)
    sampling = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
    want = reference_outputs(path, PROMPTS, sampling)
    with Engine(model_path=path, tp_size=2, **SERVER_KW) as engine:
        got = engine.generate(input_ids=PROMPTS, sampling_params=sampling)
    assert [o["output_ids"] for o in got] == want
