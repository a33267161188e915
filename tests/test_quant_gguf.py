"""GGUF Q8_0 / Q4_K kept packed: the field layout against the `gguf` package's own (de)quantisers, the Triton
dequantise-in-kernel GEMM against the torch reference (TRITON_INTERPRET=1 on the CPU), a GGUF file loading packed
(and mixed-type stacks dequantised) with the same outputs as the dequantise-at-load model, and online
quantisation of a 16/32-bit checkpoint."""

from __future__ import annotations

import os

import numpy as np
import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import cpu_ops
from radixserve.layers.quantization import gguf_formats as G
from radixserve.layers.quantization.gguf import GGUFLinearMethod
from radixserve.layers.quantization.gguf_gemm import gguf_gemm
from radixserve.model_loader import get_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("fmt", [G.Q8_0, G.Q4_K])
def test_fields_round_trip_through_gguf_bytes(fmt: str) -> None:
    from gguf import GGMLQuantizationType, quants

    w = torch.randn(6, 512, generator=torch.Generator().manual_seed(0))
    raw = torch.from_numpy(G.quantize_to_ggml(w.numpy(), fmt))
    assert raw.shape == (6, 512 // G.BLOCK[fmt] * G.TYPE_SIZE[fmt])
    fields = G.from_ggml_bytes(fmt, raw, 6, 512)
    ref = torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType[fmt])).view(6, 512)
    assert torch.equal(G.dequantize(fmt, fields), ref)  # our reading of the bytes is llama.cpp's
    assert torch.equal(G.to_ggml_bytes(fmt, fields), raw)
    err = float((ref - w).abs().mean() / w.abs().mean())
    assert err < (0.01 if fmt == G.Q8_0 else 0.1)


@pytest.mark.parametrize("fmt", [G.Q8_0, G.Q4_K])
# Q8_0 up to DEQUANT_MIN_M (4) rows: the tiled kernel; above, and Q4_K always: dequantised once, then F.linear
@pytest.mark.parametrize("m", [1, 3, 4, 5, 16, 70])
def test_gguf_gemm_kernel_matches_reference(fmt: str, m: int) -> None:
    g = torch.Generator().manual_seed(m)
    n, k = 40, 512 if fmt == G.Q4_K else 96
    fields = G.quantize(fmt, torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    out = gguf_gemm(x.to(DEV), fmt, {f: v.to(DEV) for f, v in fields.items()}, n, bias.to(DEV))
    ref = torch.nn.functional.linear(x, G.dequantize(fmt, fields), bias)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("fmt,n,k", [(G.Q4_K, 40, 512), (G.Q4_K, 7, 256), (G.Q8_0, 40, 96), (G.Q8_0, 19, 512)])
def test_gguf_dequantize_kernel_equals_reference(fmt: str, n: int, k: int) -> None:
    """The one-launch dequantisation (rows not a multiple of the tile, Q8_0 K both a multiple of 256 and not) is
    the reference's float32 weight exactly, and within one bf16 step in bf16."""
    from radixserve.layers.quantization.gguf_gemm import gguf_dequantize

    fields = G.quantize(fmt, torch.randn(n, k, generator=torch.Generator().manual_seed(n + k)))
    dev_fields = {f: v.to(DEV) for f, v in fields.items()}
    ref = G.dequantize(fmt, fields)
    assert torch.equal(gguf_dequantize(fmt, dev_fields, n, k, torch.float32).cpu(), ref)
    half = gguf_dequantize(fmt, dev_fields, n, k, torch.bfloat16).cpu()  # (the interpreter's bf16 cast truncates)
    assert half.dtype == torch.bfloat16
    torch.testing.assert_close(half.float(), ref, rtol=2 ** -7, atol=1e-6)
    with pytest.raises(ValueError, match="columns"):
        gguf_dequantize(fmt, dev_fields, n, k + 16, torch.float32)


SHAPE = dict(hidden_size=256, intermediate_size=512, num_attention_heads=4, num_key_value_heads=2, vocab_size=128)


def test_gguf_file_loads_packed_and_matches_dequantised(tmp_path, gguf_writer, monkeypatch) -> None:
    import gguf
    from conftest import random_llama_tensors

    T = gguf.GGMLQuantizationType
    tensors = random_llama_tensors(seed=5, **SHAPE)
    qtypes = {}
    for i in range(2):
        p = f"model.layers.{i}."
        for part in ("self_attn.q_proj", "self_attn.k_proj", "mlp.gate_proj", "mlp.up_proj"):
            qtypes[p + part + ".weight"] = T.Q4_K
        qtypes[p + "self_attn.v_proj.weight"] = T.Q4_K if i == 1 else T.Q8_0  # layer 0: a mixed q/k/v stack
        qtypes[p + "self_attn.o_proj.weight"] = T.Q8_0
        qtypes[p + "mlp.down_proj.weight"] = T.Q8_0 if i == 0 else T.Q5_0  # Q5_0: dequantised at load
    path = os.path.join(tmp_path, "m.gguf")
    gguf_writer(path, tensors, quantize=qtypes, **SHAPE)
    cfg = ModelConfig(path)
    packed = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu", quantization="gguf")
    plain = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu")  # CPU default: dequantise
    layers = packed.model.layers
    kinds = {name: getattr(m.quant_method, "fmt", None) for name, m in packed.named_modules()
             if hasattr(m, "quant_method")}
    assert kinds["model.layers.0.self_attn.qkv_proj"] is None and kinds["model.layers.1.self_attn.qkv_proj"] == "Q4_K"
    assert kinds["model.layers.0.mlp.gate_up_proj"] == "Q4_K" and kinds["model.layers.0.self_attn.o_proj"] == "Q8_0"
    assert kinds["model.layers.1.mlp.down_proj"] is None
    qkv = layers[1].self_attn.qkv_proj
    assert qkv.qweight.dtype == torch.uint8 and qkv.qweight.shape == (256 + 2 * 128, 128)
    # the packed weights (q/k rows un-permuted like the float ones) dequantise to what the plain loader made
    for name, module in packed.named_modules():
        if isinstance(getattr(module, "quant_method", None), GGUFLinearMethod):
            ref = dict(plain.named_modules())[name].weight
            assert torch.equal(G.dequantize(module.quant_method.fmt, module.quant_method.fields(module)), ref), name
    ids = torch.tensor([5, 17, 99, 3, 42, 7])
    x = packed.model.embed_tokens(ids)
    # the same product on both sides (the float layer would otherwise take oneDNN's reordered weight at 6 rows, which
    # sums in another order than the F.linear the dequantised weight goes through)
    monkeypatch.setattr(cpu_ops, "PACKED", False)
    torch.testing.assert_close(layers[0].mlp(x), plain.model.layers[0].mlp(x))
    packed_bytes = sum(p.numel() * p.element_size() for p in qkv.parameters())
    assert packed_bytes * 8 == qkv.output_size * qkv.input_size * 4.625  # Q4_K as held: 4.625 bits a weight


def test_online_q4_k_and_q8_0(tmp_path) -> None:
    from model_utils import make_tiny_model

    make_tiny_model("llama", str(tmp_path), hidden_size=256, intermediate_size=512)
    cfg = ModelConfig(str(tmp_path))
    base = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu")
    x = torch.randn(3, 256, generator=torch.Generator().manual_seed(0))
    for q in ("q8_0", "q4_k"):
        m = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu", quantization=q)
        layer = m.model.layers[0].mlp.gate_up_proj
        assert layer.quant_method.fmt == q.upper() and not hasattr(layer, "weight")
        w = base.model.layers[0].mlp.gate_up_proj.weight
        fields = G.quantize(q.upper(), w)
        torch.testing.assert_close(layer(x), torch.nn.functional.linear(x, G.dequantize(q.upper(), fields)))
    with pytest.raises(ValueError, match="q4_k"):
        from radixserve.layers.quantization import resolve_quant_config

        resolve_quant_config("q4_k", {"quant_method": "fp8"})


def test_online_q4_k_takes_q8_0_for_rows_of_partial_super_blocks(tmp_path) -> None:
    """--quantization q4_k on a model whose rows are not whole 256-weight super-blocks (down_proj's 320 here, as
    SmolLM2's 576 everywhere but down_proj): those layers take Q8_0 (llama.cpp falls back to Q5_0 there), the
    others Q4_K; the model decodes as its dequantised weights do."""
    from model_utils import make_tiny_model

    make_tiny_model("llama", str(tmp_path), hidden_size=256, intermediate_size=320)
    cfg = ModelConfig(str(tmp_path))
    base = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu")
    m = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu", quantization="q4_k")
    mlp, ref = m.model.layers[0].mlp, base.model.layers[0].mlp
    assert mlp.gate_up_proj.quant_method.fmt == "Q4_K" and mlp.down_proj.quant_method.fmt == "Q8_0"
    h = torch.randn(2, 320, generator=torch.Generator().manual_seed(1))
    want = torch.nn.functional.linear(h, G.dequantize("Q8_0", G.quantize("Q8_0", ref.down_proj.weight)))
    torch.testing.assert_close(mlp.down_proj(h), want)


def test_numpy_bytes_shape() -> None:
    arr = np.random.default_rng(0).standard_normal((2, 256)).astype(np.float32)
    assert G.quantize_to_ggml(arr, G.Q4_K).shape == (2, 144)


@pytest.mark.parametrize("fmt", [G.Q8_0, G.Q4_K])
@pytest.mark.parametrize("kernel,m,block_n,block_k,variant", [
    ("ew", 1, 2, 256, ""), ("ew", 3, 2, 256, "magic"), ("ew", 1, 8, 512, "magic"), ("ew", 2, 4, 1024, ""),
    ("acc", 1, 4, 512, ""), ("acc", 2, 2, 256, "magic")])
def test_gguf_gemv_kernel_matches_reference(fmt: str, kernel: str, m: int, block_n: int, block_k: int,
                                            variant: str) -> None:
    """The decode GEMV at several tile sizes (rows not a multiple of block_n; block_k above K falls back to K)."""
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_kernels import gguf_gemv

    g = torch.Generator().manual_seed(10 + m + block_n)
    n, k = 21, 512
    fields = G.quantize(fmt, torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    out = gguf_gemv(x.to(DEV), fmt, {f: v.to(DEV) for f, v in fields.items()}, n, bias.to(DEV),
                    GemvConfig(kernel, block_n, block_k, variant=variant))
    ref = torch.nn.functional.linear(x, G.dequantize(fmt, fields), bias)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)
    assert gguf_gemv(x[:, :96].contiguous().to(DEV), fmt, fields, n) is None  # K not a multiple of 256
    assert gguf_gemv(torch.randn(5, k).to(DEV), fmt, fields, n) is None  # more rows than the GEMV takes


@pytest.mark.parametrize("fmt", [G.Q8_0, G.Q4_K])
def test_packed_fields_shard_for_tensor_parallelism(fmt: str) -> None:
    """TP=2 ranks of packed layers load their rows (q/k/v, column) or their super-block columns (row-parallel) of
    every field, and together compute what the whole layer does."""
    from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear

    g = torch.Generator().manual_seed(7)
    full_qkv = {"q": G.quantize(fmt, torch.randn(256, 512, generator=g)),
                "k": G.quantize(fmt, torch.randn(128, 512, generator=g)),
                "v": G.quantize(fmt, torch.randn(128, 512, generator=g))}
    full_down = G.quantize(fmt, torch.randn(256, 1024, generator=g))

    def build(rank: int, size: int) -> tuple:
        qkv = QKVParallelLinear(512, 64, 4, 2, False, rank, size)
        down = RowParallelLinear(1024, 256, False, rank, size)
        for layer in (qkv, down):
            layer.set_quant_method(GGUFLinearMethod(fmt, online=False))
        for sid, fields in full_qkv.items():
            for name, value in fields.items():
                getattr(qkv, name).weight_loader(getattr(qkv, name), value, sid)
        for name, value in full_down.items():
            getattr(down, name).weight_loader(getattr(down, name), value)
        return qkv, down

    whole = build(0, 1)
    ranks = [build(r, 2) for r in range(2)]
    x = torch.randn(3, 512, generator=g)
    out = whole[0](x).split([256, 128, 128], dim=1)
    parts = [r[0](x).split([128, 64, 64], dim=1) for r in ranks]
    for i in range(3):
        torch.testing.assert_close(torch.cat([p[i] for p in parts], dim=1), out[i])
    h = torch.randn(3, 1024, generator=g)
    torch.testing.assert_close(ranks[0][1](h[:, :512]) + ranks[1][1](h[:, 512:]), whole[1](h), rtol=1e-4, atol=1e-4)


def test_q6_k_writer_matches_gguf_reader() -> None:
    """Our Q6_K bytes (the `gguf` package cannot write Q6_K) read back through gguf's own dequantiser: within
    6-bit error of the weights, all-zero blocks exactly zero, and no worse than the round-to-nearest fit on a grid
    set by the largest weight (what the candidate search must beat or match)."""
    import numpy as np
    from gguf import GGMLQuantizationType, quants

    from radixserve.layers.quantization.gguf_q6_k import TYPE_SIZE, quantize_q6_k

    g = torch.Generator().manual_seed(3)
    w = torch.randn(24, 512, generator=g) * 0.05
    w[5] = 0.0
    w[6, :256] = 0.0
    raw = quantize_q6_k(w)
    assert raw.shape == (24, 2 * TYPE_SIZE) and raw.dtype == torch.uint8
    assert G.quantize_to_ggml(w.numpy(), "Q6_K").shape == (24, 2 * TYPE_SIZE)
    back = torch.from_numpy(quants.dequantize(raw.numpy(), GGMLQuantizationType.Q6_K)).reshape(24, 512)
    assert torch.equal(back[5], torch.zeros(512)) and torch.equal(back[6, :256], torch.zeros(256))
    rel = float((back - w).norm() / w.norm())
    assert rel < 0.025, rel
    x = w.view(24, 32, 16).numpy()  # the plain fit: scale = largest signed value / -32, round to nearest
    top = np.take_along_axis(x, np.abs(x).argmax(-1)[..., None], -1)
    scale = np.where(top == 0, 1.0, top / -32.0)
    plain = (np.clip(np.round(x / scale), -32, 31) * scale).reshape(24, 512)
    assert rel <= float(np.linalg.norm(plain - w.numpy()) / np.linalg.norm(w.numpy())) * 1.05


def _q8_blocks_ref(x: torch.Tensor) -> torch.Tensor:
    """x with every 32-column block rounded to int8 levels of amax / 127 (halves away from zero): what the Q4_K
    integer-MMA kernel multiplies by."""
    b = x.float().view(x.shape[0], -1, 32)
    s = b.abs().amax(dim=-1, keepdim=True).clamp(min=1e-30) / 127.0
    v = b / s
    q = torch.where(v >= 0, v + 0.5, v - 0.5).trunc()
    return (q * s).view(x.shape)


@pytest.mark.parametrize("kernel,m,block_n,block_k,variant", [
    ("mma", 1, 16, 256, ""), ("mma", 2, 32, 512, ""), ("mma", 1, 16, 1024, ""), ("mma", 2, 16, 256, "2d"),
    ("dp4a", 1, 4, 256, ""), ("dp4a", 2, 2, 512, "")])
def test_q4_k_int8_gemv_matches_reference(kernel: str, m: int, block_n: int, block_k: int, variant: str) -> None:
    """The Q4_K GEMVs with integer products (`_q4_k_gemv_mma_kernel` on the tensor cores, `_q4_k_gemv_dp4a_kernel`
    by dp4a, elementwise under the interpreter): x quantised per 32-column block to int8 in the kernel, the
    sub-blocks' scales after the integer dot. Against the dequantised weight times that x (exact integer
    products: float32 rounding only), and within the int8 error of the float x; rows not a multiple of the tile."""
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_kernels import gguf_gemv

    g = torch.Generator().manual_seed(block_k + m)
    n, k = 37, 1024
    fields = G.quantize(G.Q4_K, torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    x[0, :32] *= 1e-3  # a block of small values: its own scale
    bias = torch.randn(n, generator=g)
    out = gguf_gemv(x.to(DEV), G.Q4_K, {f: v.to(DEV) for f, v in fields.items()}, n, bias.to(DEV),
                    GemvConfig(kernel, block_n, block_k, variant=variant))
    w = G.dequantize(G.Q4_K, fields)
    ref_q = _q8_blocks_ref(x) @ w.t() + bias
    # w = d sc (q - 8) + (8 d sc - dmin m): only the first part meets x's int8 rounding, the second the float x
    exact = ref_q + (x - _q8_blocks_ref(x)).view(m, -1, 32).sum(-1) @ _offset_terms(fields).t()
    torch.testing.assert_close(out.cpu(), exact, rtol=1e-4, atol=2e-3)
    ref = torch.nn.functional.linear(x, w, bias)
    assert float((out.cpu() - ref).norm() / ref.norm()) < 1e-2


@pytest.mark.parametrize("kernel,m,block_n,block_k", [("dp4w", 1, 4, 256), ("dp4w", 2, 8, 512), ("dp4w", 1, 16, 1024),
                                                      ("dp4x", 1, 4, 256), ("dp4x", 2, 16, 512), ("dp4x", 3, 2, 256),
                                                      ("dp4x", 5, 4, 512), ("dp4x", 8, 2, 1024),
                                                      ("mma_rows", 1, 16, 256), ("mma_rows", 5, 32, 512),
                                                      ("mma_rows", 16, 16, 1024), ("dp4c", 1, 4, 2048),
                                                      ("dp4c", 3, 8, 2048), ("dp4c", 1, 1, 4096)])
def test_q4_k_word_dp4a_gemv_matches_reference(kernel: str, m: int, block_n: int, block_k: int) -> None:
    """`_q4_k_gemv_dp4w_kernel` / `_q4_k_gemv_dp4x_kernel` (q bytes read as int32 words, x quantised to int8 per
    32 columns once per program and step, or beforehand by `_q8_1_words_kernel`, and packed into words, dp4a per
    word; elementwise under the interpreter), centred after the dot product as the
    other integer kernels: against the same exact reference (float32 rounding only), and within the int8 error of
    the float x; rows not a multiple of the tile, a bias, a block of tiny values, one of negative values only. dp4x
    takes every row of x (2 to 8) in one program: batches of 3 and 5 leave rows of its tile empty; 9 rows are the
    dequantising product's. `_q4_k_gemv_mma_rows_kernel` (the same quantised x as int8 bytes, one int8 MMA per
    sub-block with a column per row of x) the same, up to 16 rows. dp4c (whole chunks a thread, x's factors per
    block) the same at one row of x a program, 37 weight rows leaving its last tile part empty."""
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.quantization.gguf_kernels import ROWS_MAX_M, gguf_gemv

    g = torch.Generator().manual_seed(block_k + m + 7)
    n, k = 37, 2048 if kernel == "dp4c" else 1024  # dp4c: K takes a block_k of 2,048 (else dp4x runs)
    fields = G.quantize(G.Q4_K, torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    x[0, :32] *= 1e-3
    x[-1, 64:96] = -x[-1, 64:96].abs()  # a block with only negative values (the packed words' sign bits)
    bias = torch.randn(n, generator=g)
    out = gguf_gemv(x.to(DEV), G.Q4_K, {f: v.to(DEV) for f, v in fields.items()}, n, bias.to(DEV),
                    GemvConfig(kernel, block_n, block_k))
    w = G.dequantize(G.Q4_K, fields)
    xq = _q8_blocks_ref(x)
    exact = xq @ w.t() + bias + (x - xq).view(m, -1, 32).sum(-1) @ _offset_terms(fields).t()
    torch.testing.assert_close(out.cpu(), exact, rtol=1e-4, atol=2e-3)
    ref = torch.nn.functional.linear(x, w, bias)
    assert float((out.cpu() - ref).norm() / ref.norm()) < 1e-2
    if kernel in ROWS_MAX_M:  # one row more than the kernel takes: the dequantising product's
        more = torch.randn(ROWS_MAX_M[kernel] + 1, k).to(DEV)
        assert gguf_gemv(more, G.Q4_K, fields, n, None, GemvConfig(kernel, block_n, block_k)) is None


@pytest.mark.parametrize("k,block_k", [(3584, 2048), (4096, 512)])
def test_q4_k_dp4c_falls_back_to_dp4x_where_k_takes_no_2048_block(monkeypatch: pytest.MonkeyPatch, k: int,
                                                                   block_k: int) -> None:
    """dp4c runs only where a step can give every lane its own chunk (block_k 2,048 or more): at K = 3,584
    (Qwen2.5-7B's hidden size), or with a config's block_k of 512, the product is dp4x's, still the exact one, and
    dp4c's x quantiser is never called."""
    from radixserve.layers.quantization import gguf_kernels
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    def _no_dp4c(x: torch.Tensor) -> None:
        raise AssertionError("dp4c ran for a K without a 2,048-column step")

    monkeypatch.setattr(gguf_kernels, "q8_1_blocks", _no_dp4c)
    g = torch.Generator().manual_seed(5)
    n = 8
    fields = G.quantize(G.Q4_K, torch.randn(n, k, generator=g))
    x = torch.randn(1, k, generator=g)
    out = gguf_kernels.gguf_gemv(x.to(DEV), G.Q4_K, {f: v.to(DEV) for f, v in fields.items()}, n, None,
                                 GemvConfig("dp4c", 1, block_k, 1))
    xq = _q8_blocks_ref(x)
    w = G.dequantize(G.Q4_K, fields)
    exact = xq @ w.t() + (x - xq).view(1, -1, 32).sum(-1) @ _offset_terms(fields).t()
    torch.testing.assert_close(out.cpu(), exact, rtol=1e-4, atol=2e-3)


def _offset_terms(fields: dict[str, torch.Tensor]) -> torch.Tensor:
    """8 d sc - dmin m per (row, 32-weight sub-block) [N, K / 32]: the part of each weight that the kernel takes
    out of its integer dot product."""
    d = fields["d"].float().repeat_interleave(8, dim=1)
    dmin = fields["dmin"].float().repeat_interleave(8, dim=1)
    return 8.0 * d * fields["scales"].float() - dmin * fields["mins"].float()
