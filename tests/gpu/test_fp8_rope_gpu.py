"""On CUDA, at the 8B shape with the table's tile: the fp8 one-row q/k/v GEMV with the rotation and the KV store in
its epilogue (`fp8_gemv_rope`) equals the plain GEMV followed by the rotary kernel with the KV store, bit for bit,
in the output and in a bf16 or fp8 pool; and an online-fp8 tiny Llama's batch-1 decode graphs give the same logits
and tokens with and without it. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.layers.quantization import fp8_gemv_rope  # noqa: E402
from radixserve.layers.quantization.fp8 import quantize_rows  # noqa: E402
from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv  # noqa: E402
from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs  # noqa: E402
from radixserve.layers.triton_ops.gemv_rope import KVDest  # noqa: E402
from radixserve.layers.triton_ops.rotary import KVWrite, apply_rotary_inplace  # noqa: E402


@pytest.mark.parametrize("pool_dtype,scales", [(torch.bfloat16, (1.0, 1.0)), (torch.float8_e4m3fn, (0.5, 2.0))])
@pytest.mark.parametrize("bias", [False, True])
def test_8b_qkv_equals_the_gemv_then_rotary(pool_dtype: torch.dtype, scales: tuple[float, float], bias: bool) -> None:
    hq, hk, d, k = 32, 8, 128, 4096
    n = (hq + 2 * hk) * d
    g = torch.Generator(device="cuda").manual_seed(7)
    q, s = quantize_rows(torch.randn(n, k, device="cuda", generator=g) / 16)
    x = (torch.randn(1, k, device="cuda", generator=g) * 4).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    ang = torch.rand(4096, d // 2, device="cuda", generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    pos, loc = torch.tensor([1234], device="cuda"), torch.tensor([77], device="cuda")
    kb, vb, kb_ref, vb_ref = (torch.zeros(100, hk, d, dtype=pool_dtype, device="cuda") for _ in range(4))
    out = fp8_gemv_rope.fp8_qkv_rope(x, q, s, b, RopeArgs(hq, hk, d, pos, cos, sin, KVDest(kb, vb, loc, *scales)))
    assert out is not None  # the table's tile for the shape pairs the rotary halves
    ref = fp8_skinny_gemv(x, q, s, torch.bfloat16, b)
    qq, kk, v = ref.split([hq * d, hk * d, hk * d], dim=-1)
    apply_rotary_inplace(pos, qq, kk, cos, sin, d, KVWrite(kb_ref, vb_ref, loc, v, *scales))
    torch.cuda.synchronize()
    assert torch.equal(out, ref)  # the same product, rounding and rotation
    assert torch.equal(kb.float(), kb_ref.float()) and torch.equal(vb.float(), vb_ref.float())
    assert kb[77].float().abs().sum() > 0 and kb[:77].float().abs().sum() == 0


def test_fp8_decode_graphs_with_and_without_the_fused_rotation_agree(tmp_path, monkeypatch) -> None:
    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    model = tmp_path / "m"
    make_tiny_model("llama", str(model), num_hidden_layers=3, hidden_size=512, intermediate_size=1024,
                    num_attention_heads=8, num_key_value_heads=4, initializer_range=0.08)
    args = dict(model_path=str(model), device="cuda", dtype="bfloat16", max_total_tokens=1 << 14,
                max_running_requests=4, cuda_graph_max_bs=4, quantization="fp8")
    calls: list[bool] = []
    real = fp8_gemv_rope.fp8_qkv_rope

    def counted(*a):
        out = real(*a)
        calls.append(out is not None)
        return out

    monkeypatch.setattr(fp8_gemv_rope, "fp8_qkv_rope", counted)

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
    assert calls and all(calls)  # captured into the batch-1 graph
    from radixserve.layers.quantization.fp8 import Fp8LinearMethod

    monkeypatch.setattr(Fp8LinearMethod, "apply_rope", lambda *a: None)
    plain = run()
    for (lf, tf), (lp, tp) in zip(fused, plain, strict=True):
        assert tf == tp
        torch.testing.assert_close(lf, lp, rtol=0, atol=0)
