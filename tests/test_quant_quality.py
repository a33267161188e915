"""Quality on the real embedded SmolLM2 (CPU, float32): online fp8 weights and its own Q8_0 GGUF file keep the
greedy answer to the capital-of-France question and stay within their perplexity margins (fp8 <= 2%, Q8_0 <= 1%)
on the Apache-2.0 text shipped in transformers' wheel (`benchmarks/bench_quality.py` measures every
configuration; this runs the two cheapest, on 512 tokens: on 256 the noise alone moved fp8 by 4%)."""

from __future__ import annotations

import os
import sys

import pytest

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "..", "benchmarks"))


def test_fp8_and_q8_0_keep_quality(embedded_model_path: str) -> None:
    import bench_quality

    try:
        bench_quality.main(["--tokens", "512", "--configs", "fp32,fp8,GGUF Q8_0"])
    except SystemExit as e:  # main exits 1 when a configuration misses its margin or loses "Paris"
        pytest.fail(f"bench_quality failed: exit {e.code}")
