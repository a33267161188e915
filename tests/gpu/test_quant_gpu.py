"""On CUDA: the fp8 GEMM paths (torch._scaled_mm with per-token x per-channel scales, the Triton block-scaled
kernel in W8A8 and W8A16 form), the GGUF Q8_0/Q4_K kernels at decode and prefill sizes, and the fp8 KV cache
through the Triton backend and CUDA graphs. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.quantization import fp8 as fp8mod  # noqa: E402
from radixserve.layers.quantization import gguf_formats as G  # noqa: E402
from radixserve.layers.quantization.fp8 import fp8_linear_ref, quantize_blocks, quantize_rows  # noqa: E402
from radixserve.layers.quantization.fp8_kernels import fp8_gemm, per_token_group_quant_fp8  # noqa: E402
from radixserve.layers.quantization.gguf_gemm import gguf_gemm  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_fp8_per_channel_linear_on_gpu(m: int) -> None:
    """The online fp8 layer: W8A16 Triton kernel up to SMALL_M rows, per-token quant + _scaled_mm above."""
    from radixserve.layers.linear import RowParallelLinear
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.fp8 import Fp8Config

    g = torch.Generator(device="cuda").manual_seed(m)
    with torch.device("cuda"):
        layer = RowParallelLinear(1024, 768, bias=True).to(torch.bfloat16)
    w = torch.randn(768, 1024, device="cuda", generator=g).to(torch.bfloat16) * 0.05
    layer.weight.data.copy_(w)
    layer.bias.data.copy_(torch.randn(768, device="cuda", generator=g))
    apply_quantization(layer, Fp8Config(serialized=False))
    layer.weight.data.copy_(w)
    finish_quantization(layer)
    x = torch.randn(m, 1024, device="cuda", generator=g).to(torch.bfloat16)
    out = layer(x)
    ref = fp8_linear_ref(x.float(), layer.weight, layer.weight_scale, 1, 1024, layer.bias,
                         None if m <= fp8mod.SMALL_M else 1024)
    assert out.dtype == torch.bfloat16
    assert _rel(out, ref) < 1e-2
    assert _rel(out, torch.nn.functional.linear(x, w, layer.bias)) < 5e-2


@pytest.mark.parametrize("m", [1, 16, 200])
def test_fp8_block_gemm_on_gpu(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = 640, 1024
    q, s = quantize_blocks(torch.randn(n, k, device="cuda", generator=g), 128, 128)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    xq, xs = per_token_group_quant_fp8(x, 128)
    rq, rs = fp8mod.quantize_groups_ref(x.float(), 128)
    torch.testing.assert_close(xs, rs)
    assert torch.equal(xq.view(torch.uint8), rq.view(torch.uint8))
    out = fp8_gemm(xq, q, s, 128, 128, torch.bfloat16, a_scale=xs, a_group_k=128)
    assert _rel(out, fp8_linear_ref(x.float(), q, s, 128, 128, None, 128)) < 1e-2
    out16 = fp8_gemm(x, q, s, 128, 128, torch.bfloat16)
    assert _rel(out16, fp8_linear_ref(x.float(), q, s, 128, 128, None, None)) < 1e-2
    qr, sr = quantize_rows(torch.randn(n, k, device="cuda", generator=g))
    out_row = fp8_gemm(x, qr, sr.view(-1, 1), 1, k, torch.bfloat16)
    assert _rel(out_row, fp8_linear_ref(x.float(), qr, sr, 1, k, None, None)) < 1e-2


@pytest.mark.parametrize("fmt", [G.Q8_0, G.Q4_K])
@pytest.mark.parametrize("m", [1, 16, 64, 300])  # Q8_0 at 1 row: the tiled kernel; else dequantised once + cuBLAS
def test_gguf_kernels_on_gpu(fmt: str, m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = 768, 1024
    fields = G.quantize(fmt, torch.randn(n, k, device="cuda", generator=g))
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    out = gguf_gemm(x, fmt, fields, n)
    ref = torch.nn.functional.linear(x.float(), G.dequantize(fmt, fields))
    assert _rel(out, ref) < 1e-2


def test_fp8_kv_cache_cuda_graph_equals_eager_and_stays_close(tmp_path) -> None:
    """A tiny model with fp8 weights and an fp8_e4m3 KV cache: CUDA-graph decode gives the same tokens as eager
    decode (same kernels), and the first greedy token mostly agrees with the bf16 model's."""
    from model_utils import peaky_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    peaky_tiny_model("llama", str(tmp_path))

    def runner(**kw):
        args = ServerArgs(model_path=str(tmp_path), device="cuda", dtype="bfloat16", max_total_tokens=1 << 15,
                          max_running_requests=40, cuda_graph_max_bs=40, **kw)
        return ModelRunner(ModelConfig(str(tmp_path)), args)

    g = torch.Generator().manual_seed(3)
    ps = [torch.randint(3, 2048, (int(n),), generator=g).tolist() for n in torch.randint(4, 64, (19,), generator=g)]
    graph = runner(kv_cache_dtype="fp8_e4m3", quantization="fp8")
    assert graph.token_to_kv_pool.dtype == torch.float8_e4m3fn and graph.cuda_graph_runner is not None
    eager = runner(kv_cache_dtype="fp8_e4m3", quantization="fp8", disable_cuda_graph=True)
    got = StaticBatch(graph).generate(ps, 24)
    assert got == StaticBatch(eager).generate(ps, 24)
    # free-running greedy streams diverge for good after one flip (55% of 456 tokens matched on an H200), so only
    # the first token of each prompt, which nothing before it changed, is compared
    base = StaticBatch(runner()).generate(ps, 24)
    first = sum(x[0] == y[0] for x, y in zip(got, base, strict=True))
    assert first >= 15, f"fp8 agreed with bf16 on the first token of {first} of 19 prompts"


def test_q4_k_engine_cuda_graph_equals_eager_and_stays_close(tmp_path) -> None:
    """A model 2,048 wide (so that the one-row Q4_K GEMV is dp4c: K of 2,048 and 4,096) quantised to Q4_K on load:
    CUDA-graph decode (dp4c with the norms and SiLU·mul fused into x's quantisation) gives the eager decode's
    tokens, and the first greedy token mostly agrees with bf16's. Prefill and piecewise graphs are off on both
    sides: a prompt replays the graph of its padded token bucket (57 rows run as 64), and cuBLAS's product over the
    dequantised weight sums a row differently at another row count (logits 1-2 bf16 steps apart)."""
    from model_utils import make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.quantization import gemv_configs
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    hf = make_tiny_model("llama", str(tmp_path), hidden_size=2048, intermediate_size=4096, num_attention_heads=16,
                         num_key_value_heads=4, num_hidden_layers=2, vocab_size=2048)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(30.0)  # a margin between the top tokens, as a trained model has
    hf.save_pretrained(str(tmp_path))
    assert {gemv_configs.get("q4_k", 1, n, k).kernel for n, k in ((3072, 2048), (2048, 2048), (8192, 2048),
                                                                  (2048, 4096))} == {"dp4c"}

    def runner(**kw):
        args = ServerArgs(model_path=str(tmp_path), device="cuda", dtype="bfloat16", max_total_tokens=1 << 15,
                          max_running_requests=40, cuda_graph_max_bs=40, prefill_cuda_graph_max_tokens=0,
                          piecewise_cuda_graph_max_tokens=0, **kw)
        return ModelRunner(ModelConfig(str(tmp_path)), args)

    def generate(sb: StaticBatch) -> list[list[int]]:  # one prompt at a time: one-row decode GEMVs
        return [sb.generate([p], 16)[0] for p in ps]

    g = torch.Generator().manual_seed(4)
    ps = [torch.randint(3, 2048, (int(n),), generator=g).tolist() for n in torch.randint(4, 64, (12,), generator=g)]
    got = generate(StaticBatch(runner(quantization="q4_k")))
    assert got == generate(StaticBatch(runner(quantization="q4_k", disable_cuda_graph=True)))
    base = generate(StaticBatch(runner()))
    first = sum(x[0] == y[0] for x, y in zip(got, base, strict=True))
    assert first >= 9, f"Q4_K agreed with bf16 on the first token of {first} of 12 prompts"


@pytest.mark.parametrize("k", [2048, 4096, 14336])
def test_q4_k_fused_quantisers_equal_the_unfused_kernels_on_gpu(k: int) -> None:
    """The residual add + RMSNorm and SiLU·mul fused with dp4c's x quantisation (`gguf_prologue`) give the words and
    factors of the norm / activation kernel followed by `q8_1_blocks`, bit for bit, in bf16 on the GPU."""
    from radixserve.layers.quantization.gguf_chunk_kernels import q8_1_blocks
    from radixserve.layers.quantization.gguf_prologue import q8_1_blocks_gated, q8_1_blocks_normed
    from radixserve.layers.triton_ops.activation import silu_and_mul
    from radixserve.layers.triton_ops.norm import fused_add_rmsnorm

    g = torch.Generator(device="cuda").manual_seed(k)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16() * 3
    res = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    w = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    words, f, new_res = q8_1_blocks_normed(x, res, w, 1e-5)
    normed, ref_res = fused_add_rmsnorm(x, res, w, 1e-5)
    ref_words, ref_f = q8_1_blocks(normed)
    assert torch.equal(new_res, ref_res) and torch.equal(words, ref_words) and torch.equal(f, ref_f)
    gu = torch.randn(1, 2 * k, device="cuda", generator=g).bfloat16() * 4
    words, f = q8_1_blocks_gated(gu)
    ref_words, ref_f = q8_1_blocks(silu_and_mul(gu))
    assert torch.equal(words, ref_words) and torch.equal(f, ref_f)


@pytest.mark.parametrize("level", [1, 2])
def test_programmatic_dependent_launch_gives_the_same_tokens(tmp_path, level: int) -> None:
    """Our decode kernels (RMSNorm, rotary + KV store, decode attention, the fp8 GEMVs, SiLU·mul) launched as
    programmatic dependent launches (`triton_ops.pdl`, level 1: wait first; 2: and let the next kernel launch
    early), in CUDA graphs and eagerly, give exactly the tokens of plain launches: a tiny model with fp8 weights
    and an fp8 KV cache, 19 prompts of mixed lengths, 24 greedy tokens each."""
    from model_utils import peaky_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.triton_ops import pdl
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    if torch.cuda.get_device_capability()[0] < 9 or not pdl.AVAILABLE:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and Triton's gdc ops")
    peaky_tiny_model("llama", str(tmp_path))

    def generate(lv: int, graphs: bool) -> list[list[int]]:
        default = pdl.LEVEL
        pdl.set_level(lv)
        try:
            args = ServerArgs(model_path=str(tmp_path), device="cuda", dtype="bfloat16", max_total_tokens=1 << 15,
                              max_running_requests=40, cuda_graph_max_bs=40, kv_cache_dtype="fp8_e4m3",
                              quantization="fp8", disable_cuda_graph=not graphs)
            return StaticBatch(ModelRunner(ModelConfig(str(tmp_path)), args)).generate(ps, 24)
        finally:
            pdl.set_level(default)

    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 2048, (int(n),), generator=g).tolist() for n in torch.randint(4, 64, (19,), generator=g)]
    plain = generate(0, True)
    assert generate(level, True) == plain
    assert generate(level, False) == generate(0, False)


@pytest.mark.parametrize("level", [1, 2])
def test_q4_k_gemvs_with_programmatic_dependent_launch(level: int) -> None:
    """Q4_K's x quantisation and its dp4c / dp4x (1 row), dp4x (4 rows) and mma_rows (16 rows) GEMVs launched as
    programmatic dependent launches give the plain launches' results bit for bit, eagerly and replayed from a CUDA
    graph."""
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_kernels import gguf_gemv
    from radixserve.layers.triton_ops import pdl

    if torch.cuda.get_device_capability()[0] < 9 or not pdl.AVAILABLE:
        pytest.skip("programmatic dependent launch needs compute capability 9.0 and Triton's gdc ops")
    g = torch.Generator(device="cuda").manual_seed(level)
    n, k = 4096, 4096
    fields = G.quantize(G.Q4_K, torch.randn(n, k, device="cuda", generator=g) * 0.02)
    for m, cfg in ((1, GemvConfig("dp4c", 1, 2048, 1)), (1, GemvConfig("dp4x", 2, 1024, 2)),
                   (4, GemvConfig("dp4x", 8, 1024, 4)), (16, GemvConfig("mma_rows", 16, 512))):
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        default = pdl.LEVEL
        try:
            pdl.set_level(0)
            plain = gguf_gemv(x, G.Q4_K, fields, n, None, cfg)
            pdl.set_level(level)
            eager = gguf_gemv(x, G.Q4_K, fields, n, None, cfg)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph):
                captured = gguf_gemv(x, G.Q4_K, fields, n, None, cfg)
            graph.replay()
        finally:
            pdl.set_level(default)
        torch.cuda.synchronize()
        assert torch.equal(eager, plain) and torch.equal(captured, plain), (m, cfg)


@pytest.mark.parametrize("m", [1, 2, 3, 8, 16])
def test_fp8_skinny_gemv_on_gpu(m: int) -> None:
    """The decode GEMV kernels of `fp8_gemv` with the tuned table's configs (and each kernel explicitly) on an 8B
    shape and on rows that are not a multiple of any tile, bf16 in and out, against the float32 reference."""
    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in [(4096, 14336), (1000, 4096)]:
        q, s = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        ref = fp8_linear_ref(x.float(), q, s, 1, k, bias.float(), None)
        cfgs = [None, GemvConfig("dot", 32, 256, 4, 3)] + ([GemvConfig("ew", 4, 1024, 4, 2, "f16")] if m <= 2 else [])
        for cfg in cfgs:
            out = fp8_skinny_gemv(x, q, s, torch.bfloat16, bias, cfg)
            assert out.dtype == torch.bfloat16 and out.shape == (m, n)
            assert _rel(out, ref) < 1e-2, (n, k, cfg)
            act = fp8_skinny_gemv(x, q, s, torch.bfloat16, bias, cfg, silu_mul=True)  # [gate; up] -> silu * up
            gate, up = ref.chunk(2, dim=-1)
            assert act.shape == (m, n // 2) and _rel(act, torch.nn.functional.silu(gate) * up) < 2e-2, (n, k, cfg)


@pytest.mark.parametrize("m", [1, 2])
def test_fp8_skinny_gemv_block_wise_on_gpu(m: int) -> None:
    """Block-wise (128 x 128) scales in the elementwise decode GEMV at the 8B shapes' tuned tiles and two variants
    (runs of 8 with evict-first, the bit-moving widening), gate_up with SiLU·mul at one row, against the float32
    reference and against the W8A16 `fp8_gemm` the layer ran before."""
    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in [(4096, 4096), (28672, 4096), (4096, 14336), (1000, 4096)]:
        q, s = quantize_blocks(torch.randn(n, k, device="cuda", generator=g) * 0.02, 128, 128)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = fp8_linear_ref(x.float(), q, s, 128, 128, None, None)
        before = fp8_gemm(x, q, s, 128, 128, torch.bfloat16)
        for cfg in (None, GemvConfig("ew", 4, 1024, 4, 2, "ef+r8"), GemvConfig("ew", 8, 512, 4, 3, "f16")):
            out = fp8_skinny_gemv(x, q, s, torch.bfloat16, None, cfg, block=(128, 128))
            assert out is not None and out.shape == (m, n)
            assert _rel(out, ref) < 1e-2 and _rel(out, before) < 1e-2, (n, k, cfg)
            if m == 1 and n % 256 == 0:
                act = fp8_skinny_gemv(x, q, s, torch.bfloat16, None, cfg, silu_mul=True, block=(128, 128))
                gate, up = ref.chunk(2, dim=-1)
                assert _rel(act, torch.nn.functional.silu(gate) * up) < 2e-2, (n, k, cfg)


@pytest.mark.parametrize("fmt", [G.Q8_0, G.Q4_K])
@pytest.mark.parametrize("m", [1, 3, 6, 8, 9, 16])
def test_gguf_gemv_on_gpu(fmt: str, m: int) -> None:
    """The decode GEMVs against the dequantised weight: Q8_0 up to 4 rows; Q4_K's table / default picks up to 8
    rows (more: None, the dequantising product's), and each Q4_K kernel at every batch it takes (dp4x up to 8 rows,
    mma_rows up to 16, the others, dp4c among them, up to 4)."""
    from radixserve.layers.quantization import gemv_configs
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_kernels import GEMV_MAX_M, ROWS_MAX_M, gguf_gemv

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in [(4096, 14336), (1000, 4096)]:
        fields = G.quantize(fmt, torch.randn(n, k, device="cuda", generator=g) * 0.02)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        ref = torch.nn.functional.linear(x.float(), G.dequantize(fmt, fields))
        out = gguf_gemv(x, fmt, fields, n)
        picked = gemv_configs.get("q4_k", m, n, k).kernel if fmt == G.Q4_K else None
        if m > ROWS_MAX_M.get(picked, GEMV_MAX_M):
            assert out is None
        else:
            assert _rel(out, ref) < 1e-2, (n, k)
        if fmt == G.Q4_K:  # the integer kernels, whatever the table picks
            cfgs = [GemvConfig("mma_rows", 16, 512), GemvConfig("mma_rows", 64, 256),
                    GemvConfig("mma_rows", 32, 512, 8, 3)]
            if m <= ROWS_MAX_M["dp4x"]:
                cfgs += [GemvConfig("dp4x", 8, 512), GemvConfig("dp4x", 2, 1024, 2), GemvConfig("dp4x", 2, 512, 4)]
            if m <= GEMV_MAX_M:
                cfgs += [GemvConfig("mma", 16, 512), GemvConfig("mma", 64, 256, 8), GemvConfig("dp4a", 4, 512),
                         GemvConfig("dp4w", 16, 512), GemvConfig("dp4w", 4, 1024), GemvConfig("dp4w", 64, 256, 8),
                         GemvConfig("dp4c", 1, 2048, 1), GemvConfig("dp4c", 8, 2048, 1), GemvConfig("dp4c", 4, 4096, 2),
                         GemvConfig("dp4c", 1, 512, 1), GemvConfig("dp4c", 2, 2048, 4)]
            # (the last two: dp4x runs for a block_k under 2,048, dp4c with one warp for 4 warps of 32 chunks)
            for cfg in cfgs:
                assert _rel(gguf_gemv(x, fmt, fields, n, None, cfg), ref) < 1e-2, (n, k, cfg)


@pytest.mark.parametrize("m", [17, 64, 160])
def test_fp8_mid_kernels_on_gpu(m: int) -> None:
    """The transposed W8A8 / W8A16 products of `fp8_mid` (and cuBLASLt's, transposed or tensor-wise with the scales
    after it) on 8B shapes and on rows that
    are not a multiple of any tile, bf16 in and out, against the float32 reference (W8A8 with the activation
    quantisation in it)."""
    from radixserve.layers.quantization.fp8_mid import fp8_mid_mm
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator(device="cuda").manual_seed(m)
    for n, k in [(4096, 14336), (1000, 4096)]:
        q, s = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
        x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
        bias = torch.randn(n, device="cuda", generator=g).to(torch.bfloat16)
        for cfg in (GemvConfig("w8a8", 64, 256, 4, 3, block_m=64), GemvConfig("w8a16", 64, 128, 4, 3, block_m=32),
                    GemvConfig("scaled_mm_t", 0, 0), GemvConfig("scaled_mm_unit", 0, 0)):
            if cfg.kernel.startswith("scaled_mm") and n % 16:
                assert fp8_mid_mm(x, q, s, torch.bfloat16, cfg, bias) is None  # cuBLASLt's alignment
                continue
            out = fp8_mid_mm(x, q, s, torch.bfloat16, cfg, bias)
            ref = fp8_linear_ref(x.float(), q, s, 1, k, bias.float(), None if cfg.kernel == "w8a16" else k)
            assert out.shape == (m, n) and _rel(out, ref) < 1e-2, (n, k, cfg)


@pytest.mark.parametrize("strategy,acts", [("channel", "dynamic"), ("channel", "none"), ("block", "none")])
@pytest.mark.parametrize("m", [1, 7, 64, 300])
def test_fp8_checkpoint_schemes_on_gpu(strategy: str, acts: str, m: int) -> None:
    """compressed-tensors' serialized schemes on the GPU kernels: per-channel [N, 1] scales with dynamic
    activations (W8A8 above SMALL_M rows), and weight-only (16-bit activations at every batch size: the product is
    the dequantised weight's, to bf16 rounding)."""
    from radixserve.layers.linear import MergedColumnParallelLinear
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.fp8 import Fp8Config

    g = torch.Generator(device="cuda").manual_seed(m)
    with torch.device("cuda"):
        layer = MergedColumnParallelLinear(1024, [512, 512]).to(torch.bfloat16)
    block = [128, 128] if strategy == "block" else None
    cfg = Fp8Config(serialized=True, activation_scheme=acts, weight_block_size=block, weight_strategy=strategy,
                    block_scale_name="weight_scale")
    apply_quantization(layer, cfg)
    scales = []
    for sid in range(2):
        w = torch.randn(512, 1024, device="cuda", generator=g) * 0.05
        q, s = quantize_blocks(w, 128, 128) if block else quantize_rows(w)
        layer.weight.weight_loader(layer.weight, q, sid)
        layer.weight_scale.weight_loader(layer.weight_scale, s if block else s[:, None], sid)
        scales.append(s)
    finish_quantization(layer)
    x = torch.randn(m, 1024, device="cuda", generator=g).to(torch.bfloat16)
    bn, bk = (128, 128) if block else (1, 1024)
    a8 = acts == "dynamic" and m > fp8mod.SMALL_M
    ref = fp8_linear_ref(x, layer.weight, layer.weight_scale, bn, bk, None, bk if a8 else None)
    assert _rel(layer(x), ref) < 0.01


@pytest.mark.parametrize("bits", [4, 8])
@pytest.mark.parametrize("m", [1, 4, 8])
@pytest.mark.parametrize("n,k,group", [(4096, 4096, 128), (6144, 4096, 128), (4096, 14336, 128), (1024, 4096, -1)])
def test_int4_kernels_on_gpu(m: int, n: int, k: int, group: int, bits: int) -> None:
    """The 4/8-bit GEMV (up to 8 rows) and the dequantising copy (bf16, as the hardware rounds) against the torch
    reference at the 8B's shapes."""
    from radixserve.layers.quantization import int4_formats as F4
    from radixserve.layers.quantization.int4_kernels import int4_dequantize, int4_gemv

    g = torch.Generator(device="cuda").manual_seed(m + n)
    groups = 1 if group == -1 else k // group
    top = 1 << bits
    q = torch.randint(0, top, (n, k), device="cuda", generator=g, dtype=torch.uint8)
    qweight = F4.to_layout(q, bits)
    zeros = torch.randint(0, top, (n, groups), device="cuda", generator=g, dtype=torch.uint8)
    scales = (torch.rand(n, groups, device="cuda", generator=g) * 0.16 / top).half()
    w = F4.dequantize(qweight, scales, zeros, bits).to(torch.bfloat16)
    assert torch.equal(int4_dequantize(qweight, scales, zeros, k, torch.bfloat16, bits), w)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    ref = (x.float() @ w.float().t()).to(torch.bfloat16)
    assert _rel(int4_gemv(x, qweight, scales, zeros, None, bits), ref) < 1e-2
