"""Block sizes of the decode GEMV kernels (`fp8_gemv`, `gguf_kernels`, `triton_ops/gemv`), per kernel family, row
count and weight shape.

Chosen by `benchmarks/sweep_gemv.py` on the GPU and kept in `gemv_configs.json` beside this file, keyed
"family/M/N/K" (M rounded up to a power of two); RADIXSERVE_GEMV_CONFIGS=path.json adds or overrides entries (how a
sweep's picks are tried before they are committed). A shape the table lacks gets the default of its family.

`block_k` is the number of weight columns (K) one program reads per loop step, for every family."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass

FAMILIES = ("fp8", "fp8_silu", "q4_k", "q8_0", "bf16", "bf16_silu")


@dataclass(frozen=True)
class GemvConfig:
    kernel: str  # "ew" (CUDA cores) or "dot" (tensor cores; fp8 only)
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    # fp8 "ew": "f16" widens the byte by moving its bits, "" by Triton's conversion; q4_k / q8_0: "magic" turns the
    # integers to floats with the 2^23 trick
    variant: str = ""

    def to_dict(self) -> dict:
        return asdict(self)


def bucket(m: int) -> int:
    return 1 << max(0, (m - 1).bit_length())


def key(family: str, m: int, n: int, k: int) -> str:
    return f"{family}/{bucket(m)}/{n}/{k}"


@functools.lru_cache(maxsize=1)
def _table() -> dict[str, GemvConfig]:
    table: dict[str, GemvConfig] = {}
    paths = [os.path.join(os.path.dirname(__file__), "gemv_configs.json")]
    if os.environ.get("RADIXSERVE_GEMV_CONFIGS"):
        paths.append(os.environ["RADIXSERVE_GEMV_CONFIGS"])
    for path in paths:
        if not os.path.exists(path):
            continue
        with open(path) as f:
            for name, cfg in json.load(f).get("configs", {}).items():
                table[name] = GemvConfig(**cfg)
    return table


def default(family: str, m: int, cuda: bool) -> GemvConfig:
    if not cuda:  # the interpreter (CPU tests): small tiles
        if family == "fp8":
            return GemvConfig("ew", 2, 64) if m <= 2 else GemvConfig("dot", 16, 32)
        return GemvConfig("ew", 2, 256)
    if family == "fp8":
        return GemvConfig("ew", 4, 1024) if m <= 2 else GemvConfig("dot", 32, 256, 4, 3)
    return GemvConfig("ew", 4, 512)


def get(family: str, m: int, n: int, k: int, cuda: bool = True) -> GemvConfig:
    """The table's entry, else for "fp8_silu" (gate_up with SiLU·mul in the epilogue) the "fp8" entry of the same
    shape, else the family's default."""
    if cuda:
        for fam in (family, "fp8") if family == "fp8_silu" else (family,):
            hit = _table().get(key(fam, m, n, k))
            if hit is not None:
                return hit
    return default("fp8" if family == "fp8_silu" else family, m, cuda)


def lookup(family: str, m: int, n: int, k: int) -> GemvConfig | None:
    """The table's entry for exactly this family and shape, or None (no fallback: for the 16-bit GEMV of
    `triton_ops/gemv.py` a missing entry means cuBLAS keeps the shape)."""
    return _table().get(key(family, m, n, k))


def reload() -> None:
    _table.cache_clear()
