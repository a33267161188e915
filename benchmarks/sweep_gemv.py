"""Sweep the block sizes of the decode GEMV kernels (fp8 per-channel, GGUF Q4_K and Q8_0, the one-row 16-bit GEMV
"row16" / "row16_silu", the 16-bit product of 17..256 rows "mid16" / "mid16_silu") on a model's linear shapes and
pick the fastest per (family, M, N, K), against the device's copy bandwidth and the bf16 cuBLAS product (for the
"_silu" families: cuBLAS, then the SiLU·mul kernel).

Each candidate is checked against the torch reference, then timed inside a CUDA graph (as in decode) over enough
copies of the weight that the set is several times the L2, so every call reads HBM. Candidates compile first in a
pool of processes (Triton's disk cache), so the sweep's time goes to measuring. Prints a table per family and M,
the estimated weight time of one decode step of the model, and writes the picks as a `gemv_configs` JSON.

    python benchmarks/sweep_gemv.py --families fp8 q4_k q8_0 --m 1 --out picks.json
    python benchmarks/sweep_gemv.py --families row16 row16_silu --m 1 --baselines --out picks.json  # only wins kept
    python benchmarks/sweep_gemv.py --families int8 --m 1 2 4 --baselines --out picks.json  # the int8 LM head
    python benchmarks/sweep_gemv.py --families mid16 mid16_silu --m 32 64 96 128 160 256 --baselines --out picks.json
    RADIXSERVE_GEMV_CONFIGS=picks.json python benchmarks/bench_quant_gpu.py --config fp8 --batch-size 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing as mp
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))  # layer_timing, also when imported as a module

from radixserve.layers.quantization.gemv_configs import MID_FAMILIES, GemvConfig, key  # noqa: E402

# Llama-3.1-8B: qkv, o, gate_up, down (N, K); each appears once per layer
SHAPES_8B = [(6144, 4096), (4096, 4096), (28672, 4096), (4096, 14336)]
LAYERS_8B = 32
LM_HEAD_8B = (128256, 4096)  # once a step; swept for the 16-bit GEMV only
# --shapes: (qkv, o, gate_up, down), the LM head of each rank and the layer count; 8b_tp2: the 8B split over 2
# ranks (the LM head's vocabulary too); qwen2.5-7b: Qwen2.5-7B (28 q heads and 4 KV heads of 128)
SHAPE_SETS = {"8b": (SHAPES_8B, LM_HEAD_8B, LAYERS_8B),
              "8b_tp2": ([(3072, 4096), (4096, 2048), (14336, 4096), (4096, 7168)], (64128, 4096), LAYERS_8B),
              "qwen2.5-7b": ([(4608, 3584), (3584, 3584), (37888, 3584), (3584, 18944)], (152064, 3584), 28)}


def candidates(family: str, m: int, quick: bool) -> list[GemvConfig]:
    out: list[GemvConfig] = []
    if (family in MID_FAMILIES) != (m > 16):  # fp8_mid / mid16 take 17..256 rows, the GEMV kernels 1..16
        return out
    if family in ("fp8", "fp8_silu", "int8"):
        if m == 1:
            for bn in (1, 2, 4, 8):
                for bk in (1024, 2048, 4096):
                    for w in (4, 8):
                        for v in ("", "r8", "ef+r8"):
                            out.append(GemvConfig("ew", bn, bk, w, 2, v))
        elif m == 2 and family in ("fp8", "int8"):  # (the elementwise kernel's SiLU·mul epilogue takes one row)
            out += [GemvConfig("ew", bn, bk, w, 2, v) for bn in (2, 4) for bk in (1024, 2048) for w in (4, 8)
                    for v in ("", "r8", "ef+r8")]
        dots = [(16, 256), (32, 256), (16, 512), (32, 512)] if m <= 4 else \
            [(16, 128), (32, 128), (64, 128), (16, 256), (32, 256), (64, 256), (16, 512), (32, 512)]
        out += [GemvConfig("dot", bn, bk, 4, 3) for bn, bk in dots]
    elif family in ("row16", "row16_silu"):  # the one-row 16-bit GEMV: triton_ops/gemv (M = 1)
        if m == 1:
            out += [GemvConfig("ew", bn, bk, w, 2) for bn in (1, 2, 4, 8) for bk in (512, 1024, 2048)
                    for w in (4, 8) if bn * bk <= 8192]
    elif family == "fp8_mid":  # the transposed W8A8 / W8A16 product at 17..256 rows, against torch._scaled_mm
        out.append(GemvConfig("scaled_mm", 0, 0))
        out.append(GemvConfig("scaled_mm_t", 0, 0))  # cuBLASLt's product transposed (the weight's rows tiled)
        out.append(GemvConfig("scaled_mm_unit", 0, 0))  # cuBLASLt's tensor-wise product, the scales after it
        bms = (32, 64) if m <= 64 else (32, 64, 128)
        for bn in (64, 128):
            for bm in bms:
                for bk in (128, 256):
                    if bn * bm <= 128 * 128:  # the accumulator's registers
                        out.append(GemvConfig("w8a8", bn, bk, 4, 4 if bk == 128 else 3, block_m=bm))
        if m > 64:
            out.append(GemvConfig("w8a8", 64, 128, 4, 3, block_m=256))
        out += [GemvConfig("w8a16", bn, 128, w, 3, block_m=bm) for bn, w in ((64, 4), (128, 8)) for bm in bms[:2]]
        out.append(GemvConfig("w8a8", 32, 256, 4, 4, block_m=bms[0]))
    elif family in ("mid16", "mid16_silu"):  # the transposed 16-bit product (triton_ops/gemm_mid), against cuBLAS
        out.append(GemvConfig("cublas", 0, 0))  # (with the SiLU·mul kernel after it for mid16_silu)
        bms = (16, 32, 64) if m <= 32 else (32, 64) if m <= 64 else (32, 64, 128)
        for bn in (32, 64, 128):
            for bm in bms:
                if bn * bm > (64 * 64 if family == "mid16_silu" else 128 * 64):  # the accumulators' registers
                    continue
                for bk, st in ((64, 4), (128, 3), (128, 4)):
                    rows = (2 * bn if family == "mid16_silu" else bn) + bm  # weight and x rows a stage holds
                    if rows * bk * 2 * st > 224 * 1024:  # past an H100 / H200 SM's shared memory
                        continue
                    for split in (1, 2, 4):
                        out.append(GemvConfig("tn", bn, bk, 8 if bn * bm >= 128 * 64 else 4, st, block_m=bm,
                                              split_k=split))
    elif family in ("q4_k", "q8_0"):
        bns = (1, 2, 4, 8) if m == 1 else (2, 4)
        bks = (256, 512, 1024) if family == "q4_k" else (512, 1024)
        out += [GemvConfig("ew", bn, bk, 4, 2) for bn in bns for bk in bks]
        out += [GemvConfig("ew", bn, bk, 8, 2) for bn in (4, 8) for bk in bks[-1:]]
        out += [GemvConfig("ew", bn, bk, 4, 2, "magic") for bn in bns[-2:] for bk in bks[-2:]]
        if family == "q4_k":  # the variant with no reduction inside the loop
            out += [GemvConfig("acc", bn, bk, w, 2, v) for bn, bk, w in
                    [(4, 512, 4), (2, 1024, 4), (8, 512, 4), (4, 1024, 4), (8, 1024, 8), (2, 512, 4),
                     (4, 512, 2), (2, 1024, 2), (16, 256, 4)]
                    for v in ("", "magic")]
            # the integer tensor-core kernel (x to int8 per 32 columns in the program, scales after the MMA)
            out += [GemvConfig("mma", bn, bk, w, st) for bn, bk, w, st in
                    [(16, 256, 4, 2), (16, 512, 4, 2), (32, 256, 4, 2), (32, 512, 4, 2), (16, 1024, 4, 2),
                     (32, 1024, 8, 2), (64, 256, 4, 2), (64, 512, 8, 2), (16, 512, 2, 2), (32, 512, 4, 3)]]
            out += [GemvConfig("mma", bn, bk, w, 2, "2d") for bn, bk, w in [(16, 256, 4), (32, 256, 4), (16, 512, 2)]]
            # integer products by dp4a on the CUDA cores: x quantised per weight row (dp4a), once per program and
            # step (dp4w), or once beforehand by a small kernel (dp4x); the last two on whole words
            out += [GemvConfig("dp4a", bn, bk, w, 2) for bn, bk, w in [(2, 1024, 4), (4, 512, 4), (8, 512, 4)]]
            out += [GemvConfig("dp4w", bn, bk, w, st) for bn, bk, w, st in
                    [(8, 512, 4, 2), (16, 512, 4, 2), (16, 1024, 8, 2), (32, 256, 4, 2), (32, 512, 8, 2),
                     (64, 256, 8, 2)]]
            out += [GemvConfig("dp4x", bn, bk, w, st) for bn, bk, w, st in
                    [(4, 512, 4, 2), (8, 512, 4, 2), (8, 1024, 4, 2), (16, 512, 4, 2), (16, 256, 4, 3),
                     (32, 256, 4, 2), (4, 1024, 2, 2), (2, 1024, 2, 2)]]
            # dp4x laid out by whole chunks: a thread's two halves and rows in its own registers (block_k / 64 >=
            # the program's threads), the scales in the same register layout
            out += [GemvConfig("dp4c", bn, bk, w, st) for bn in (1, 2, 4, 8) for bk, w, st in
                    [(2048, 1, 1), (4096, 1, 1), (4096, 2, 1), (2048, 1, 2), (2048, 1, 3)]]
            # every row of x (up to 16) as a column of one int8 MMA per sub-block, x quantised beforehand
            out += [GemvConfig("mma_rows", bn, bk, w, st) for bn, bk, w, st in
                    [(16, 256, 4, 2), (16, 512, 4, 2), (32, 256, 4, 2), (32, 512, 4, 2), (64, 256, 4, 2),
                     (16, 1024, 4, 2), (32, 512, 8, 3)]]
    return out[:6] if quick else out


# ---------------------------------------------------------------- problems and calls
def make_weight(family: str, n: int, k: int, seed: int):  # noqa: ANN201
    import torch

    g = torch.Generator(device="cuda").manual_seed(seed)
    w = torch.randn(n, k, device="cuda", generator=g) * 0.02
    if family in ("fp8", "fp8_silu", "fp8_gemm", "fp8_mid"):
        from radixserve.layers.quantization.fp8 import quantize_rows

        q, s = quantize_rows(w)
        return {"w": q, "s": s}
    if family == "int8":
        from radixserve.layers.quantization.lm_head_int8 import quantize_rows_int8

        q, s = quantize_rows_int8(w)
        return {"w": q, "s": s}
    if family in ("cublas", "cublas_silu", "row16", "row16_silu", "mid16", "mid16_silu"):
        return {"w": w.to(torch.bfloat16)}
    from radixserve.layers.quantization import gguf_formats as G

    return G.quantize(G.Q4_K if family == "q4_k" else G.Q8_0, w)


def nbytes(fields: dict) -> int:
    return sum(t.numel() * t.element_size() for t in fields.values())


def call(family: str, x, fields: dict, n: int, cfg: GemvConfig | None):  # noqa: ANN001, ANN201
    import torch
    import torch.nn.functional as F

    if family in ("fp8", "fp8_silu"):
        from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv

        return fp8_skinny_gemv(x, fields["w"], fields["s"], x.dtype, None, cfg, silu_mul=family == "fp8_silu")
    if family == "int8":  # the int8 LM head: float32 logits
        from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv

        return fp8_skinny_gemv(x, fields["w"], fields["s"], torch.float32, None, cfg)
    if family == "fp8_mid":
        if cfg is None or cfg.kernel == "scaled_mm":  # what the layer runs without a table entry
            from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

            xq, xs = per_token_group_quant_fp8(x, x.shape[1])
            return torch._scaled_mm(xq, fields["w"].t(), scale_a=xs, scale_b=fields["s"].view(1, -1),
                                    out_dtype=x.dtype)
        from radixserve.layers.quantization.fp8_mid import fp8_mid_mm

        return fp8_mid_mm(x, fields["w"], fields["s"], x.dtype, cfg)
    if family in ("mid16", "mid16_silu"):
        silu = family == "mid16_silu"
        if cfg is None or cfg.kernel == "cublas":
            return call("cublas_silu" if silu else "cublas", x, fields, n, None)
        from radixserve.layers.triton_ops.gemm_mid import mid_mm

        return mid_mm(x, fields["w"], None, cfg, silu_mul=silu)
    if family == "fp8_gemm":  # the previous W8A16 tl.dot kernel
        from radixserve.layers.quantization.fp8_kernels import fp8_gemm

        return fp8_gemm(x, fields["w"], fields["s"].view(-1, 1), 1, fields["w"].shape[1], x.dtype)
    if family == "cublas":
        return F.linear(x, fields["w"])
    if family == "cublas_silu":  # the unfused path: the product, then the SiLU·mul kernel
        from radixserve.layers.triton_ops.activation import silu_and_mul

        return silu_and_mul(F.linear(x, fields["w"]))
    if family in ("row16", "row16_silu"):
        from radixserve.layers.triton_ops.gemv import gemv_row

        return gemv_row(x, fields["w"], None, cfg, silu_mul=family == "row16_silu")
    from radixserve.layers.quantization.gguf_kernels import gguf_gemv

    return gguf_gemv(x, "Q4_K" if family == "q4_k" else "Q8_0", fields, n, None, cfg)


def reference(family: str, x, fields: dict):  # noqa: ANN001, ANN201
    import torch

    if family in ("fp8", "fp8_gemm", "fp8_silu", "fp8_mid", "cublas", "cublas_silu", "row16", "row16_silu",
                  "mid16", "mid16_silu", "int8"):
        w = fields["w"].float() * fields["s"].view(-1, 1) if "s" in fields else fields["w"].float()
        out = x.float() @ w.t()
        if family.endswith("_silu"):
            gate, up = out.chunk(2, dim=-1)
            out = torch.nn.functional.silu(gate) * up
        return out
    from radixserve.layers.quantization import gguf_formats as G

    return x.float() @ G.dequantize("Q4_K" if family == "q4_k" else "Q8_0", fields).t()


def _compile_worker(jobs: list[tuple[str, int, dict]]) -> int:
    import torch

    done = 0
    for family, m, cfg in jobs:
        if family == "fp8_warm":  # compile what a model's decode graphs will use (table picks, defaults)
            try:
                from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv

                n, k = cfg["block_n"], cfg["block_k"]  # the shape, carried in the config's fields
                fields = make_weight("fp8", n, k, 0)
                for rows in (1, 2, 3, 16):
                    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                    for pdl in (0, 1, 2) if rows == 1 and cfg["variant"] == "pdl" else (0,):  # the chain's
                        fp8_skinny_gemv(x, fields["w"], fields["s"], x.dtype, pdl_level=pdl)
                        if (n, k) == SHAPES_8B[2]:
                            fp8_skinny_gemv(x, fields["w"], fields["s"], x.dtype, silu_mul=True, pdl_level=pdl)
                done += 1
            except Exception as e:  # noqa: BLE001
                print(f"warm-up failed for {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
            continue
        try:  # Q4_K's d/dmin row stride (K / 256) is a multiple of 16 at K = 4096, not at 14336: both variants
            for k in (4096, 14336) if family in ("q4_k",) + MID_FAMILIES else (4096,):  # fp8_mid: x's quant
                fields = make_weight(family, 128, k, 0)
                # fp8_mid / mid16: also a row count that is not a multiple of 16 (the other specialisation a
                # model's CUDA graphs compile)
                for rows in (m, m - 1) if family in MID_FAMILIES else (m,):
                    x = torch.randn(rows, k, device="cuda", dtype=torch.bfloat16)
                    call(family, x, fields, 128, GemvConfig(**cfg))
            done += 1
        except Exception as e:  # noqa: BLE001 - reported, the main process skips it
            print(f"compile failed {family} m={m} {cfg}: {type(e).__name__}: {str(e)[:200]}", flush=True)
    torch.cuda.synchronize()
    return done


def precompile(jobs: list[tuple[str, int, GemvConfig]], workers: int) -> None:
    t = time.time()
    todo = [(f, m, c.to_dict()) for f, m, c in jobs]
    chunks = [todo[i::workers] for i in range(workers)]
    with mp.get_context("spawn").Pool(workers) as pool:
        n = sum(pool.map(_compile_worker, [c for c in chunks if c]))
    print(f"# precompiled {n}/{len(todo)} kernels in {time.time() - t:.1f} s with {workers} processes", flush=True)


def time_calls(fn, reps: int, replays: int = 5) -> float:  # noqa: ANN001
    """Seconds per call of fn(i) for i in 0..reps-1, captured in one CUDA graph (median of the replays)."""
    from layer_timing import capture_graph, replay_seconds

    def calls() -> None:
        for i in range(reps):
            fn(i)

    times = replay_seconds(capture_graph(calls), replays)
    return sorted(times)[len(times) // 2] / reps


def sweep_shape(family: str, m: int, n: int, k: int, cfgs: list[GemvConfig | None], copy_bw: float,
                min_bytes: int) -> list[dict]:
    import torch

    w0 = make_weight(family, n, k, 1)
    per = nbytes(w0)
    copies = [w0] + [{f: t.clone() for f, t in w0.items()} for _ in range(max(1, -(-min_bytes // per)) - 1)]
    x = (torch.randn(m, k, device="cuda") * 0.5).to(torch.bfloat16)
    ref = reference(family, x, w0)
    reps = max(len(copies), 24)
    rows = []
    for cfg in cfgs:
        try:
            out = call(family, x, w0, n, cfg)
            if out is None:
                continue
            err = float((out.float() - ref).norm() / ref.norm())
            sec = time_calls(lambda i: call(family, x, copies[i % len(copies)], n, cfg), reps)  # noqa: B023
        except Exception as e:  # noqa: BLE001
            print(f"  failed {family} m={m} {n}x{k} {cfg}: {type(e).__name__}: {str(e)[:160]}", flush=True)
            continue
        rows.append({"family": family, "m": m, "n": n, "k": k, "cfg": cfg.to_dict() if cfg else None,
                     "us": sec * 1e6, "bytes": per, "gbs": per / sec / 1e9, "util": per / sec / copy_bw,
                     "rel_err": err, "ok": err < (6e-2 if family == "fp8_mid" else 2e-2)})
    copies.clear()
    torch.cuda.empty_cache()
    return rows


def pdl_chain(layers: int, sets: int = 4) -> None:
    """The fp8 decode GEMVs of `layers` 8B layers in a chain (q/k/v -> o -> gate_up with SiLU·mul -> down, each
    taking the previous output), captured in one CUDA graph, with the table's configs: plain launches against
    programmatic dependent launches (1: each kernel waits for the one before it first thing; 2: and lets the next
    one launch once all its programs have started). `sets` distinct weight sets (each beyond the L2) are cycled.
    Prints µs per chain and per kernel boundary saved; the outputs must be bit-identical."""
    import torch

    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.triton_ops.pdl import AVAILABLE

    ws = [[make_weight("fp8", n, k, 100 * i + j) for j, (n, k) in enumerate(SHAPES_8B)] for i in range(sets)]
    for layer in ws:  # scales set so that each product keeps x's magnitude (no overflow or underflow in a chain)
        for f, (_n, k) in zip(layer, SHAPES_8B, strict=True):
            f["s"] = f["s"] / (0.02 * k ** 0.5)
    x0 = (torch.randn(1, SHAPES_8B[0][1], device="cuda") * 0.5).to(torch.bfloat16)

    def chain(pdl: int) -> torch.Tensor:
        x = x0
        for i in range(layers):
            qkv, o, gu, down = ws[i % sets]
            h = fp8_skinny_gemv(x, qkv["w"], qkv["s"], x.dtype, pdl_level=pdl)[:, :4096]
            a = fp8_skinny_gemv(h, o["w"], o["s"], x.dtype, pdl_level=pdl)
            g = fp8_skinny_gemv(a, gu["w"], gu["s"], x.dtype, silu_mul=True, pdl_level=pdl)
            x = fp8_skinny_gemv(g, down["w"], down["s"], x.dtype, pdl_level=pdl)
        return x

    print(f"\n## PDL chain: {layers} layers x 4 fp8 GEMVs (Triton's PDL ops: {AVAILABLE})", flush=True)
    results = {}
    for pdl in (0, 1, 2):
        try:
            out = chain(pdl)
            torch.cuda.synchronize()
            sec = time_calls(lambda i, p=pdl: chain(p), 1, replays=9)
            results[pdl] = (sec, out)
            same = "" if pdl == 0 else f"  identical to plain: {bool(torch.equal(out, results[0][1]))}"
            print(f"  pdl={pdl}: {sec * 1e6:8.1f} µs per chain{same}", flush=True)
        except Exception as e:  # noqa: BLE001
            print(f"  pdl={pdl} failed: {type(e).__name__}: {str(e)[:300]}", flush=True)
    if 0 in results:
        kernels = layers * 4
        for pdl in (1, 2):
            if pdl in results:
                saved = (results[0][0] - results[pdl][0]) * 1e6
                print(f"  pdl={pdl} saves {saved:.1f} µs per chain, {saved / kernels:.2f} µs per kernel", flush=True)


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--families", nargs="+", default=["fp8", "fp8_silu", "q4_k", "q8_0"])
    p.add_argument("--m", type=int, nargs="+", default=[1])
    p.add_argument("--shapes", default="8b", choices=sorted(SHAPE_SETS))
    p.add_argument("--baselines", action="store_true", help="also time bf16 cuBLAS and the previous fp8_gemm")
    p.add_argument("--min-mb", type=int, default=256, help="weight copies per shape: at least this many MB")
    p.add_argument("--workers", type=int, default=max(1, min(14, (os.cpu_count() or 2) - 2)))
    p.add_argument("--quick", action="store_true")
    p.add_argument("--print-all", action="store_true", help="print every working candidate, not only the best")
    p.add_argument("--warm-fp8", action="store_true", help="also compile (into Triton's cache) the fp8 decode "
                   "kernels a model's CUDA graphs use on these shapes at 1-16 rows, for the runs that follow")
    p.add_argument("--kernels", nargs="+", default=None, help="only candidates of these kernels (ew, dot, acc), plus "
                   "the configs the table holds now for the swept shapes")
    p.add_argument("--warm-only", action="store_true", help="only compile the candidates (into Triton's cache, "
                   "e.g. `--kernels picks`: the table's picks) and stop, so that the runs that follow find them")
    p.add_argument("--pdl-chain", type=int, default=0, help="after the sweep: this many 8B layers of fp8 GEMVs in "
                   "a chain, plain against programmatic dependent launches")
    p.add_argument("--out", default=None)
    p.add_argument("--json-rows", default=None)
    args = p.parse_args()

    import torch

    from radixserve.bench_one_batch import measure_copy_bandwidth

    layer_shapes, lm_head, layers = SHAPE_SETS[args.shapes]
    shapes = layer_shapes + ([lm_head] if "row16" in args.families or "int8" in args.families else [])
    copy_bw = 1.0 if args.warm_only else measure_copy_bandwidth("cuda", nbytes=1 << 30, iters=10)
    print(f"# {torch.cuda.get_device_name()}: copy bandwidth {copy_bw / 1e9:.0f} GB/s", flush=True)
    def cands(family: str, m: int) -> list[GemvConfig]:
        out = candidates(family, m, args.quick)
        if args.kernels and out:  # (none: the family does not take m rows)
            from radixserve.layers.quantization import gemv_configs

            out = [c for c in out if c.kernel in args.kernels]
            table = [gemv_configs.get_mid(m, n, k, family) if family in MID_FAMILIES
                     else gemv_configs.get(family, m, n, k) for n, k in shapes]
            out += [c for c in dict.fromkeys(table) if c is not None and c not in out]
        return out

    plan = [(f, m, c) for f in args.families for m in args.m for c in cands(f, m)]
    seen: set = set()  # an fp8_mid / mid16 config compiles the same kernel at every M
    plan = [p for p in plan if p[0] not in MID_FAMILIES or ((p[0], p[2]) not in seen and not seen.add((p[0], p[2])))]
    if args.warm_fp8:
        plan = [("fp8_warm", 1, GemvConfig("ew", n, k, variant="pdl" if args.pdl_chain else "")) for n, k in shapes] \
            + plan
    try:
        precompile(plan, args.workers)
    except Exception as e:  # noqa: BLE001 - the sweep still runs, compiling as it goes
        print(f"# precompile failed ({type(e).__name__}: {e}); compiling in the sweep", flush=True)
    if args.warm_only:
        return
    picks: dict[str, dict] = {}
    all_rows: list[dict] = []
    for family in args.families:
        for m in args.m:
            cfgs = cands(family, m)
            if not cfgs:
                continue
            step_best = step_base = 0.0
            print(f"\n## {family} M={m}: {len(cfgs)} configs", flush=True)
            print(f"{'N x K':>12} {'best config':<44} {'us':>7} {'GB/s':>6} {'util':>6} {'2nd us':>7} "
                  f"{'bf16 us':>8} {'old us':>7}")
            for n, k in shapes:
                if family.endswith("_silu") and (n, k) != shapes[2]:
                    continue  # the gate_up shape only
                if ((n, k) == lm_head) != (family == "int8") and family != "row16":
                    continue  # the LM head: 16-bit (row16) or int8 rows (int8), the only shape of "int8"
                t = time.time()
                rows = sweep_shape(family, m, n, k, cfgs, copy_bw, args.min_mb << 20)
                for r in rows:
                    if not r["ok"]:
                        print(f"  wrong result (rel err {r['rel_err']:.2e}): {family} m={m} {n}x{k} {r['cfg']}",
                              flush=True)
                rows = [r for r in rows if r["ok"]]
                base = old = None
                if args.baselines:
                    b = sweep_shape("cublas_silu" if family.endswith("_silu") else "cublas", m, n, k, [None],
                                    copy_bw, args.min_mb << 20)
                    base = b[0] if b else None
                    if family == "fp8":
                        o = sweep_shape("fp8_gemm", m, n, k, [None], copy_bw, args.min_mb << 20)
                        old = o[0] if o else None
                    all_rows += ([base] if base else []) + ([old] if old else [])
                all_rows += rows
                if not rows:
                    print(f"{n:>6}x{k:<5} no working config", flush=True)
                    continue
                rows.sort(key=lambda r: r["us"])
                if args.print_all:  # every working candidate, fastest first
                    for r in rows:
                        c = r["cfg"]
                        print(f"    {n}x{k} {c['kernel']:<9} bn={c['block_n']:<3} bk={c['block_k']:<5} "
                              f"bm={c.get('block_m', 16):<3} sk={c.get('split_k', 1)} "
                              f"w={c['num_warps']} s={c['num_stages']} {c['variant'] or '-':<5} {r['us']:7.1f} us "
                              f"{r['util']:6.1%} err {r['rel_err']:.1e}", flush=True)
                best = rows[0]
                # the one-row 16-bit GEMV replaces cuBLAS only where it wins by 2% or more (no entry: cuBLAS keeps
                # it); mid16 likewise, with a "cublas" entry where it does not (its entries hold for the rows up to
                # the swept M, so a swept M that cuBLAS wins needs saying)
                if family in ("mid16", "mid16_silu"):
                    cublas = [r for r in rows if r["cfg"]["kernel"] == "cublas"]
                    win = best["cfg"]["kernel"] == "tn" and (not cublas or best["us"] < 0.98 * cublas[0]["us"])
                    picks[f"{family}/{m}/{n}/{k}"] = best["cfg"] if win else GemvConfig("cublas", 0, 0).to_dict()
                elif family not in ("row16", "row16_silu") or (base is not None and best["us"] < 0.98 * base["us"]):
                    picks[f"fp8_mid/{m}/{n}/{k}" if family == "fp8_mid" else key(family, m, n, k)] = best["cfg"]
                per_step = 1 / layers if (n, k) == lm_head else 1  # the LM head runs once a step
                step_best += best["us"] * per_step
                step_base += base["us"] * per_step if base else 0.0
                c = best["cfg"]
                desc = f"{c['kernel']} bn={c['block_n']} bk={c['block_k']} w={c['num_warps']} s={c['num_stages']}" \
                       f"{' ' + c['variant'] if c['variant'] else ''}" \
                       f"{' bm=' + str(c['block_m']) if family in MID_FAMILIES else ''}"\
                       f"{' sk=' + str(c['split_k']) if family.startswith('mid16') else ''}"
                if family == "fp8_mid":  # the default path's time (per-token quant + torch._scaled_mm)
                    sm = [r for r in rows if r["cfg"]["kernel"] == "scaled_mm"]
                    old = {"us": sm[0]["us"]} if sm else None
                second = f"{rows[1]['us']:7.1f}" if len(rows) > 1 else "      -"
                print(f"{n:>6}x{k:<5} {desc:<44} {best['us']:7.1f} {best['gbs']:6.0f} {best['util']:6.1%} {second} "
                      f"{base['us'] if base else float('nan'):8.1f} {old['us'] if old else float('nan'):7.1f}"
                      f"  ({time.time() - t:.1f} s)", flush=True)
            base_txt = f" (bf16 cuBLAS {step_base * layers / 1e3:.3f} ms)" if step_base else ""
            print(f"{family} M={m}: the linears of a layer x {layers} layers (+ the LM head) = "
                  f"{step_best * layers / 1e3:.3f} ms{base_txt}", flush=True)
            result = {"device": torch.cuda.get_device_name(), "copy_bw_gbs": copy_bw / 1e9, "configs": picks}
            if args.out:  # after every family and M: a sweep cut short still leaves its picks so far
                with open(args.out, "w") as f:
                    json.dump(result, f, indent=1)
    result = {"device": torch.cuda.get_device_name(), "copy_bw_gbs": copy_bw / 1e9, "configs": picks}
    if args.json_rows:
        with open(args.json_rows, "w") as f:
            json.dump(all_rows, f)
    print("\n# picks\n" + json.dumps(result))
    if args.pdl_chain:
        pdl_chain(args.pdl_chain)


if __name__ == "__main__":
    main()
