"""Speculative decoding with tensor parallelism on the CPU (gloo): a TP=2 engine with n-gram speculation generates
exactly what one TP=1 scheduler without speculation does (every rank drafts the same tokens from the same history,
verifies them in the same decode-row forward and keeps the same ones), and leaves every rank's pool whole."""

from __future__ import annotations

import pytest
from parallel_utils import SERVER_KW, make_model, reference_outputs, wait_idle

from radixserve import Engine

GREEDY = {"max_new_tokens": 16, "temperature": 0, "ignore_eos": True}


@pytest.mark.integration
def test_ngram_speculation_tp2_matches_tp1_plain(tmp_path) -> None:
    path = make_model("llama", str(tmp_path), seed=4)
    passage = [11, 57, 203, 9, 88, 140, 31, 7]
    prompts = [passage * 3 + passage[:3], [5, 6, 7, 8] * 6, list(range(40, 70))]
    want = reference_outputs(path, prompts, GREEDY)
    with Engine(model_path=path, tp_size=2, dist_timeout=20, speculative_algorithm="ngram",
                speculative_num_draft_tokens=3, **SERVER_KW) as engine:
        outs = engine.generate(input_ids=prompts, sampling_params=GREEDY)
        assert [o["output_ids"] for o in outs] == want
        assert max(o["meta_info"]["spec_accept_length"] for o in outs) > 1.0  # some drafts were kept
        state = wait_idle(engine)
        assert state["free_tokens"] + state["evictable_tokens"] == state["max_total_num_tokens"]
