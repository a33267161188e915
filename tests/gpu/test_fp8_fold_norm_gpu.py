"""On CUDA: the RMSNorm folded into the fp8 one-row GEMV's launch (`fp8_gemv.NormIn`) at the 8B shapes with the
table's tiles gives the norm kernel's residual sum bit for bit and the product within the bf16 rounding the fold
skips; an online-fp8 tiny Llama in float32 decodes the same tokens, with logits equal to float32 rounding, with and
without the fold (batch-1 decode graphs). Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.layers.quantization.fp8 import quantize_rows  # noqa: E402
from radixserve.layers.quantization.fp8_gemv import NormIn, fp8_skinny_gemv  # noqa: E402
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm  # noqa: E402


@pytest.mark.parametrize("n,silu_mul", [(28672, True), (4096, False), (6144, False)])
def test_8b_folded_norm_against_the_norm_kernel(n: int, silu_mul: bool) -> None:
    k = 4096
    g = torch.Generator(device="cuda").manual_seed(n)
    q, s = quantize_rows(torch.randn(n, k, device="cuda", generator=g) / 16)
    x = (torch.randn(1, k, device="cuda", generator=g) * 4).bfloat16()
    res = (torch.randn(1, k, device="cuda", generator=g) * 4).bfloat16()
    w = (1 + 0.2 * torch.randn(k, device="cuda", generator=g)).bfloat16()
    normed, ref_res = fused_add_rmsnorm(x, res, w, 1e-5)
    ref = fp8_skinny_gemv(normed, q, s, torch.float32, silu_mul=silu_mul)
    h_out = torch.empty_like(x)
    got = fp8_skinny_gemv(x, q, s, torch.float32, silu_mul=silu_mul, norm=NormIn(res, w, 1e-5, h_out))
    assert got is not None  # the table's tile for the shape is the elementwise kernel's
    torch.cuda.synchronize()
    assert torch.equal(h_out, ref_res)
    h = ref_res.float()
    ideal_x = h * torch.rsqrt(h.pow(2).mean() + 1e-5) * w.float()
    ideal = fp8_skinny_gemv(ideal_x, q, s, torch.float32, silu_mul=silu_mul)  # the norm without its roundings
    torch.testing.assert_close(got, ideal, rtol=1e-3, atol=1e-3 * ideal.abs().max().item())
    assert (got - ref).abs().max() < 0.02 * ref.abs().max()


def test_fp8_float32_decode_with_and_without_the_folded_norm(tmp_path, monkeypatch) -> None:
    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.quantization import fp8
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    model = tmp_path / "m"
    make_tiny_model("llama", str(model), num_hidden_layers=3, hidden_size=512, intermediate_size=1024,
                    num_attention_heads=8, num_key_value_heads=4, initializer_range=0.08)
    args = dict(model_path=str(model), device="cuda", dtype="float32", max_total_tokens=1 << 14,
                max_running_requests=4, cuda_graph_max_bs=4, quantization="fp8")
    folded: list[bool] = []
    real = fp8.Fp8LinearMethod.apply_normed

    def counted(*a, **kw):
        out = real(*a, **kw)
        folded.append(out is not None)
        return out

    monkeypatch.setattr(fp8.Fp8LinearMethod, "apply_normed", counted)

    def run() -> list[tuple[torch.Tensor, list[int]]]:
        runner = ModelRunner(ModelConfig(str(model)), ServerArgs(**args))
        sb = StaticBatch(runner)
        batch, _ = sb.prefill([[5, 17, 42, 99, 3, 250, 7, 11]])
        steps = []
        for _ in range(6):
            ids = sb.decode(batch)
            steps.append((sb.last_logits.next_token_logits.float().clone(), ids))
        sb.release(batch)
        return steps

    fused = run()
    assert folded.count(True) >= 6  # q/k/v and gate/up of 3 layers, captured into the batch-1 graph
    monkeypatch.setattr(fp8, "FOLD_NORM", False)
    plain = run()
    for (lf, tf), (lp, tp) in zip(fused, plain, strict=True):
        assert tf == tp
        torch.testing.assert_close(lf, lp, rtol=1e-4, atol=1e-4 * lp.abs().max().item())
