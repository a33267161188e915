"""Compiles the decode GEMV kernels for sm_90 without a GPU (run by tests/test_kernel_compile.py in a process
without TRITON_INTERPRET, where `@triton.jit` gives compilable functions). Prints one JSON line: {"probe": error or
null, "results": {case: error or null}}. With `--specs FILE`: the kernels FILE lists (module, name, signature,
constexprs: launches recorded under the interpreter, `test_kernel_compile.launch_specs`) instead of the cases
below; with `--tiles`: `tile_cases`, each also checked against sm_90's shared memory."""

from __future__ import annotations

import json
import os
import sys
from typing import Any

import triton
import triton.language as tl

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def _compile(fn: Any, signature: dict[str, str], constexprs: dict[str, Any], options: dict[str, int] | None = None
             ) -> Any:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    sig = dict(signature)
    sig.update({name: "constexpr" for name in constexprs})
    names = list(fn.arg_names)
    missing = [n for n in names if n not in sig]
    if missing:
        raise ValueError(f"{fn.__name__}: no type given for {missing}")
    src = ASTSource(fn=fn, signature=sig, constexprs={(names.index(k),): v for k, v in constexprs.items()})
    return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options)


@triton.jit
def _probe_kernel(X, BLOCK: tl.constexpr):
    tl.store(X + tl.arange(0, BLOCK), 1.0)


FP8_EW = {"X": "*bf16", "W": "*fp8e4nv", "S": "*fp32", "Bias": "*bf16", "Out": "*bf16", "M": "i32", "N": "i32",
          "K": "i32", "stride_xm": "i32", "stride_wn": "i32", "stride_om": "i32", "out_factor": "fp32",
          "stride_sn": "i32", "group_n": "i32", "group_k": "i32"}
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
                 EVICT=True, RED8=red8, BLOCKS=False, PREFETCH=512 if red8 else 0))
        out[f"fp8_ew blocks two={two} silu={silu} r8={red8} f16={widen}"] = (
            _fp8_gemv_ew_kernel, dict(FP8_EW, W="*u8" if widen else "*fp8e4nv"),
            dict(HAS_BIAS=False, WIDEN_F16=widen, TWO_ROWS=two, SILU_MUL=silu, BLOCK_N=4, BLOCK_K=1024, PDL=1,
                 EVICT=True, RED8=red8, BLOCKS=True, PREFETCH=0))
    for red8, widen, kv in ((True, False, "*fp8e4nv"), (False, True, "*bf16")):
        out[f"fp8_rope r8={red8} f16={widen} kv={kv}"] = (
            _fp8_gemv_rope_kernel,
            dict(ROPE_ARGS, X="*bf16", W="*u8" if widen else "*fp8e4nv", S="*fp32", Bias="*bf16", Out="*bf16",
                 KBuf=kv, VBuf=kv, N="i32", K="i32", stride_wn="i32", out_factor="fp32"),
            dict(HAS_BIAS=True, STORE_KV=True, FP8_MAX=448.0 if kv == "*fp8e4nv" else 0.0, HALF=64,
                 WIDEN_F16=widen, EVICT=True, RED8=red8, BLOCK_N=4, BLOCK_K=1024, PDL=1, PREFETCH=512))
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


SM90_SHARED_MAX = 232_448  # the most dynamic shared memory an sm_90 block may opt into (227 KB)


def tile_cases() -> dict[str, tuple[Any, dict[str, str], dict[str, Any], dict[str, int]]]:
    """Kernels at the tiles and launch options a GPU launch gives them, each of which must fit sm_90's shared memory
    (`--tiles`): the MLA kernels at DeepSeek-V2's head sizes in float32 and bfloat16 (the expanded prefill's at
    GLM-4.7-Flash's too), the largest float32 tiles of the grouped GEMMs and of the MHA extend / decode kernels, the
    tensor-core router and the top-k sum."""
    import torch

    from radixserve.layers.attention.triton_ops import mla_attention, mla_expanded

    out = {}
    for dt, name in ((torch.float32, "fp32"), (torch.bfloat16, "bf16")):
        fn = mla_expanded._mla_expanded_kernel
        sig = {n: "i32" for n in fn.arg_names}
        sig.update({n: "*" + name for n in ("Q", "K", "V", "KPE", "Out")})
        sig.update({n: "*i32" for n in ("QStart", "KVStart", "ExtLens", "KVLens")}, scale_log2="fp32")
        for d, dv in ((128, 128), (192, 256)):  # DeepSeek's heads, GLM-4.7-Flash's (192 padded to 256)
            bm, bn, warps, stages = mla_expanded.default_blocks(dt, head_dims=(d, 64, dv))
            out[f"mla_expanded {name} {d}/{dv} {bm}x{bn}"] = (
                fn, sig, dict(D=d, R=64, DV=dv, BLOCK_D=triton.next_power_of_2(d), BLOCK_R=64, BLOCK_DV=dv,
                              BLOCK_M=bm, BLOCK_N=bn, DOT_FP32=dt == torch.float32),
                dict(num_warps=warps, num_stages=stages))
        fn = mla_attention._mla_decode_stage1_kernel
        sig = {n: "i32" for n in fn.arg_names}
        sig.update({n: "*" + name for n in ("Q", "KV_Buf", "Out")}, Mid_O="*fp32", Mid_LSE="*fp32",
                   Req_to_token="*i32", Req_pool_indices="*i64", Seq_lens="*i32", Counters="*i32",
                   sm_scale_log2="fp32")
        out[f"mla_decode {name}"] = (
            fn, sig, dict(C=512, R=64, BLOCK_C=512, BLOCK_R=64, BLOCK_H=16, BLOCK_N=mla_attention.DECODE_BLOCK_N,
                          DOT_FP32=dt == torch.float32, DIRECT=True, MERGE=False, MERGE_SPLITS=1, PDL=1),
            dict(num_warps=mla_attention.DECODE_WARPS, num_stages=mla_attention.DECODE_STAGES))
    # the grouped GEMMs' largest heuristic tile (a large prefill), float32, with GPT-OSS's biases and activation
    from radixserve.layers.moe import fused_moe

    cfg = fused_moe.moe_config(1 << 20, 1, 1, 1024, 1024)
    for fn, block_n in ((fused_moe._gate_up_kernel, cfg.block_n_gate_up), (fused_moe._down_kernel, cfg.block_n_down)):
        sig = {n: "*i32" if n in ("Sorted", "ExpertIds", "Total") else "i32" for n in fn.arg_names}
        sig.update({n: "*fp32" for n in ("X", "W13", "Inter", "W2", "Out", "Weights", "Scale", "XScale", "Bias")
                    if n in fn.arg_names})
        sig.update({n: "fp32" for n in ("alpha", "limit") if n in fn.arg_names})
        act = {"ACT": 1} if fn is fused_moe._gate_up_kernel else {}
        out[f"{fn.__name__} fp32 {cfg.block_m}x{block_n}"] = (
            fn, sig, dict(BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, FP32=True, N_FIRST=True,
                          QUANT=False, A8=False, HAS_BIAS=True, **act),
            dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
        if fn is fused_moe._gate_up_kernel:  # Nemotron 3's non-gated relu2 experts, without biases
            out[f"{fn.__name__} fp32 relu2 {cfg.block_m}x{block_n}"] = (
                fn, sig, dict(BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, FP32=True, N_FIRST=True,
                              QUANT=False, A8=False, HAS_BIAS=False, ACT=2),
                dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    # fp8 experts of a bf16 model: the W8A8 grouped GEMMs at their tuned tiles, the small-batch kernels in their
    # three fp8 forms (per-row scales on the CUDA cores, block-wise through tl.dot or on the CUDA cores) at their
    # default tiles
    for cfg in sorted(set(fused_moe.TUNED_FP8[(128, 768, 2048)].values()), key=str)[:2]:
        for fn, block_n in ((fused_moe._gate_up_kernel, cfg.block_n_gate_up),
                            (fused_moe._down_kernel, cfg.block_n_down)):
            sig = {n: "*i32" if n in ("Sorted", "ExpertIds", "Total") else "i32" for n in fn.arg_names}
            sig.update({n: "*fp8e4nv" for n in ("X", "W13", "W2") if n in fn.arg_names})
            sig.update(Inter="*fp8e4nv" if fn is fused_moe._down_kernel else "*bf16", Out="*bf16", Weights="*fp32",
                       Scale="*fp32", XScale="*fp32", Bias="*bf16", alpha="fp32", limit="fp32")
            sig = {n: t for n, t in sig.items() if n in fn.arg_names}
            plain = {"HAS_BIAS": False, **({"ACT": 0} if fn is fused_moe._gate_up_kernel else {})}
            out[f"{fn.__name__} fp8 w8a8 {cfg.block_m}x{block_n}"] = (
                fn, sig, dict(BLOCK_M=cfg.block_m, BLOCK_N=block_n, BLOCK_K=cfg.block_k, FP32=False, N_FIRST=True,
                              QUANT=True, A8=True, **plain), dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages))
    from radixserve.layers.moe import small_batch

    # ... and bf16 experts' at the default tile with GPT-OSS's biases and activation (fp8 experts never carry them)
    for quant, cfg in ((0, small_batch.DEFAULT), (1, small_batch.DEFAULT_FP8_ROWS),
                       (2, small_batch.DEFAULT_FP8_BLOCKS), (3, small_batch.DEFAULT_FP8_ROWS)):
        for fn, bn, bk in ((small_batch._small_gate_up_kernel, cfg.block_n_gate_up, cfg.block_k_gate_up),
                           (small_batch._small_down_kernel, cfg.block_n_down, min(cfg.block_k_down, 128))):
            sig = {n: "i32" for n in fn.arg_names}
            sig.update({n: "*bf16" if quant == 0 else "*fp8e4nv" for n in ("W13", "W13S", "W2", "W2S")
                        if n in fn.arg_names})
            sig.update(X="*bf16", Inter="*bf16", Out="*bf16", Partial="*fp32", Count="*i32", Weights="*fp32",
                       Ids="*i32", Bias="*bf16", alpha="fp32", limit="fp32")
            sig.update({n: "*fp32" if quant else "*bf16" for n in ("Scale", "SScale")})  # (16-bit: placeholders)
            sig = {n: t for n, t in sig.items() if n in fn.arg_names}
            consts = dict(BLOCK_N=bn, BLOCK_K=bk if quant == 1 else min(bk, 128), FP32=False, PDL=1, QUANT=quant,
                          HAS_BIAS=quant == 0)
            if fn is small_batch._small_down_kernel:
                consts["S_PAD"] = 8
            else:
                consts["ACT"] = 1 if quant == 0 else 0
            name = "bf16 gpt-oss" if quant == 0 else f"fp8 quant={quant}"
            out[f"{fn.__name__} {name}"] = (fn, sig, consts, dict(num_warps=cfg.warps, num_stages=cfg.stages))
            if fn is small_batch._small_gate_up_kernel and quant == 0:  # Nemotron 3's non-gated relu2 experts
                out[f"{fn.__name__} bf16 relu2"] = (fn, sig, {**consts, "ACT": 2, "HAS_BIAS": False},
                                                    dict(num_warps=cfg.warps, num_stages=cfg.stages))
    # the router on the tensor cores (DeepSeek-V2-Lite's 64 experts top-6, DeepSeek-V3's 256 with its bias) and
    # the top-k sum, at the GPU's launch options
    from radixserve.layers.moe import gate_gemm

    fn = gate_gemm._gate_partial_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(X="*bf16", W="*bf16", Partials="*fp32")
    for e_pad, block_k in ((64, 128), (256, 64)):
        out[f"gate_partial E={e_pad}"] = (fn, sig, dict(BLOCK_T=16, E_PAD=e_pad, BLOCK_K=block_k, UPCAST=False, PDL=1),
                                          dict(num_warps=4, num_stages=3))
    fn = gate_gemm._gate_finish_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update(Partials="*fp32", Bias="*fp32", Logits="*fp32", Weights="*fp32", Ids="*i32", scaling="fp32")
    for e_pad, k, sigmoid in ((64, 6, False), (256, 8, True)):
        out[f"gate_finish E={e_pad} k={k}"] = (
            fn, sig, dict(MAX_SPLITS=gate_gemm.MAX_SPLITS, BLOCK_T=4, E_PAD=e_pad, K=k, K_PAD=triton.next_power_of_2(k),
                          SIGMOID=sigmoid, HAS_BIAS=sigmoid, RENORM=True, SELECT=True, PDL=1), dict(num_warps=4))
    # the MHA kernels' GPU defaults in float32, the largest tiles: extend at head dims 64 / 128 / 256, decode at 256
    from radixserve.layers.attention.triton_ops import decode_attention, extend_attention

    fn = extend_attention._extend_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*fp32" for n in ("Q", "K_Ext", "V_Ext", "Out", "K_Buf", "V_Buf", "Sinks")}, sm_scale_log2="fp32",
               prefix_scale_log2="fp32", v_scale="fp32")
    sig.update({n: "*i32" for n in ("Req_to_token", "Req_pool_indices", "Prefix_lens", "Extend_lens", "Extend_start")})
    for hd in (64, 128, 256):
        bm, bn, warps, stages = extend_attention._default_blocks(hd, False)
        for has_sinks in (False, True) if hd == 64 else (False,):  # GPT-OSS's head dim, with its sinks
            out[f"extend fp32 d={hd}" + " sinks" * has_sinks] = (
                fn, sig, dict(GROUP=4, HEAD_DIM=hd, BLOCK_D=hd, BLOCK_M=bm, BLOCK_N=bn, DOT_FP32=True, KV_FP8=False,
                              SLIDING=has_sinks, CAP=0.0, HAS_SINKS=has_sinks),
                dict(num_warps=warps, num_stages=stages))
    fn = decode_attention._decode_stage1_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*fp32" for n in ("Q", "K_Buf", "V_Buf", "Out", "Mid_O", "Mid_LSE", "Sinks")}, sm_scale_log2="fp32",
               v_scale="fp32")
    sig.update({n: "*i32" for n in ("Req_to_token", "Req_pool_indices", "Seq_lens", "Counters")})
    block_h = decode_attention._block_h(8, True)
    out["decode fp32 d=256 group 8"] = (
        fn, sig, dict(GROUP=8, HEAD_BLOCKS=triton.cdiv(8, block_h), HEAD_DIM=256, BLOCK_D=256, BLOCK_H=block_h,
                      BLOCK_N=64, USE_DOT=True, DOT_FP32=True, KV_F16=False, V_PAIRS=0, SLIDING=False, PDL=1,
                      HEADS_FIRST=False, DIRECT=False, MERGE=False, MERGE_HEADS=1, MERGE_SPLITS=1, CAP=0.0,
                      HAS_SINKS=False),
        dict(num_warps=8, num_stages=2))
    # GPT-OSS's shape with its sinks (head dim 64, 64 query heads on 8 KV heads): merged in stage 1's launch, and
    # stage 2's merge
    block_h = decode_attention._block_h(8, True)
    out["decode bf16 d=64 group 8 sinks"] = (
        fn, dict(sig, **{n: "*bf16" for n in ("Q", "K_Buf", "V_Buf", "Out")}),
        dict(GROUP=8, HEAD_BLOCKS=triton.cdiv(8, block_h), HEAD_DIM=64, BLOCK_D=64, BLOCK_H=block_h, BLOCK_N=64,
             USE_DOT=True, DOT_FP32=False, KV_F16=False, V_PAIRS=0, SLIDING=True, PDL=1, HEADS_FIRST=True,
             DIRECT=False, MERGE=True, MERGE_HEADS=8, MERGE_SPLITS=decode_attention.merge_split_block(8, 64),
             CAP=0.0, HAS_SINKS=True),
        dict(num_warps=4, num_stages=2))
    fn = decode_attention._decode_stage2_kernel
    sig = {n: "i32" for n in fn.arg_names}
    sig.update({n: "*fp32" for n in ("Mid_O", "Mid_LSE", "Sinks")}, Out="*bf16", Seq_lens="*i64")
    out["decode stage 2 bf16 d=64 sinks"] = (
        fn, sig, dict(HEAD_DIM=64, BLOCK_D=64, BLOCK_N=64, SPLIT_BLOCK=1, PDL=1, SPARSE=0, HAS_SINKS=True),
        dict(num_warps=4, num_stages=1))
    out["moe_sum k=6"] = (fused_moe._moe_sum_kernel, {"Rows": "*bf16", "Out": "*bf16", "hidden": "i32"},
                          dict(K=6, BLOCK_H=1024), dict(num_warps=4))
    return out


def recorded_cases(path: str) -> dict[str, tuple[Any, dict[str, str], dict[str, Any]]]:
    import importlib

    with open(path) as f:
        specs = json.load(f)
    return {f"{s['module']}.{s['name']} {sorted(s['constexprs'].items())}": (
        getattr(importlib.import_module(s["module"]), s["name"]), s["signature"], s["constexprs"]) for s in specs}


_TODO: dict[str, tuple] = {}  # the cases of this run, read by the forked workers by name


def _one(name: str, tiles: bool) -> str | None:
    """Compile case `name` of `_TODO`: None, or why it failed (with --tiles, also a tile past sm_90's shared
    memory)."""
    fn, sig, const, *opts = _TODO[name]
    try:
        kernel = _compile(fn, sig, const, *opts)
    except Exception as e:
        return f"{type(e).__name__}: {str(e)[:2000]}"
    if const.get("PREFETCH") and const.get("PDL"):  # the weight's prefetch must come before the PDL wait
        ptx = kernel.asm["ptx"]
        first, wait = ptx.find("prefetch.global.L2"), ptx.find("griddepcontrol.wait")
        if not 0 <= first < wait:
            return f"prefetch at {first} of the PTX, the PDL wait at {wait}"
    shared = kernel.metadata.shared
    return f"{shared} bytes of shared memory" if tiles and shared > SM90_SHARED_MAX else None


def _compile_all(todo: dict[str, tuple], tiles: bool) -> dict[str, str | None]:
    """Every case compiled, over as many forked processes as this machine has cores (each compile is one core's
    work for up to tens of seconds; Triton's cache keeps the results for the next run either way)."""
    global _TODO
    _TODO = todo
    names = list(todo)
    workers = min(len(names), len(os.sched_getaffinity(0)))
    if workers <= 1:
        return {name: _one(name, tiles) for name in names}
    import multiprocessing
    from concurrent.futures import ProcessPoolExecutor

    with ProcessPoolExecutor(workers, mp_context=multiprocessing.get_context("fork")) as pool:
        return dict(zip(names, pool.map(_one, names, [tiles] * len(names)), strict=True))


def main() -> None:
    try:
        _compile(_probe_kernel, {"X": "*fp32"}, {"BLOCK": 16})
    except Exception as e:  # no NVIDIA backend or ptxas in this install
        print(json.dumps({"probe": f"{type(e).__name__}: {e}", "results": {}}))
        return
    if sys.argv[1:2] == ["--tiles"]:
        results = _compile_all(tile_cases(), tiles=True)
    else:
        results = _compile_all(recorded_cases(sys.argv[2]) if sys.argv[1:2] == ["--specs"] else cases(), tiles=False)
    print(json.dumps({"probe": None, "results": results}))


if __name__ == "__main__":
    main()
