"""benchmarks/bench_mixed_step.py: every kind of step runs through the real ModelRunner (the decodes advance one
token in each step that carries them, none in the chunk alone), and the benchmark gives back every KV slot and
request row it took."""

from __future__ import annotations

import json

from model_utils import load_benchmark, make_tiny_model

from radixserve.entrypoints.engine import resolve_model
from radixserve.model_executor.model_runner import ModelRunner
from radixserve.server_args import ServerArgs


def test_steps_and_accounting(tmp_path) -> None:
    bench = load_benchmark("bench_mixed_step")
    make_tiny_model("llama", str(tmp_path / "m"))
    args = ServerArgs(model_path=str(tmp_path / "m"), dtype="float32", max_total_tokens=2048, max_running_requests=8)
    runner = ModelRunner(resolve_model(args), args)
    kv, rows = runner.token_to_kv_pool.available_size(), runner.req_to_token_pool.available_size()
    b = bench.MixedStepBench(runner)
    running = b.running(3, 20)
    before = [list(r.output_ids) for r in running.reqs]
    for mode in bench.MODES:
        assert b.step(mode, running, 12) > 0
    decoded = [r.output_ids[len(o):] for r, o in zip(running.reqs, before, strict=True)]
    assert all(len(d) == 3 for d in decoded)  # decode, mixed and mixed_full each added one token
    b.sb.release(running)
    assert runner.token_to_kv_pool.available_size() == kv and runner.req_to_token_pool.available_size() == rows


def test_main_writes_the_table(tmp_path) -> None:
    bench = load_benchmark("bench_mixed_step")
    make_tiny_model("llama", str(tmp_path / "m"))
    out = tmp_path / "mixed.json"
    bench.main(["--model-path", str(tmp_path / "m"), "--dtype", "float32", "--max-total-tokens", "2048",
                "--decodes", "2", "4", "--context", "16", "--chunk", "10", "--trials", "2", "--result-file", str(out)])
    rows = json.loads(out.read_text())["results"]
    assert [(r["decodes"], r["chunk_tokens"]) for r in rows] == [(2, 10), (4, 10)]
    for r in rows:
        assert all(r[m] > 0 and r[m + "_host"] > 0 for m in bench.MODES), r
