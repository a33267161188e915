"""What the fp8 decode GEMV's main loop compiles to, without a GPU: `fp8_gemv._fp8_gemv_ew_kernel` compiled for an
sm_90 target by Triton's own compiler (16-byte aligned pointers and strides, as at run time), per-channel scales
against block-wise ones (BLOCKS), and the PTX of the K loop counted.

The kernel is bound by the fp8 bytes it keeps in flight, so its loop must stay short and must not exchange values
between threads: a layout conversion shows as shared-memory stores and barriers (or shuffles) inside the loop.

    python benchmarks/fp8_gemv_ptx.py --tiles 4x1024 8x512 --out fp8_gemv_ptx.json
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from typing import Any

LOOP_OPS = ("ld.global", "st.shared", "ld.shared", "bar.sync", "shfl", "fma", "mul.f32", "add.f32", "cvt")


def compile_ew(blocks: bool, block_n: int, block_k: int, two_rows: bool = False, silu_mul: bool = False,
               red8: bool = True, num_warps: int = 4, num_stages: int = 3, arch: int = 90) -> Any:
    """`_fp8_gemv_ew_kernel` for `arch` as the decode path launches it (bf16 x, evict-first weight, no bias, the
    weight rows' first 512 bytes prefetched before the PDL wait)."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixserve.layers.quantization.fp8_gemv import _fp8_gemv_ew_kernel as fn

    signature = {"X": "*bf16", "W": "*fp8e4nv", "S": "*fp32", "Bias": "*bf16", "Out": "*bf16", "M": "i32",
                 "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32",
                 "out_factor": "fp32", "stride_sn": "i32", "group_n": "i32", "group_k": "i32"}
    const = dict(HAS_BIAS=False, WIDEN_F16=False, TWO_ROWS=two_rows, SILU_MUL=silu_mul, BLOCK_N=block_n,
                 BLOCK_K=block_k, PDL=1, EVICT=True, RED8=red8, BLOCKS=blocks, PREFETCH=512)
    names = list(fn.arg_names)
    sig = {**signature, **{k: "constexpr" for k in const}}
    aligned = [names.index(n) for n in ("X", "W", "S", "Bias", "Out", "K", "stride_xm", "stride_wn", "stride_om")]
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def loop_counts(ptx: str) -> dict[str, int]:
    """Instruction counts of the first loop in `ptx` (from its header label to its back branch)."""
    start = ptx.find("Loop Header")
    if start < 0:
        raise ValueError("no loop found in the PTX")
    body = ptx[start:]
    back = re.search(r"@%p\d+ bra\s+\$L__BB\d+_\d+;", body)
    body = body[:back.end()] if back else body
    lines = [ln.strip() for ln in body.splitlines()[1:]]
    instr = [ln for ln in lines if ln and not ln.startswith(("//", "$", "."))]
    out = {"loop_instructions": len(instr)}
    for op in LOOP_OPS:
        out[op] = sum(1 for ln in instr if re.match(rf"(@!?%p\d+\s+)?{re.escape(op)}", ln))
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tiles", nargs="+", default=["4x1024", "8x512"], help="BLOCK_N x BLOCK_K")
    p.add_argument("--out", default=None, help="JSON file for the rows")
    args = p.parse_args(argv)
    rows = []
    for tile in args.tiles:
        block_n, block_k = (int(v) for v in tile.split("x"))
        for two, silu in ((False, False), (True, False), (False, True)):
            for blocks in (False, True):
                counts = loop_counts(compile_ew(blocks, block_n, block_k, two, silu).asm["ptx"])
                rows.append({"tile": tile, "rows": 2 if two else 1, "silu_mul": silu,
                             "scales": "block" if blocks else "channel", **counts})
    cols = ["tile", "rows", "silu_mul", "scales", "loop_instructions", *LOOP_OPS]
    print(" | ".join(cols))
    for r in rows:
        print(" | ".join(str(r[c]) for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows}, f, indent=1)


if __name__ == "__main__":
    sys.exit(main())
