"""Our Triton kernels compiled for an H100/H200 (sm_90) on a machine without a GPU (`kernel_compile_cases.py`, in a
process without TRITON_INTERPRET): the decode GEMVs in chosen variants, and every variant tiny models launch.
Triton's compiler and the `ptxas` its wheel carries find what the interpreter the other tests run under does not,
e.g. a `return` inside a `tl.constexpr` branch followed by a second `return` (the compiler goes on to the second).
Skipped where the Triton install cannot compile for CUDA."""

from __future__ import annotations

import inspect
import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch

_TYPES = {torch.float32: "fp32", torch.bfloat16: "bf16", torch.float16: "fp16", torch.int64: "i64",
          torch.int32: "i32", torch.int16: "i16", torch.int8: "i8", torch.uint8: "u8", torch.bool: "i1",
          torch.float8_e4m3fn: "fp8e4nv", torch.float8_e5m2: "fp8e5"}


def _compile_report(*extra: str) -> dict[str, Any]:
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    script = Path(__file__).with_name("kernel_compile_cases.py")
    proc = subprocess.run([sys.executable, str(script), *extra], env=env, capture_output=True, text=True, timeout=900)
    assert proc.returncode == 0, proc.stderr[-3000:]
    report = json.loads(proc.stdout.strip().splitlines()[-1])
    if report["probe"] is not None:
        pytest.skip(f"Triton cannot compile for sm_90 here: {report['probe']}")
    failed = {name: err for name, err in report["results"].items() if err is not None}
    assert not failed, "\n\n".join(f"{name}: {err}" for name, err in failed.items())
    return report


def test_decode_gemv_kernels_compile_for_sm90() -> None:
    assert len(_compile_report()["results"]) == 13


def test_default_tiles_fit_sm90_shared_memory() -> None:
    """The MLA kernels' GPU tiles in float32 and bfloat16 (the expanded prefill's at DeepSeek's and GLM-4.7-Flash's
    head sizes), the grouped GEMMs' and the MHA attention kernels' largest tiles in float32 (a float32 model on a
    GPU takes the same kernels), the tensor-core router and the top-k sum (which bf16 models alone launch), fp8
    experts' kernels (W8A8 grouped GEMMs at their tuned tiles, the small-batch kernels in their three fp8 forms),
    the small-batch kernels for bf16 GPT-OSS experts (biases, clamped SwiGLU) and the gate/up kernels for
    Nemotron 3's non-gated relu2 experts: a tile past 227 KB of shared memory fails only at launch, on the GPU."""
    assert len(_compile_report("--tiles")["results"]) == 34


def launch_specs(records: list) -> list[dict[str, Any]]:
    """The distinct (kernel, argument types, constexpr values) of launches recorded under the interpreter
    (`launch.recording`), as `kernel_compile_cases.py --specs` reads them; launch options are left out, and PDL /
    ASM take the values a GPU launch gives them (level 1; the inline-asm paths)."""
    specs: dict[str, dict[str, Any]] = {}
    for rec in records:
        fn = rec.fn.fn  # the Python function under the interpreter's wrapper
        params = list(inspect.signature(fn).parameters.values())
        given = dict(zip([p.name for p in params], rec.args, strict=False))
        given.update({k: v for k, v in rec.kwargs.items() if k in {p.name for p in params}})
        sig: dict[str, str] = {}
        const: dict[str, Any] = {}
        for p in params:
            value = given.get(p.name, p.default)
            if "constexpr" in str(p.annotation) or value is None:
                if value is not None and not isinstance(value, (bool, int, float, str)):
                    raise TypeError(f"{fn.__name__}: constexpr {p.name} = {value!r} has no JSON form")
                const[p.name] = value
            elif isinstance(value, torch.Tensor):
                sig[p.name] = "*" + _TYPES[value.dtype]
            elif isinstance(value, bool):
                sig[p.name] = "i1"
            elif isinstance(value, int):
                sig[p.name] = "i32" if -(1 << 31) <= value < 1 << 31 else "i64"
            elif isinstance(value, float):
                sig[p.name] = "fp32"
            else:
                raise TypeError(f"{fn.__name__}: argument {p.name} of type {type(value).__name__}")
        for name, gpu_value in (("PDL", 1), ("ASM", True)):  # what a launch on the GPU sets (PDL level 1, asm)
            if name in const:
                const[name] = gpu_value
        spec = {"module": fn.__module__, "name": fn.__name__, "signature": sig, "constexprs": const}
        specs[json.dumps(spec, sort_keys=True)] = spec
        if fn.__name__ in LEVEL2_SAMPLE and "PDL" in const:  # (the batch-1 decode graph's level)
            spec2 = {**spec, "constexprs": {**const, "PDL": 2}}
            specs[json.dumps(spec2, sort_keys=True)] = spec2
    return list(specs.values())


# kernels also compiled at PDL level 2 (a batch-1 decode graph is captured at it): its prologue differs from level
# 1's by one instruction, the same in every kernel, so a sample of the decode step's kinds stands for the rest
LEVEL2_SAMPLE = {"_rmsnorm_kernel", "_gemv_row_kernel", "_fp8_gemv_ew_kernel", "_decode_stage1_kernel",
                 "_mla_decode_stage1_kernel", "_small_gate_up_kernel", "_small_down_kernel", "_gate_topk_kernel"}


def test_models_launches_compile_for_sm90(tmp_path, monkeypatch) -> None:
    """Every kernel (and constexpr variant) that tiny models' prefill and decode launch on the Triton attention
    backend and the fused-kernel path — a Llama unquantized, online fp8 and Q4_K; DeepSeek-V2 (MLA), Qwen2-MoE and
    Qwen3-MoE — recorded under the interpreter and compiled for sm_90."""
    from model_utils import make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import gemv_configs
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.layers.triton_ops.launch import recording

    real_get = gemv_configs.get

    def few_programs(fam: str, m: int, n: int, k: int, cuda: bool = True) -> GemvConfig:
        if fam in ("fp8", "fp8_silu", "q4_k") and m <= 2:  # the GPU's kind of tile: few programs to interpret
            return GemvConfig("ew", 16, 256, variant="ef+r8" if fam != "q4_k" else "")
        return real_get(fam, m, n, k, cuda)

    monkeypatch.setattr(gemv_configs, "get", few_programs)
    if os.environ.get("TRITON_INTERPRET") != "1":  # with CUDA the kernels run (and compile) for real elsewhere
        pytest.skip("records launches under the interpreter")
    runs = [("llama", None), ("llama", "fp8"), ("llama", "q4_k"), ("deepseek_v2", None), ("qwen2_moe", None),
            ("qwen3_moe", None)]
    prompts = [[5, 17, 42, 99, 7, 3, 11], [(7 * i) % 250 + 1 for i in range(12)]]  # up to 8 rows and more
    set_fused_kernels(True)
    try:
        with recording() as records:
            for kind, quant in runs:
                path = str(tmp_path / kind)
                if kind == "llama":
                    make_tiny_model("llama", path, hidden_size=256, intermediate_size=256, num_attention_heads=8,
                                    num_key_value_heads=4, num_hidden_layers=1, vocab_size=512)
                elif quant is None:
                    make_tiny_model(kind, path)
                runner = make_runner(path, dtype_override="bfloat16", attention_backend="triton", quantization=quant)
                StaticBatch(runner).generate(prompts, 3)  # a batch of two
                StaticBatch(runner).generate(prompts[:1], 3)  # and one row
    finally:
        set_fused_kernels(None)
    with recording() as direct:
        _gpu_only_products()
    specs = launch_specs(records + direct)
    names = {s["name"] for s in specs}
    assert {s["name"] for s in specs if s["constexprs"].get("PDL") == 2} == LEVEL2_SAMPLE
    assert {"_rmsnorm_kernel", "_fp8_gemv_ew_kernel", "_fp8_gemv_rope_kernel", "_mla_decode_stage1_kernel",
            "_extend_kernel", "_decode_stage1_kernel", "_gemv_row_kernel", "_gemv_rope_kernel", "_mid_kernel",
            "_fp8_mid_kernel", "_q4_k_dp4c_rope_kernel", "_q8_1_normed_blocks_kernel", "_mla_expanded_kernel",
            "_mla_rows_kernel", "_align_count_kernel", "_align_scatter_kernel", "_int4_gemv_kernel",
            "_int4_dequant_kernel", "_delta_rule_decode_kernel", "_ssd_decode_kernel",
            "_ssd_scan_kernel", "_delta_chunks_kernel"} <= names, names
    (tmp_path / "specs.json").write_text(json.dumps(specs))
    report = _compile_report("--specs", str(tmp_path / "specs.json"))
    assert len(report["results"]) == len(specs)


def _gpu_only_products() -> None:
    """The products the layers take only on CUDA (the one-row 16-bit GEMVs, the 17..256-row kernels, Q4_K's dp4c
    at K = 2,048), called directly on small CPU tensors; and the MoE align's parallel path (batches of more than
    `SMALL_ALIGN` assignments), which the tiny models' batches do not reach; the 4- and 8-bit GEMV and dequantising
    copy in bf16 (GPTQ / AWQ / compressed-tensors); the hybrid models' decode steps."""
    from radixserve.layers.moe import fused_moe
    from radixserve.layers.quantization import gguf_formats as G
    from radixserve.layers.quantization.fp8 import quantize_rows
    from radixserve.layers.quantization.fp8_mid import fp8_mid_mm
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_chunk_kernels import q8_1_blocks
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs, dp4c_qkv_rope
    from radixserve.layers.quantization.gguf_kernels import dp4c_gemv
    from radixserve.layers.quantization.gguf_prologue import q8_1_blocks_gated, q8_1_blocks_normed
    from radixserve.layers.triton_ops.gemm_mid import mid_mm
    from radixserve.layers.triton_ops.gemv import gemv_row, gemv_row_norm
    from radixserve.layers.triton_ops.gemv_rope import KVDest, gemv_qkv_rope

    g = torch.Generator().manual_seed(0)
    bf = torch.bfloat16
    x, w = torch.randn(1, 256, generator=g).to(bf), torch.randn(128, 256, generator=g).to(bf)
    tiles = GemvConfig("ew", 16, 256)
    gemv_row(x, w, config=tiles)
    gemv_row(x, w, config=tiles, silu_mul=True)
    gemv_row_norm(x, w, None, w[:32], (x.clone(), torch.ones(256, dtype=bf), 1e-6), tiles)
    cos, sin = torch.ones(8, 8), torch.zeros(8, 8)
    kv = KVDest(torch.zeros(4, 2, 16, dtype=bf), torch.zeros(4, 2, 16, dtype=bf), torch.tensor([1]))
    gemv_qkv_rope(x, w, None, 4, 2, 16, torch.tensor([3]), cos, sin, kv, GemvConfig("ew", 8, 256))
    mid_mm(torch.randn(24, 256, generator=g).to(bf), w, None, GemvConfig("tn", 64, 64, block_m=32))
    q, sc = quantize_rows(w.float())
    fp8_mid_mm(torch.randn(24, 256, generator=g).to(bf), q, sc, bf, GemvConfig("w8a8", 64, 128, block_m=32))
    fp8_mid_mm(torch.randn(24, 256, generator=g).to(bf), q, sc, bf, GemvConfig("w8a16", 64, 128, block_m=32))
    k = 2048
    fields = G.quantize(G.Q4_K, torch.randn(128, k, generator=g) * 0.05)
    xk = torch.randn(1, k, generator=g)
    xw, f, _ = q8_1_blocks_normed(xk, xk.clone(), torch.ones(k), 1e-6)
    q8_1_blocks_gated(torch.randn(1, 2 * k, generator=g))
    q8_1_blocks(xk)
    dp4c = GemvConfig("dp4c", 32, 2048, 1)
    dp4c_gemv(xw, f, fields, 128, None, dp4c, torch.empty(1, 128))
    kv32 = KVDest(torch.zeros(4, 1, 32), torch.zeros(4, 1, 32), torch.tensor([1]))
    rope = RopeArgs(2, 1, 32, torch.tensor([3]), torch.ones(8, 16), torch.zeros(8, 16), kv32)  # 16 rows a run
    dp4c_qkv_rope(xw, f, fields, 128, None, dp4c, rope, torch.empty(1, 128))
    ids = torch.randint(0, 128, (fused_moe.SMALL_ALIGN // 8 + 1, 8), generator=g, dtype=torch.int32)
    fused_moe.moe_align_block_size(ids, 64, 128)
    from radixserve.layers.quantization.int4 import quantize_groups
    from radixserve.layers.quantization.int4_kernels import int4_dequantize, int4_gemv

    for bits in (4, 8):  # 4- and 8-bit GPTQ / AWQ / W4A16 / W8A16 layers
        qw, s4, z4 = quantize_groups(w.float(), 128, False, bits)
        int4_gemv(torch.randn(2, 256, generator=g).to(bf), qw, s4, z4, torch.zeros(128, dtype=bf), bits)
        int4_dequantize(qw, s4, z4, 256, bf, bits)
    # the hybrid models' decode steps: the gated delta rule (Qwen3-Next / Qwen3.5) and the Mamba2 scan
    from radixserve.layers.triton_ops.delta_rule import delta_rule_decode
    from radixserve.layers.triton_ops.ssd_decode import ssd_decode

    delta_rule_decode(torch.randn(3, 4, 16, 24), torch.tensor([0, 2]), torch.randn(2, 2 * 2 * 16 + 4 * 24).to(bf),
                      -torch.rand(2, 4), torch.rand(2, 4), 2, 16, 24)
    ssd_decode(torch.randn(3, 4, 24, 16), torch.tensor([0, 2]), torch.randn(2, 4 * 24 + 2 * 2 * 16),
               torch.rand(2, 4), -torch.rand(4), torch.randn(4), 2)
    from radixserve.layers.triton_ops.ssd_scan import ssd_scan

    # Mamba2's prefill scan at Nemotron-H's head (64 x 128): the products as recorded here are IEEE (CPU tensors) and
    # TF32; a float32 model on CUDA takes TF32x3 (compiled and run on an H100, 2026-12-06)
    for exact in (True, False):
        ssd_scan(torch.randn(1, 2, 64, 128), torch.randn(1, 8, 2, 64), torch.rand(1, 8, 2), -torch.rand(2),
                 torch.randn(1, 8, 1, 128), torch.randn(1, 8, 1, 128), torch.tensor([8]), exact=exact)
    from radixserve.layers.triton_ops.delta_chunks import delta_chunks

    h, n, c, d = 1, 1, 64, 128  # the delta rule's chunk loop at Qwen3.5's head (128 x 128), 64-token chunks
    delta_chunks(torch.randn(h, d, d), torch.randn(h, n, c, d), torch.randn(h, n, c, d), torch.randn(h, n, c, d),
                 torch.randn(h, n, c, c), torch.randn(h, n, c, d), torch.rand(h, n))

