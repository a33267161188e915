"""Compiles the decode GEMV kernels for sm_90 without a GPU (run by tests/test_kernel_compile.py in a process
without TRITON_INTERPRET, where `@triton.jit` gives compilable functions). Prints one JSON line: {"probe": error or
null, "results": {case: error or null}}. With `--specs FILE`: the kernels FILE lists (module, name, signature,
constexprs: launches recorded under the interpreter, `test_kernel_compile.launch_specs`) instead of the cases
below."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any]) -> None:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = list(fn.arg_names)
    missing = [n for n in names if n not in sig]
    if missing:
        raise ValueError(f"{fn.__name__}: no type given for {missing}")
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    triton.compile(src, target=GPUTarget("cuda", 90, 32))


@triton.jit
def _probe_kernel(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, BLOCK), 1.0)


FP8_EW = {"X": "*bf16", "W": "*fp8e4nv", "S": "*fp32", "Bias": "*bf16", "Out": "*bf16", "M": "i32", "N": "i32",
          "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "out_factor": "fp32"}
ROPE_ARGS = {"Positions": "*i64", "Cos": "*fp32", "Sin": "*fp32", "Loc": "*i64", "stride_cache": "i32",
             "stride_kb": "i32", "stride_vb": "i32", "num_q_heads": "i32", "num_kv_heads": "i32", "k_inv": "fp32",
             "v_inv": "fp32"}


def cases() -> dict[str, tuple[Any, dict[str, str], dict[str, Any]]]:
    from radixserve.layers.quantization.fp8_gemv import _fp8_gemv_ew_kernel
    from radixserve.layers.quantization.fp8_gemv_rope import _fp8_gemv_rope_kernel
    from radixserve.layers.triton_ops.gemv import _gemv_row_kernel
    from radixserve.layers.triton_ops.gemv_rope import _gemv_rope_kernel

    out = {}
    for two, silu, red8, widen in ((True, False, True, False), (False, True, True, True), (False, False, False, False),
                                   (True, False, False, True)):
        out[f"fp8_ew two={two} silu={silu} r8={red8} f16={widen}"] = (
            _fp8_gemv_ew_kernel, dict(FP8_EW, W="*u8" if widen else "*fp8e4nv"),
            dict(HAS_BIAS=True, WIDEN_F16=widen, TWO_ROWS=two, SILU_MUL=silu, BLOCK_N=4, BLOCK_K=1024, PDL=1,
                 EVICT=True, RED8=red8))
    for red8, widen, kv in ((True, False, "*fp8e4nv"), (False, True, "*bf16")):
        out[f"fp8_rope r8={red8} f16={widen} kv={kv}"] = (
            _fp8_gemv_rope_kernel,
            dict(ROPE_ARGS, X="*bf16", W="*u8" if widen else "*fp8e4nv", S="*fp32", Bias="*bf16", Out="*bf16",
                 KBuf=kv, VBuf=kv, N="i32", K="i32", stride_wn="i32", out_factor="fp32"),
            dict(HAS_BIAS=True, STORE_KV=True, FP8_MAX=448.0 if kv == "*fp8e4nv" else 0.0, HALF=64,
                 WIDEN_F16=widen, EVICT=True, RED8=red8, BLOCK_N=4, BLOCK_K=1024, PDL=1))
    row_args = {"X": "*bf16", "Res": "*bf16", "NormW": "*bf16", "ResOut": "*bf16", "W": "*bf16", "W2": "*bf16",
                "Bias": "*bf16", "Out": "*bf16", "Slot": "*i32", "N1": "i32", "N": "i32", "K": "i32",
                "stride_wn": "i32", "stride_w2n": "i32", "eps": "fp32"}
    out["row16 norm"] = (
        _gemv_row_kernel, row_args,
        dict(HAS_W2=False, NORM=True, HAS_RES=True, HAS_BIAS=False, SILU_MUL=False, EVEN_K=True, BLOCK_N=4,
             BLOCK_K=1024, SLOT_ROWS=0, PDL=1))
    # the MoE / MLA attention's pick: one chunk of K (the weight asked for before the statistics, no loop after),
    # two weights (DeepSeek's q_proj + kv_a)
    out["row16 norm one chunk"] = (
        _gemv_row_kernel, row_args,
        dict(HAS_W2=True, NORM=True, HAS_RES=True, HAS_BIAS=False, SILU_MUL=False, EVEN_K=True, BLOCK_N=2,
             BLOCK_K=2048, SLOT_ROWS=0, PDL=1))
    out["row16 rope"] = (
        _gemv_rope_kernel,
        dict(ROPE_ARGS, X="*bf16", W="*bf16", Bias="*bf16", Out="*bf16", KBuf="*bf16", VBuf="*bf16", K="i32",
             stride_wn="i32"),
        dict(HAS_BIAS=True, STORE_KV=True, FP8_MAX=0.0, EVEN_K=True, HALF=64, BLOCK_N=2, BLOCK_K=2048, PDL=1))
    return out


def recorded_cases(path: str) -> dict[str, tuple[Any, dict[str, str], dict[str, Any]]]:
    import importlib

    with open(path) as f:
        specs = json.load(f)
    return {f"{s['module']}.{s['name']} {sorted(s['constexprs'].items())}": (
        getattr(importlib.import_module(s["module"]), s["name"]), s["signature"], s["constexprs"]) for s in specs}


def main() -> None:
    try:
        _compile(_probe_kernel, {"X": "*fp32"}, {"BLOCK": 16})
    except Exception as e:  # no NVIDIA backend or ptxas in this install
        print(json.dumps({"probe": f"{type(e).__name__}: {e}", "results": {}}))
        return
    results = {}
    todo = recorded_cases(sys.argv[2]) if sys.argv[1:2] == ["--specs"] else cases()
    for name, (fn, sig, const) in todo.items():
        try:
            _compile(fn, sig, const)
            results[name] = None
        except Exception as e:
            results[name] = f"{type(e).__name__}: {str(e)[:2000]}"
    print(json.dumps({"probe": None, "results": results}))


if __name__ == "__main__":
    main()
