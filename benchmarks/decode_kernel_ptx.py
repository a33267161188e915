"""What the decode-attention kernel compiles to, without a GPU: stage 1 compiled for an sm_90 target by Triton's own
compiler (its bundled LLVM and ptxas), and the PTX instructions of each configuration counted.

Static counts are not timings, but they show where a variant's instructions go before any GPU time is spent on it:
e.g. an fp8 pool's V tile reaches the tensor cores through one-byte shared-memory loads (`ld.shared.b8`: there is
no transposing matrix load for 8-bit types on sm_90), where a bf16 tile takes `ldmatrix ... .trans`; with
`--fp8-v-pairs 1` V is read as words and widened in token pairs, without them.

    python benchmarks/decode_kernel_ptx.py --kv-dtype bf16 fp8e4nv --block-n 64 128 --num-stages 2 3 \
        --fp8-v-pairs 0 1 --out ptx.json
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import sys
from typing import Any

# instructions worth a column: memory traffic into and out of shared memory, the MMAs and the fp8 widening
KEY_OPS = ("ld.shared.b8", "ld.shared", "ldmatrix", "cp.async", "ld.global", "cvt.rn.f16x2.e4m3x2",
           "mma.sync", "wgmma", "st.shared", "bar.sync")


def compile_stage1(kv_dtype: str, block_n: int, num_stages: int, num_warps: int = 4, group: int = 4,
                   head_dim: int = 128, arch: int = 90, v_pairs: bool = False) -> Any:
    """Compile `_decode_stage1_kernel` for `arch` as the serving path launches it: GQA `group`, tensor-core
    products, a bf16 query, 16-byte aligned pointers and strides divisible by 16 (what Triton sees at run time);
    `v_pairs` reads an fp8 pool's V as words widened in token pairs."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from radixserve.layers.attention.triton_ops.decode_attention import _decode_stage1_kernel

    pointers = {"Q": "*bf16", "K_Buf": f"*{kv_dtype}", "V_Buf": f"*{kv_dtype}", "Req_to_token": "*i32",
                "Req_pool_indices": "*i64", "Seq_lens": "*i64", "Mid_O": "*fp32", "Mid_LSE": "*fp32", "Out": "*bf16",
                "Counters": "*i32", "Sinks": "*fp32"}
    scalars = {"sm_scale_log2": "fp32", "v_scale": "fp32", "num_kv_splits": "i32", "min_split_len": "i32",
               "window": "i32"}
    strides = ["stride_qb", "stride_qh", "stride_kt", "stride_kh", "stride_vt", "stride_vh", "stride_r2t",
               "stride_mob", "stride_moh", "stride_mos", "stride_mlb", "stride_mlh", "stride_ob", "stride_oh",
               "stride_cb"]
    fp8 = kv_dtype.startswith("fp8")
    const = dict(GROUP=group, HEAD_BLOCKS=1, HEAD_DIM=head_dim, BLOCK_D=triton.next_power_of_2(head_dim),
                 BLOCK_H=max(16, triton.next_power_of_2(group)), BLOCK_N=block_n, USE_DOT=True, DOT_FP32=False,
                 KV_F16=fp8, V_PAIRS=(1 if kv_dtype == "fp8e4nv" else 2) if v_pairs and fp8 else 0,
                 SLIDING=False, PDL=0, HEADS_FIRST=True, DIRECT=True, MERGE=False, MERGE_HEADS=1, MERGE_SPLITS=1,
                 CAP=0.0, HAS_SINKS=False)
    signature = {**pointers, **scalars, **{s: "i32" for s in strides}, **{k: "constexpr" for k in const}}
    names = list(signature)
    aligned = [names.index(n) for n in (*pointers, *strides)]
    src = ASTSource(fn=_decode_stage1_kernel, signature=signature,
                    constexprs={(names.index(k),): v for k, v in const.items()},
                    attrs={(i,): [["tt.divisibility", 16]] for i in aligned})
    return triton.compile(src, target=GPUTarget("cuda", arch, 32),
                          options={"num_warps": num_warps, "num_stages": num_stages})


def count_ptx(ptx: str) -> collections.Counter:
    """Instruction mnemonics of a PTX listing (predicated ones included), one count per line."""
    return collections.Counter(re.findall(r"^\s*(?:@!?%p\d+\s+)?([a-z][\w.]*)", ptx, re.M))


def summarize(ops: collections.Counter) -> dict[str, int]:
    """KEY_OPS columns: `ld.shared.b8` exactly, the others by prefix (e.g. every `ldmatrix` form)."""
    out = {}
    for key in KEY_OPS:
        if key == "ld.shared.b8":
            out[key] = ops.get(key, 0)
        elif key == "ld.shared":
            out[key] = sum(n for op, n in ops.items() if op.startswith(key) and op != "ld.shared.b8")
        else:
            out[key] = sum(n for op, n in ops.items() if op.startswith(key))
    out["instructions"] = sum(ops.values())
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--kv-dtype", nargs="+", default=["bf16", "fp8e4nv"], help="Triton type names of the pool")
    p.add_argument("--block-n", nargs="+", type=int, default=[64, 128])
    p.add_argument("--num-stages", nargs="+", type=int, default=[2, 3])
    p.add_argument("--num-warps", type=int, default=4)
    p.add_argument("--fp8-v-pairs", nargs="+", type=int, default=[0], help="0 and/or 1: V's fp8 tile as words")
    p.add_argument("--arch", type=int, default=90, help="compute capability x 10 of the target")
    p.add_argument("--out", help="write the rows as JSON here")
    args = p.parse_args(argv)
    rows = []
    configs = [(kv, bn, st, vp) for kv in args.kv_dtype for bn in args.block_n for st in args.num_stages
               for vp in args.fp8_v_pairs if not (vp and not kv.startswith("fp8"))]
    for kv, bn, st, vp in configs:
        compiled = compile_stage1(kv, bn, st, args.num_warps, arch=args.arch, v_pairs=bool(vp))
        rows.append({"kv_dtype": kv, "block_n": bn, "num_stages": st, "v_pairs": vp, "num_warps": args.num_warps,
                     "arch": args.arch, **summarize(count_ptx(compiled.asm["ptx"]))})
    cols = ["kv_dtype", "block_n", "num_stages", "v_pairs", *KEY_OPS, "instructions"]
    print("  ".join(f"{c:>{max(len(c), 8)}}" for c in cols))
    for r in rows:
        print("  ".join(f"{r[c]!s:>{max(len(c), 8)}}" for c in cols))
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"rows": rows, "args": vars(args)}, f, indent=1)
        print(f"wrote {args.out}")


if __name__ == "__main__":
    sys.exit(main())
