"""Tensor and expert parallelism on the CPU (gloo) for the MoE and MLA families: a TP=2 engine, and a TP=2 engine
with --ep-size 2 (each rank holds half the experts), generate exactly what one TP=1 scheduler does."""

from __future__ import annotations

import pytest
from parallel_utils import SERVER_KW, make_model, reference_outputs, wait_idle

from radixserve import Engine

PROMPTS = [[1, 5, 9, 33, 2], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], list(range(40, 70))]
GREEDY = {"max_new_tokens": 10, "temperature": 0, "ignore_eos": True}


def _generate(path: str, **kw) -> list[list[int]]:
    with Engine(model_path=path, tp_size=2, dist_timeout=60, **SERVER_KW, **kw) as engine:
        return [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]


@pytest.mark.integration
def test_qwen3_moe_tp2_and_ep2_match_tp1(tmp_path) -> None:
    path = make_model("qwen3_moe", str(tmp_path), seed=4)
    want = reference_outputs(path, PROMPTS, GREEDY)
    assert _generate(path) == want
    assert _generate(path, ep_size=2) == want


@pytest.mark.integration
def test_qwen3_moe_fp8_checkpoint_tp2_and_ep2_match_tp1(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block-wise fp8 checkpoint (16 x 16 blocks, experts included): TP=2 ranks hold their halves of the
    weights and of the scale blocks (the experts' intermediate dimension, attention heads, o_proj's columns), EP=2
    ranks whole experts with their scales; both generate what one TP=1 scheduler does. The dense layers run W8A16
    at every batch here (in this process and the ranks'): quantising activations to fp8 turns the ranks' float32
    summation order into whole fp8 steps now and then, which greedy decoding of a random model then follows."""
    from test_quant_fp8_moe import _write_fp8_moe_checkpoint

    from radixserve.layers.quantization import fp8 as fp8mod

    monkeypatch.setenv("RADIXSERVE_FP8_W8A16_MAX_M", str(1 << 30))
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)

    path = make_model("qwen3_moe", str(tmp_path), seed=4)
    _write_fp8_moe_checkpoint(path, "block")
    want = reference_outputs(path, PROMPTS, GREEDY)
    assert _generate(path) == want
    assert _generate(path, ep_size=2) == want


@pytest.mark.integration
def test_deepseek_v2_mla_tp2_matches_tp1(tmp_path) -> None:
    """MLA with heads split over the ranks (the latent pool replicated), q_lora_rank set, shared experts."""
    path = make_model("deepseek_v2_lora", str(tmp_path), seed=5)
    assert _generate(path) == reference_outputs(path, PROMPTS, GREEDY)


@pytest.mark.integration
@pytest.mark.parametrize("overlap", [False, True])
def test_deepseek_v2_dp_attention_matches_tp1(tmp_path, overlap: bool) -> None:
    """--enable-dp-attention over 2 gloo ranks: each rank runs attention on its own requests (the controller
    routes them) and the MoE/MLP layers over both ranks' tokens; requests of different lengths leave one rank
    without work while the other decodes, so it runs IDLE forwards. Every request gets TP=1's greedy tokens."""
    path = make_model("deepseek_v2_lora", str(tmp_path), seed=5)
    prompts = PROMPTS + [list(range(3, 20))]
    params = [{"max_new_tokens": n, "temperature": 0, "ignore_eos": True} for n in (10, 2, 14, 5)]
    want = [reference_outputs(path, [p], sp)[0] for p, sp in zip(prompts, params, strict=True)]
    with Engine(model_path=path, tp_size=2, dp_size=2, enable_dp_attention=True, dist_timeout=60,
                enable_overlap_schedule=overlap, **SERVER_KW) as engine:
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=params)]
        state = wait_idle(engine)  # under overlap a rank may finish its last step just after the outputs arrive
    assert got == want
    assert state["idle"]
