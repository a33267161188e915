"""The decode GEMV kernels compiled for an H100/H200 (sm_90) on a machine without a GPU (`kernel_compile_cases.py`,
in a process without TRITON_INTERPRET): Triton's compiler and the `ptxas` its wheel carries find what the interpreter
the other tests run under does not, e.g. a `return` inside a `tl.constexpr` branch followed by a second `return`
(the compiler goes on to the second). Skipped where the Triton install cannot compile for CUDA."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest


def test_decode_gemv_kernels_compile_for_sm90() -> None:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_compile_cases.py")
    proc = subprocess.run([sys.executable, str(script)], env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if report["probe"] is not None:
        pytest.skip(f"Triton cannot compile for sm_90 here: {report['probe']}")
    failed = {name: err for name, err in report["results"].items() if err is not None}
    assert len(report["results"]) == 8
    assert not failed, "\n\n".join(f"{name}: {err}" for name, err in failed.items())
