"""benchmarks/decode_kernel_ptx.py compiles the decode kernel for an sm_90 target on a machine without a GPU (in a
process of its own: the suite runs Triton in its interpreter) and counts what the PTX holds."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

pytest.importorskip("triton")

ROOT = os.path.join(os.path.dirname(__file__), "..")


def test_counts_show_the_fp8_pool_s_byte_loads_and_the_word_path_without_them(tmp_path) -> None:
    out = tmp_path / "ptx.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "decode_kernel_ptx.py"), "--kv-dtype", "bf16", "fp8e4nv",
           "--block-n", "64", "--num-stages", "2", "--fp8-v-pairs", "0", "1", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = {(r["kv_dtype"], r["v_pairs"]): r for r in json.loads(out.read_text())["rows"]}
    assert sorted(rows) == [("bf16", 0), ("fp8e4nv", 0), ("fp8e4nv", 1)]
    bf16, fp8, pairs = rows["bf16", 0], rows["fp8e4nv", 0], rows["fp8e4nv", 1]
    # both reach the tensor cores: two products of a 16-row query block over 64 tokens x 128 dims, 4 warps
    assert bf16["mma.sync"] == fp8["mma.sync"] > 0
    # bf16 tiles go through (transposing) matrix loads; the fp8 pool's V tile byte by byte, then widened
    assert bf16["ldmatrix"] > 0 and bf16["ld.shared.b8"] == 0 and bf16["cvt.rn.f16x2.e4m3x2"] == 0
    assert fp8["ld.shared.b8"] > 0 and fp8["cvt.rn.f16x2.e4m3x2"] > 0
    assert fp8["instructions"] > bf16["instructions"]
    # V as words widened in token pairs: no byte loads, the same products and widenings, fewer instructions
    assert pairs["ld.shared.b8"] == 0 and pairs["mma.sync"] == fp8["mma.sync"]
    assert pairs["cvt.rn.f16x2.e4m3x2"] == fp8["cvt.rn.f16x2.e4m3x2"] and pairs["instructions"] < fp8["instructions"]
    assert "ld.shared.b8" in proc.stdout  # the table


def test_block_wise_fp8_gemv_loop_exchanges_nothing(tmp_path) -> None:
    """benchmarks/fp8_gemv_ptx.py: the fp8 decode GEMV's K loop with block-wise scales (each step's runs of 8 times
    their group's scale) has no shared-memory exchange, barrier or shuffle, as the per-channel loop has none, and
    at most a tenth more instructions."""
    out = tmp_path / "fp8_gemv_ptx.json"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["PYTHONPATH"] = ROOT + os.pathsep + env.get("PYTHONPATH", "")
    cmd = [sys.executable, os.path.join(ROOT, "benchmarks", "fp8_gemv_ptx.py"), "--tiles", "4x1024", "--out", str(out)]
    proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    rows = json.loads(out.read_text())["rows"]
    assert len(rows) == 6
    by = {(r["rows"], r["silu_mul"], r["scales"]): r for r in rows}
    for (n_rows, silu, scales), r in by.items():
        assert r["st.shared"] == r["ld.shared"] == r["bar.sync"] == r["shfl"] == 0, r
        if scales == "block":
            channel = by[n_rows, silu, "channel"]
            assert r["ld.global"] > channel["ld.global"]  # the scales' loads
            assert channel["loop_instructions"] < r["loop_instructions"] <= 1.1 * channel["loop_instructions"]
