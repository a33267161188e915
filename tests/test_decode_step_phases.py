"""benchmarks/decode_step_phases.py runs a real decode loop and accounts for its whole step."""

from __future__ import annotations

import json

from model_utils import load_benchmark, make_tiny_model


def test_phases_add_up_to_the_step(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path / "m"))
    bench = load_benchmark("decode_step_phases")
    out = tmp_path / "phases.json"
    bench.main(["--model-path", str(tmp_path / "m"), "--dtype", "float32", "--max-total-tokens", "2048",
                "--batch-size", "1", "3", "--input-len", "24", "--steps", "8", "--result-file", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [r["batch_size"] for r in rows] == [1, 3]
    for r in rows:
        parts = [r[k] for k in bench.PHASES if k != "step"]
        assert all(p > 0 for p in parts), r
        # medians of the parts against the median of their sum: close, not equal
        assert 0.5 * sum(parts) <= r["step"] <= 2 * sum(parts), r


def test_host_timing_benchmarks_refuse_a_machine_without_cuda(tmp_path) -> None:
    """decode_host_calls / host_after_wait / decode_host_profile time a decode graph's replay: without CUDA they stop
    with a message instead of failing somewhere inside."""
    import pytest
    import torch

    from radixserve.bench_one_batch import warm_graph_decode
    from radixserve.server_args import ServerArgs

    if torch.cuda.is_available():
        pytest.skip("the machine has CUDA")
    make_tiny_model("llama", str(tmp_path / "m"))
    with pytest.raises(SystemExit, match="host_after_wait needs CUDA"):
        warm_graph_decode(ServerArgs(model_path=str(tmp_path / "m")), "host_after_wait")
