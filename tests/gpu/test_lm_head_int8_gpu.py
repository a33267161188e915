"""On CUDA: --quantize-lm-head. The int8 head's product (the decode GEMV up to 16 rows, the W8A16 Triton GEMM
above) against the dequantised reference; a model's decode graphs write its logits into the shared rows and give
the eager forward's tokens. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.quantization.lm_head_int8 import int8_head_logits, quantize_rows_int8  # noqa: E402


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


@pytest.mark.parametrize("m", [1, 2, 8, 16, 64, 300])
def test_int8_head_product_on_gpu(m: int) -> None:
    g = torch.Generator(device="cuda").manual_seed(m)
    n, k = 32000, 4096  # (a Llama-2-sized vocabulary; the 8B's 128,256 rows take the same kernels)
    q, s = quantize_rows_int8(torch.randn(n, k, device="cuda", generator=g) * 0.02)
    x = torch.randn(m, k, device="cuda", generator=g).to(torch.bfloat16)
    want = x.float() @ (q.float() * s[:, None]).t()
    shared = torch.full((512, n), float("nan"), device="cuda")
    got = int8_head_logits(x, q, s, out=shared[:m])
    assert got.dtype == torch.float32 and _rel(got, want) < 1e-4
    if m <= 16:  # the GEMV writes into the given rows
        assert got.data_ptr() == shared.data_ptr() and torch.isnan(shared[m:]).all()


def test_int8_head_decode_graphs_equal_eager(tmp_path) -> None:
    """A tiny model with fp8 weights and an int8 head: CUDA-graph decode (the shared logits rows) gives eager
    decode's tokens, and the first greedy token mostly agrees with the 16-bit head's."""
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
    assert graph.model.lm_head.weight.dtype == torch.int8 and graph.cuda_graph_runner is not None
    eager = runner(quantize_lm_head=True, disable_cuda_graph=True)
    for group in (ps[:1], ps[:3], ps):  # one row, a few (the GEMV), 19 (the GEMM)
        got = StaticBatch(graph).generate(group, 16)
        assert got == StaticBatch(eager).generate(group, 16)
    base = StaticBatch(runner()).generate(ps, 16)
    first = sum(x[0] == y[0] for x, y in zip(got, base, strict=True))
    assert first >= 15, f"the int8 head agreed with the 16-bit head on the first token of {first} of 19 prompts"
