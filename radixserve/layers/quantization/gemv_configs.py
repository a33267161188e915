"""Block sizes of the decode GEMV kernels (`fp8_gemv`, `gguf_kernels`; "int8": `fp8_gemv` on the int8 LM head
(`lm_head_int8`), an entry for its shape only; "int8_mid": its `fp8_mid` W8A16 tile at 17..256 rows; "row16" /
"row16_silu" / "row16_norm": `triton_ops.gemv`, the one-row 16-bit product — plain, with SiLU·mul in the epilogue,
with the input RMSNorm folded in — for the dense models' linear layers at batch 1 (only where a sweep found it
faster than cuBLAS) and the MoE / MLA models' attention projections; "row16_rope": `triton_ops.gemv_rope`, q/k/v
with the rotary embedding and the KV store, block_n its rows per half-head run; "fp8_mid": `fp8_mid`, fp8 weights at
17..256 rows; "mid16" / "mid16_silu": `triton_ops.gemm_mid`, 16-bit weights at 17..256 rows, plain or gate_up with
SiLU·mul), per kernel family, row count and weight shape.

Chosen by `benchmarks/sweep_gemv.py` on the GPU and kept in `gemv_configs.json` beside this file, keyed
"family/M/N/K" (M rounded up to a power of two; for the 17..256-row families the M swept, `get_mid`);
RADIXSERVE_GEMV_CONFIGS=path.json adds or overrides entries (how a sweep's picks are tried before they are
committed). A shape the table lacks gets the default of its family.

`block_k` is the number of weight columns (K) one program reads per loop step, for every family."""

from __future__ import annotations

import functools
import json
import os
from dataclasses import asdict, dataclass

FAMILIES = ("fp8", "fp8_silu", "int8", "int8_mid", "q4_k", "q8_0", "fp8_mid", "mid16", "mid16_silu", "row16",
            "row16_silu", "row16_norm", "row16_rope")
# keyed by the M they were swept at, not its power-of-two bucket
MID_FAMILIES = ("fp8_mid", "int8_mid", "mid16", "mid16_silu")


@dataclass(frozen=True)
class GemvConfig:
    # "ew" (CUDA cores) or "dot" (tensor cores; fp8 only); q4_k also "acc", "mma", "dp4a", "dp4w", "dp4x",
    # "mma_rows" (`gguf_int_kernels`) and "dp4c" (`gguf_chunk_kernels`); only dp4x and mma_rows take more than
    # GEMV_MAX_M rows
    kernel: str
    block_n: int
    block_k: int
    num_warps: int = 4
    num_stages: int = 2
    # fp8 "ew": flags joined by "+" (`fp8_gemv.EW_FLAGS`): "f16" widens the byte by moving its bits (else Triton's
    # conversion), "r8" sums runs of 8 products in the thread, "ef" loads the weight evict-first; q4_k / q8_0:
    # "magic" turns the integers to floats with the 2^23 trick
    variant: str = ""
    block_m: int = 16  # the 17..256-row families only: batch rows per program
    split_k: int = 1  # "mid16" / "mid16_silu" only: programs over K per output tile

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
        if family in ("fp8", "int8"):
            return GemvConfig("ew", 2, 64) if m <= 2 else GemvConfig("dot", 16, 32)
        return GemvConfig("ew", 2, 256)
    if family in ("fp8", "int8"):
        return GemvConfig("ew", 4, 1024) if m <= 2 else GemvConfig("dot", 32, 256, 4, 3)
    if family in ("row16", "row16_silu", "row16_norm"):
        return GemvConfig("ew", 4, 1024)
    if family == "q4_k" and m == 1:  # whole chunks a thread (`gguf_chunk_kernels`: dp4c), the 8B shapes' pick
        return GemvConfig("dp4c", 1, 2048, 1, 1)
    if family == "q4_k":  # every row of x in one program (`gguf_int_kernels`: dp4x)
        if m <= 2:
            return GemvConfig("dp4x", 4, 1024, 2)
        return GemvConfig("dp4x", 8, 1024, 4) if m <= 4 else GemvConfig("dp4x", 16, 512, 4)
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
    """The table's entry for exactly this family and shape, or None (no fallback: for the dense layers' 16-bit GEMV
    of `triton_ops/gemv.py` a missing entry means cuBLAS keeps the shape)."""
    return _table().get(key(family, m, n, k))


@functools.lru_cache(maxsize=256)
def _mid_rows(family: str, n: int, k: int) -> tuple[tuple[int, GemvConfig], ...]:
    found = []
    for name, cfg in _table().items():
        fam, m, nn, kk = name.split("/")
        if fam == family and int(nn) == n and int(kk) == k:
            found.append((int(m), cfg))
    return tuple(sorted(found, key=lambda t: t[0]))


def get_mid(m: int, n: int, k: int, family: str = "fp8_mid") -> GemvConfig | None:
    """The `family` entry for an M-row product (17..256 rows) of an [N, K] weight: the entry swept at the smallest
    M >= m ("<family>/<M>/N/K", M as swept, not bucketed), else the largest swept M if m is within 1/4 of it; None
    when the table has none for the shape (the caller keeps its library product). "fp8_mid" entries' `kernel` is
    "w8a8", "w8a16", "scaled_mm", "scaled_mm_t" or "scaled_mm_unit"; "int8_mid" (the int8 LM head's) "w8a16" or
    "gemm" (the W8A16 GEMM `fp8_gemm`, which the head runs without an entry);
    "mid16" / "mid16_silu" entries' "tn" or "cublas"."""
    rows = _mid_rows(family, n, k)
    for swept, cfg in rows:
        if m <= swept:
            return cfg
    if rows and m <= rows[-1][0] * 5 // 4:
        return rows[-1][1]
    return None


def reload() -> None:
    _table.cache_clear()
    _mid_rows.cache_clear()
