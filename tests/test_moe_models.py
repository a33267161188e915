"""Mixture-of-experts models greedy token-identical to transformers (float32, tiny random configs): batched static
generation, and through the scheduler with a prompt crossing a chunked-prefill boundary and a radix-cache hit."""

from __future__ import annotations

import pytest
from model_utils import hf_greedy, make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch
from radixserve.managers import io_struct as io
from radixserve.managers.scheduler import Scheduler
from radixserve.sampling.sampling_params import SamplingParams
from radixserve.server_args import ServerArgs

PROMPTS = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3], [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13]]


def check_static(kind: str, path: str, new_tokens: int = 16, **over) -> None:
    hf = make_tiny_model(kind, path, initializer_range=0.08, **over)
    runner = make_runner(path)
    ours = StaticBatch(runner).generate(PROMPTS, new_tokens)
    for prompt, got in zip(PROMPTS, ours, strict=True):
        assert got == hf_greedy(hf, prompt, new_tokens), f"{kind}: prompt {prompt}"
    assert runner.token_to_kv_pool.available_size() == runner.token_to_kv_pool.size


@pytest.mark.parametrize("kind", ["mixtral", "qwen2_moe", "qwen3_moe"])
def test_moe_greedy_matches_transformers(kind: str, tmp_path) -> None:
    check_static(kind, str(tmp_path))


def run_scheduler(path: str, requests: list[tuple[str, list[int]]], new_tokens: int,
                  overlap: bool = False, page_size: int = 1) -> dict[str, dict]:
    """Requests submitted one after another (each drained before the next), chunked prefill every 8 tokens."""
    sched = Scheduler(ServerArgs(model_path=path, device="cpu", dtype="float32", max_total_tokens=2048,
                                 skip_tokenizer_init=True, chunked_prefill_size=8,
                                 enable_overlap_schedule=overlap, page_size=page_size), port_args={})
    out: dict[str, dict] = {}
    for rid, prompt in requests:
        params = SamplingParams.from_dict({"max_new_tokens": new_tokens, "temperature": 0, "ignore_eos": True})
        sched.process_input_requests([io.TokenizedGenerateReqInput(rid=rid, input_text=None, input_ids=prompt,
                                                                   sampling_params=params)])
        for _ in range(1000):
            if not sched.step() and sched.is_idle():
                break
        for msg in sched.outbox:
            if isinstance(msg, io.BatchTokenIDOut):
                for r, ids, meta in zip(msg.rids, msg.new_token_ids, msg.meta_infos, strict=True):
                    entry = out.setdefault(r, {"ids": [], "meta": None})
                    entry["ids"] += ids
                    entry["meta"] = meta
        sched.outbox.clear()
    assert sched.check_memory(), sched.get_internal_state()
    return out


def check_scheduler(kind: str, path: str, overlap: bool = False, page_size: int = 1) -> None:
    """A 21-token prompt prefilled in chunks of 8, then one sharing its first 16 tokens (a radix hit)."""
    hf = make_tiny_model(kind, path, initializer_range=0.08)
    first = [(7 * i + 3) % 250 + 2 for i in range(21)]
    second = first[:16] + [9, 8, 7]
    res = run_scheduler(path, [("first", first), ("second", second)], 10, overlap, page_size)
    assert res["first"]["meta"]["cached_tokens"] == 0
    assert res["second"]["meta"]["cached_tokens"] >= 16
    assert res["first"]["ids"] == hf_greedy(hf, first, 10)
    assert res["second"]["ids"] == hf_greedy(hf, second, 10)


def test_moe_chunked_prefill_and_radix_hit_match_transformers(tmp_path) -> None:
    check_scheduler("qwen3_moe", str(tmp_path))
