"""--quantize-lm-head: the LM head's fp8 rows and their product (`layers/quantization/fp8_lm_head.py`). The kernels
run under TRITON_INTERPRET=1 on the CPU (`set_fused_kernels(True)`); the embedded model's quality with the fp8 head
is in test_quant_quality.py."""

from __future__ import annotations

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers import triton_ops
from radixserve.layers.quantization.fp8 import FP8, quantize_rows
from radixserve.layers.quantization.fp8_lm_head import fp8_head_logits
from radixserve.model_loader import get_model


@pytest.fixture
def fused_on_cpu():  # noqa: ANN201
    triton_ops.set_fused_kernels(True)
    yield
    triton_ops.set_fused_kernels(None)


def _head(n: int = 70, k: int = 64, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    return q, s, torch.randn(20, k, generator=g)


def test_reference_is_the_dequantised_product() -> None:
    q, s, x = _head()
    want = x.double() @ (q.double() * s.double()[:, None]).t()
    got = fp8_head_logits(x, q, s)  # (the CPU, kernels off: the reference)
    assert got.dtype == torch.float32 and got.shape == (20, 70)
    torch.testing.assert_close(got.double(), want, rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="does not match the head"):
        fp8_head_logits(x[:, :32], q, s)


@pytest.mark.parametrize("m", [1, 2, 5, 16])
def test_decode_rows_take_the_gemv_and_write_into_out(m: int, fused_on_cpu: None) -> None:
    """Up to 16 rows: the fp8 GEMV, W8A16, float32 straight into `out` (a view of wider shared rows)."""
    q, s, x = _head(seed=m)
    shared = torch.full((32, 70), -7.0)
    got = fp8_head_logits(x[:m], q, s, out=shared[:m])
    assert got.data_ptr() == shared.data_ptr() and got.shape == (m, 70)
    torch.testing.assert_close(got, x[:m] @ (q.float() * s[:, None]).t(), rtol=1e-4, atol=1e-4)
    assert (shared[m:] == -7.0).all()  # rows past the batch untouched
    with pytest.raises(ValueError, match="out must be"):
        fp8_head_logits(x[:m], q, s, out=torch.empty(m, 70, dtype=torch.bfloat16))


def test_larger_batches_quantise_the_rows(fused_on_cpu: None) -> None:
    """Above 16 rows: per-token fp8 activations (the quantisation kernel, tested against its reference in
    test_quant_fp8.py) times the fp8 head (W8A8); the CPU takes the Triton GEMM (cuBLAS's `_scaled_mm` is the
    GPU's)."""
    from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

    q, s, x = _head(seed=3)
    xq, xs = per_token_group_quant_fp8(x, x.shape[1])
    want = (xq.float() * xs) @ (q.float() * s[:, None]).t()
    got = fp8_head_logits(x, q, s, out=torch.empty(20, 70))  # (out is for the GEMV only)
    torch.testing.assert_close(got.float(), want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])  # (untied, tied)
def test_model_head_quantized_tied_or_not(tmp_path, kind: str) -> None:  # noqa: ANN001
    """The loader's `quantize_lm_head`: the head's rows in fp8 with one scale each; a tied head gets its own
    module (the embedding keeps its float32 rows); the logits move only by the head's rounding."""
    from model_utils import make_tiny_model

    path = str(tmp_path)
    make_tiny_model(kind, path)
    cfg = ModelConfig(path)
    assert (kind == "qwen2") == cfg.hf_config.tie_word_embeddings
    plain = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu", quantization="fp8")
    model = get_model(cfg, load_format="auto", dtype=torch.float32, device="cpu", quantization="fp8",
                      quantize_lm_head=True)
    head, embed = model.lm_head, model.model.embed_tokens
    assert head.weight.dtype == FP8 and head.weight_scale.shape == (head.weight.shape[0],)
    assert head is not embed and embed.weight.dtype == torch.float32
    torch.testing.assert_close(embed.weight, plain.model.embed_tokens.weight, rtol=0, atol=0)
    w = plain.lm_head.weight
    torch.testing.assert_close(head.weight.float() * head.weight_scale[:, None], w, rtol=0.07, atol=1e-6)
    hidden = torch.randn(3, w.shape[1], generator=torch.Generator().manual_seed(1))
    logits = model.logits_processor._logits(hidden, head)
    want = plain.logits_processor._logits(hidden, plain.lm_head)
    err = (logits - want).abs().max() / want.abs().max()
    assert logits.dtype == torch.float32 and 0 < err < 0.05


def test_needs_fp8_weights(tmp_path) -> None:  # noqa: ANN001
    from model_utils import make_tiny_model

    from radixserve.server_args import ServerArgs

    make_tiny_model("llama", str(tmp_path))
    with pytest.raises(ValueError, match="needs fp8 weights"):
        get_model(ModelConfig(str(tmp_path)), load_format="auto", dtype=torch.float32, device="cpu",
                  quantize_lm_head=True)
    with pytest.raises(ValueError, match="needs fp8 weights; got --quantization q8_0"):
        ServerArgs(model_path=str(tmp_path), quantization="q8_0", quantize_lm_head=True)
