"""On CUDA: --quantize-lm-head. The fp8 head's product (the GEMV up to 16 rows, per-token W8A8 `_scaled_mm` above)
against the dequantised reference; a model's decode graphs write its logits into the shared rows and give the
eager forward's tokens. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.quantization.fp8 import quantize_rows  # noqa: E402
from radixserve.layers.quantization.fp8_lm_head import fp8_head_logits  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("m", [1, 2, 8, 16, 64, 300])
def test_fp8_head_product_on_gpu(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = 32000, 4096  # (a Llama-2-sized vocabulary; the 8B's 128,256 rows take the same kernels)
    q, s = quantize_rows(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    want = x.float() @ (q.float() * s[:, None]).t()
    shared = torch.full((512, n), float("nan"), device="cuda")
    got = fp8_head_logits(x, q, s, out=shared[:m])
    if m <= 16:  # W8A16 into the given rows, float32 from the accumulator
        assert got.data_ptr() == shared.data_ptr() and got.dtype == torch.float32
        assert _rel(got, want) < 1e-4
        assert torch.isnan(shared[m:]).all()
    else:  # W8A8 (x's rows quantised): bf16 out, the caller widens it
        assert got.dtype == torch.bfloat16 and _rel(got, want) < 0.05


def test_fp8_head_decode_graphs_equal_eager(tmp_path) -> None:
    """A tiny model with fp8 weights and an fp8 head: CUDA-graph decode (the shared logits rows) gives eager decode's
    tokens, and the first greedy token mostly agrees with the 16-bit head's."""
    from model_utils import peaky_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    peaky_tiny_model("llama", str(tmp_path))

    def runner(**kw):
        args = ServerArgs(model_path=str(tmp_path), device="cuda", dtype="bfloat16", max_total_tokens=1 << 15,
                          max_running_requests=40, cuda_graph_max_bs=40, quantization="fp8", **kw)
        return ModelRunner(ModelConfig(str(tmp_path)), args)

    g = torch.Generator().manual_seed(5)
    ps = [torch.randint(3, 2048, (int(n),), generator=g).tolist() for n in torch.randint(4, 64, (19,), generator=g)]
    graph = runner(quantize_lm_head=True)
    assert graph.model.lm_head.weight.dtype == torch.float8_e4m3fn and graph.cuda_graph_runner is not None
    eager = runner(quantize_lm_head=True, disable_cuda_graph=True)
    for group in (ps[:1], ps[:3], ps):  # one row (the GEMV), a few, 19 (W8A8)
        got = StaticBatch(graph).generate(group, 16)
        assert got == StaticBatch(eager).generate(group, 16)
    base = StaticBatch(runner()).generate(ps, 16)
    first = sum(x[0] == y[0] for x, y in zip(got, base, strict=True))
    assert first >= 15, f"the fp8 head agreed with the 16-bit head on the first token of {first} of 19 prompts"
