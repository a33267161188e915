"""benchmarks/flashinfer_aot.py's archive, on a stand-in package: the Python and templates stay, the CUTLASS / spdlog
sources and byte-code caches go, each built module lands where FlashInfer loads ahead-of-time modules, and a folder
that is not the package is refused. (Building the modules needs nvcc and flashinfer: run on a GPU image's twin.)"""

from __future__ import annotations

import tarfile
from pathlib import Path

import pytest
from model_utils import load_benchmark


def _touch(path: Path, text: str = "x") -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def test_bundle_layout(tmp_path: Path) -> None:
    aot = load_benchmark("flashinfer_aot")
    pkg = tmp_path / "site" / "flashinfer"
    for rel in ("__init__.py", "decode.py", "jit/core.py", "data/csrc/batch_decode.cu", "data/include/a.cuh",
                "data/cutlass/include/cute.hpp", "data/spdlog/spdlog.h", "__pycache__/decode.cpython-312.pyc",
                "jit/__pycache__/core.cpython-312.pyc"):
        _touch(pkg / rel)
    dist = tmp_path / "site" / "flashinfer_python-0.5.3.dist-info"
    _touch(dist / "METADATA", "Name: flashinfer-python\nVersion: 0.5.3\n")
    so = tmp_path / "build" / "batch_decode_x.so"
    _touch(so, "ELF")
    out = tmp_path / "fi.tgz"
    aot.bundle(pkg, {"batch_decode_x": so}, out, [dist])
    with tarfile.open(out) as tar:
        names = set(tar.getnames())
        files = {m.name for m in tar.getmembers() if m.isfile()}
        assert tar.extractfile("flashinfer/data/aot/batch_decode_x/batch_decode_x.so").read() == b"ELF"
    assert files == {"flashinfer/__init__.py", "flashinfer/decode.py", "flashinfer/jit/core.py",
                     "flashinfer/data/csrc/batch_decode.cu", "flashinfer/data/include/a.cuh",
                     "flashinfer/data/aot/batch_decode_x/batch_decode_x.so",
                     "flashinfer_python-0.5.3.dist-info/METADATA"}
    assert not any("cutlass" in n or "spdlog" in n or "__pycache__" in n for n in names)
    with pytest.raises(ValueError, match="not the flashinfer package"):
        aot.bundle(tmp_path / "site", {}, tmp_path / "bad.tgz")
