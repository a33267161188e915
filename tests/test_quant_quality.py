"""Quality on the real embedded SmolLM2 (CPU, float32): online fp8 weights, the LM head in int8 rows
(`--quantize-lm-head`) and its own Q8_0 GGUF file keep the greedy answer to the capital-of-France question and stay
within their perplexity margins (fp8 <= 2%, Q8_0 and the int8 head <= 1%) on the Apache-2.0 text shipped in
transformers' wheel (`benchmarks/bench_quality.py` measures every configuration; this runs the cheapest, on 512
tokens: on 256 the noise alone moved fp8 by 4%)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_fp8_and_q8_0_keep_quality(embedded_model_path: str) -> None:
    import bench_quality

    try:
        bench_quality.main(["--tokens", "512", "--configs", "fp32,fp8,int8 head,GGUF Q8_0"])
    except SystemExit as e:  # main exits 1 when a configuration misses its margin or loses "Paris"
        pytest.fail(f"bench_quality failed: exit {e.code}")


def test_kv_scale_sweep_rows_use_their_scales(embedded_model_path: str, tmp_path) -> None:  # noqa: ANN001
    """A sweep row with scale 1 scores exactly the default fp8 KV pool (scales 1.0), so the written scales are the
    ones the engine reads; a row at 0.6 moves e4m3's rounding grid and scores differently."""
    import json

    import bench_quality

    out = tmp_path / "sweep.json"
    try:
        bench_quality.main(["--tokens", "128", "--configs", "fp8 KV e4m3", "--kv-scale-sweep", "1,0.6",
                            "--json", str(out)])
    except SystemExit:  # these rows carry no margin; "Paris" is checked by the test above
        pass
    rows = {r["config"]: r for r in json.loads(out.read_text())["rows"]}
    assert list(rows) == ["fp32", "fp8 KV e4m3", "fp8 KV e4m3 scale 1", "fp8 KV e4m3 scale 0.6"]
    assert rows["fp8 KV e4m3 scale 1"]["perplexity"] == rows["fp8 KV e4m3"]["perplexity"]
    assert rows["fp8 KV e4m3 scale 0.6"]["perplexity"] != rows["fp8 KV e4m3"]["perplexity"]
    assert rows["fp8 KV e4m3 scale 0.6"]["weights"] == "k/v scales 0.6000..0.6000"


@pytest.mark.parametrize(("argv", "says"), [(["--kv-scale-sweep", "1,x"], "comma-separated numbers"),
                                           (["--kv-scale-sweep", "0"], "must be positive"),
                                           (["--configs", "fp32,fp9"], "unknown --configs ['fp9']")])
def test_bad_arguments_are_refused(argv: list[str], says: str, capsys) -> None:  # noqa: ANN001
    import bench_quality

    with pytest.raises(SystemExit) as e:
        bench_quality.main(argv)
    assert e.value.code == 2
    assert says in capsys.readouterr().err
