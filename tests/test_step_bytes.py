"""The benchmarks' bytes a decode step reads: an MoE step counts the experts its batch touches, not all of them."""

from __future__ import annotations

from typing import Any

import pytest

from radixserve.bench_one_batch import add_bandwidth
from radixserve.layers.moe import FusedMoE
from radixserve.step_bytes import distinct_experts, expert_layers, expert_tensors, moe_step_bytes
from tests.model_utils import make_runner, make_tiny_model


@pytest.fixture(scope="module")
def gpt_oss_runner(tmp_path_factory: pytest.TempPathFactory) -> Any:
    path = str(tmp_path_factory.mktemp("gpt_oss"))
    make_tiny_model("gpt_oss", path)  # 8 experts, 2 a token, biases on both expert products
    return make_runner(path)


def test_expert_tensors_cover_weights_and_biases(gpt_oss_runner: Any) -> None:
    layers = expert_layers(gpt_oss_runner)
    assert len(layers) == 2
    names = {n for n, t in layers[0].named_parameters(recurse=False)
             if any(t is u for u in expert_tensors(layers[0]))}
    assert names == {"w13_weight", "w2_weight", "w13_bias", "w2_bias"}


def test_distinct_experts_counts_the_routers_choices(gpt_oss_runner: Any) -> None:
    one = distinct_experts(gpt_oss_runner, 1, 12, seed=0)
    assert one == [2, 2]  # one token, top-2, each of the two layers
    many = distinct_experts(gpt_oss_runner, 6, 12, seed=0)
    assert len(many) == 2 and all(2 <= n <= 8 for n in many) and sum(many) > sum(one)
    # the recording wrapper is gone: the layers call their class's method again
    assert all("run_experts" not in layer.__dict__ for layer in expert_layers(gpt_oss_runner))


def test_moe_step_bytes_adds_dense_routed_and_kv(gpt_oss_runner: Any) -> None:
    runner = gpt_oss_runner
    result = {"batch_size": 3, "input_len": 10, "output_len": 4}
    layers = expert_layers(runner)
    per_expert = sum(t.numel() * t.element_size() for t in expert_tensors(layers[0])) / 8
    out = moe_step_bytes(runner, result, [2, 5])
    assert out["routed_bytes"] == pytest.approx(7 * per_expert)
    embed = runner.model.model.embed_tokens.weight
    experts = sum(per_expert * 8 for _ in layers)
    assert out["dense_bytes"] == pytest.approx(runner.weight_bytes - experts - embed.numel() * 4)
    assert out["kv_bytes"] == pytest.approx(3 * 12 * runner.token_to_kv_pool.bytes_per_token())
    assert out["step_bytes"] == pytest.approx(out["dense_bytes"] + out["routed_bytes"] + out["kv_bytes"])
    assert out["experts_hit_per_layer"] == 3.5


def test_add_bandwidth_counts_active_bytes_for_moe(gpt_oss_runner: Any) -> None:
    result = {"batch_size": 1, "input_len": 12, "output_len": 4, "median_decode_s": 1e-3}
    add_bandwidth(result, gpt_oss_runner, copy_bw=1e12, seed=0)
    assert result["experts_hit_per_layer"] == 2
    assert result["step_bytes"] < gpt_oss_runner.weight_bytes  # 2 of 8 experts, no embedding table
    assert result["bandwidth_util"] == pytest.approx(result["step_bytes"] / 1e-3 / 1e12)


def test_add_bandwidth_dense_counts_every_weight(tmp_path: Any) -> None:
    make_tiny_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path))
    assert not expert_layers(runner) and not any(isinstance(m, FusedMoE) for m in runner.model.modules())
    result = {"batch_size": 2, "input_len": 8, "output_len": 4, "median_decode_s": 1e-3}
    add_bandwidth(result, runner, copy_bw=1e12)
    kv = 2 * 10 * runner.token_to_kv_pool.bytes_per_token()
    assert result["step_bytes"] == pytest.approx(runner.weight_bytes + kv)
