"""--quantize-lm-head: the LM head's int8 rows and their product (`layers/quantization/lm_head_int8.py`). The
kernels run under TRITON_INTERPRET=1 on the CPU (`set_fused_kernels(True)`); the embedded model's quality with the
int8 head is in test_quant_quality.py."""

from __future__ import annotations

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import triton_ops
from radixserve.layers.quantization.lm_head_int8 import int8_head_logits, quantize_rows_int8
from radixserve.model_loader import get_model


@pytest.fixture
def fused_on_cpu():  # noqa: ANN201
    triton_ops.set_fused_kernels(True)
    yield
    triton_ops.set_fused_kernels(None)


def _head(n: int = 70, k: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_rows_int8(torch.randn(n, k, generator=g))
    return q, s, torch.randn(20, k, generator=g)


def _dequantised(q: torch.Tensor, s: torch.Tensor) -> torch.Tensor:
    return q.float() * s[:, None]


def test_rows_round_to_the_nearest_of_255_levels() -> None:
    w = torch.tensor([[0.0, 1.0, -2.54, 2.54], [3.0, 0.0, 0.0, 0.0], [0.0, 0.0, 0.0, 0.0]])
    q, s = quantize_rows_int8(w)
    assert q.dtype == torch.int8 and s.dtype == torch.float32
    assert q.tolist() == [[0, 50, -127, 127], [127, 0, 0, 0], [0, 0, 0, 0]]
    torch.testing.assert_close(s[:2], torch.tensor([2.54 / 127, 3.0 / 127]))
    assert (_dequantised(q, s) - w).abs().max() <= s.max() / 2


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_cpu_product_is_the_dequantised_product(dtype: torch.dtype) -> None:
    """On the CPU (kernels off): torch's int8 weight-only product, float32 logits; in bf16 within its rounding (the
    scales and the sums in bf16)."""
    q, s, x = _head()
    got = int8_head_logits(x.to(dtype), q, s)
    assert got.dtype == torch.float32 and got.shape == (20, 70)
    want = x.to(dtype).double() @ _dequantised(q, s).double().t()
    tol = 1e-5 if dtype == torch.float32 else 2e-2 * float(want.abs().max())
    torch.testing.assert_close(got.double(), want, rtol=1e-5 if dtype == torch.float32 else 0, atol=tol)
    with pytest.raises(ValueError, match="does not match the head"):
        int8_head_logits(x[:, :32], q, s)
    with pytest.raises(ValueError, match="does not match the head"):
        int8_head_logits(x, q.float(), s)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_decode_rows_take_the_gemv_and_write_into_out(m: int, fused_on_cpu: None) -> None:
    """Up to 16 rows: the decode GEMV, float32 straight into `out` (a view of wider shared rows)."""
    q, s, x = _head(seed=m)
    shared = torch.full((32, 70), -7.0)
    got = int8_head_logits(x[:m], q, s, out=shared[:m])
    assert got.data_ptr() == shared.data_ptr() and got.shape == (m, 70)
    torch.testing.assert_close(got, x[:m] @ _dequantised(q, s).t(), rtol=1e-4, atol=1e-4)
    assert (shared[m:] == -7.0).all()  # rows past the batch untouched
    with pytest.raises(ValueError, match="out must be"):
        int8_head_logits(x[:m], q, s, out=torch.empty(m, 70, dtype=torch.bfloat16))


def test_gemv_ignores_the_fp8_bit_widening_for_int8() -> None:
    """A table pick with "f16" (fp8 bytes widened by moving bits) would misread int8 bytes: int8 converts."""
    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    q, s, x = _head(seed=9)
    got = fp8_skinny_gemv(x[:1], q, s, torch.float32, config=GemvConfig("ew", 2, 64, variant="f16+r8"))
    torch.testing.assert_close(got, x[:1] @ _dequantised(q, s).t(), rtol=1e-4, atol=1e-4)


def test_larger_batches_take_the_w8a16_gemm(fused_on_cpu: None) -> None:
    q, s, x = _head(seed=3)
    got = int8_head_logits(x, q, s, out=torch.empty(20, 70))  # (out is for the GEMV only)
    assert got.dtype == torch.float32
    torch.testing.assert_close(got, x @ _dequantised(q, s).t(), rtol=1e-4, atol=1e-4)


def test_a_swept_middle_tile_takes_the_mid_kernel(fused_on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """17..256 rows with an "int8_mid" entry for the shape: the W8A16 kernel of `fp8_mid` on the int8 rows."""
    from radixserve.layers.quantization import fp8_mid, gemv_configs
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    asked, ran = [], []
    real = fp8_mid.fp8_mid_mm
    monkeypatch.setattr(gemv_configs, "get_mid", lambda m, n, k, family="fp8_mid": asked.append(
        (m, n, k, family)) or GemvConfig("w8a16", 16, 32, block_m=16))
    monkeypatch.setattr(fp8_mid, "fp8_mid_mm", lambda *a, **kw: ran.append(a[4]) or real(*a, **kw))
    q, s, x = _head(seed=4)
    got = int8_head_logits(x, q, s)
    assert asked == [(20, 70, 64, "int8_mid")] and ran == [GemvConfig("w8a16", 16, 32, block_m=16)]
    torch.testing.assert_close(got, x @ _dequantised(q, s).t(), rtol=1e-4, atol=1e-4)


def test_a_gemm_middle_entry_keeps_the_w8a16_gemm(fused_on_cpu: None, monkeypatch: pytest.MonkeyPatch) -> None:
    """An "int8_mid" entry whose kernel is "gemm" (the sweep found `fp8_gemm` fastest at that M): `fp8_mid` is not
    called and the product is the reference's."""
    from radixserve.layers.quantization import fp8_mid, gemv_configs
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    ran = []
    monkeypatch.setattr(gemv_configs, "get_mid", lambda m, n, k, family="fp8_mid": GemvConfig("gemm", 0, 0))
    monkeypatch.setattr(fp8_mid, "fp8_mid_mm", lambda *a, **kw: ran.append(a))
    q, s, x = _head(seed=5)
    got = int8_head_logits(x, q, s)
    assert ran == []
    torch.testing.assert_close(got, x @ _dequantised(q, s).t(), rtol=1e-4, atol=1e-4)


def test_the_table_routes_the_8b_head_by_rows() -> None:
    """The swept entries for Llama-3.1-8B's head (128,256 x 4,096): 2 rows on the tensor-core GEMV tile; 17..32
    rows kept on `fp8_gemm`, 33..64 and 65..256 rows on `fp8_mid`'s W8A16 tiles; none above 320 rows."""
    from radixserve.layers.quantization import gemv_configs

    assert gemv_configs.get("int8", 2, 128256, 4096).kernel == "dot"
    kinds = {m: gemv_configs.get_mid(m, 128256, 4096, "int8_mid") for m in (17, 32, 33, 64, 65, 160, 256, 320, 321)}
    assert kinds[17].kernel == kinds[32].kernel == "gemm"
    assert kinds[33].kernel == kinds[64].kernel == "w8a16" and kinds[33].block_m == 64
    assert kinds[65].kernel == kinds[256].kernel == kinds[320].kernel == "w8a16" and kinds[160].block_m == 128
    assert kinds[321] is None


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # (untied, tied)
def test_model_head_quantized_tied_or_not(tmp_path, kind: str) -> None:  # noqa: ANN001
    """The loader's `quantize_lm_head`: the head's rows in int8 with one scale each; a tied head gets its own
    module (the embedding keeps its float32 rows); the logits move only by the head's rounding."""
    from model_utils import make_tiny_model

    path = str(tmp_path)
    make_tiny_model(kind, path)
    cfg = ModelConfig(path)
    assert (kind == "qwen2") == cfg.hf_config.tie_word_embeddings
    plain = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu")
    model = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu", quantize_lm_head=True)
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight.dtype == torch.int8 and head.weight_scale.shape == (head.weight.shape[0],)
    assert head is not embed and embed.weight.dtype == torch.float32
    torch.testing.assert_close(embed.weight, plain.model.embed_tokens.weight, rtol=0, atol=0)
    w = plain.lm_head.weight
    torch.testing.assert_close(_dequantised(head.weight, head.weight_scale), w, rtol=0,
                               atol=float(head.weight_scale.max()) / 2 + 1e-7)
    hidden = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(1))
    logits = model.logits_processor._logits(hidden, head)
    want = plain.logits_processor._logits(hidden, plain.lm_head)
    err = (logits - want).abs().max() / want.abs().max()
    assert logits.dtype == torch.float32 and 0 < err < 0.02
    with pytest.raises(ValueError, match="has no LM head"):
        from radixserve.layers.quantization.lm_head_int8 import quantize_lm_head

        quantize_lm_head(torch.nn.Linear(2, 2))


def test_a_width_the_kernels_do_not_tile_takes_the_widened_product(fused_on_cpu: None) -> None:
    q, s, x = _head(k=40, seed=6)  # K = 40: not a multiple of 16
    torch.testing.assert_close(int8_head_logits(x, q, s), x @ _dequantised(q, s).t(), rtol=1e-5, atol=1e-5)
