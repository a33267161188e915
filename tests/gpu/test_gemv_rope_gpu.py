"""On CUDA: the fused q/k/v + rotary + KV store (`triton_ops/gemv_rope.py`) at the 8B shape gives what the one-row
GEMV followed by the rotary kernel gives, in the output and in a bf16 or fp8 pool (within one rounding step: its
tiles have another shape, so its float32 sums add in another order); and the batch-1 decode graphs of a tiny Qwen2
with it give the logits and the greedy tokens of the graphs without it. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.layers.quantization.gemv_configs import GemvConfig  # noqa: E402
from radixserve.layers.triton_ops import gemv_rope  # noqa: E402
from radixserve.layers.triton_ops.gemv import gemv_row  # noqa: E402
from radixserve.layers.triton_ops.rotary import KVWrite, apply_rotary_inplace  # noqa: E402


@pytest.mark.parametrize("pool_dtype,scales", [(torch.bfloat16, (1.0, 1.0)), (torch.float8_e4m3fn, (0.5, 2.0))])
@pytest.mark.parametrize("bias", [False, True])
def test_8b_shape_equals_gemv_then_rotary(pool_dtype: torch.dtype, scales: tuple[float, float], bias: bool) -> None:
    hq, hk, d, k = 32, 8, 128, 4096
    n = (hq + 2 * hk) * d
    g = torch.Generator(device="cuda").manual_seed(1)
    x = torch.randn(1, k, device="cuda", generator=g).bfloat16()
    w = (torch.randn(n, k, device="cuda", generator=g) / 16).bfloat16()
    b = torch.randn(n, device="cuda", generator=g).bfloat16() if bias else None
    ang = torch.rand(4096, d // 2, device="cuda", generator=g) * 6.0
    cos, sin = ang.cos(), ang.sin()
    pos, loc = torch.tensor([1234], device="cuda"), torch.tensor([77], device="cuda")
    kb, vb, kb_ref, vb_ref = (torch.zeros(100, hk, d, dtype=pool_dtype, device="cuda") for _ in range(4))
    cfg = gemv_rope.gemv_rope_config(w, d) or GemvConfig("ew", 2, 2048)
    out = gemv_rope.gemv_qkv_rope(x, w, b, hq, hk, d, pos, cos, sin, gemv_rope.KVDest(kb, vb, loc, *scales), cfg)
    ref = gemv_row(x, w, b)
    q, kk, v = ref.split([hq * d, hk * d, hk * d], dim=-1)
    apply_rotary_inplace(pos, q, kk, cos, sin, d, KVWrite(kb_ref, vb_ref, loc, v, *scales))
    torch.cuda.synchronize()
    scale = ref.float().abs().max().item()
    torch.testing.assert_close(out.float(), ref.float(), rtol=0.0, atol=0.01 * scale)
    assert (out != ref).float().mean().item() < 0.05  # a few roundings apart, not another product
    for got, want, s in ((kb, kb_ref, scales[0]), (vb, vb_ref, scales[1])):
        tol = 0.01 * scale / s if pool_dtype == torch.bfloat16 else 0.13 * scale / s  # fp8: one step of 3 bits
        torch.testing.assert_close(got.float(), want.float(), rtol=0.0, atol=tol)
        assert got[77].float().abs().sum() > 0 and got[:77].float().abs().sum() == 0


def test_decode_graphs_with_and_without_the_fusion_agree(tmp_path, monkeypatch) -> None:
    import json

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.linear import QKVParallelLinear, _LinearBase
    from radixserve.layers.quantization import gemv_configs
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.models.llama import LlamaAttention
    from radixserve.server_args import ServerArgs

    model = tmp_path / "m"
    make_tiny_model("qwen2", str(model), num_hidden_layers=3, initializer_range=0.08)  # q/k/v with a bias
    args = dict(model_path=str(model), device="cuda", dtype="bfloat16", max_total_tokens=1 << 14,
                max_running_requests=4, cuda_graph_max_bs=4)

    def run(fused: bool) -> tuple[list[tuple[torch.Tensor, list[int]]], list[LlamaAttention]]:
        monkeypatch.setattr(gemv_rope, "ENABLED", fused)
        runner = ModelRunner(ModelConfig(str(model)), ServerArgs(**args))
        sb = StaticBatch(runner)
        batch, _ = sb.prefill([[5, 17, 42, 99, 3, 250, 7, 11]])
        logits = []
        for _ in range(5):
            ids = sb.decode(batch)
            logits.append((sb.last_logits.next_token_logits.float().clone(), ids))
        sb.release(batch)
        return logits, [m for m in runner.model.modules() if isinstance(m, LlamaAttention)]

    table = {}
    probe = ModelRunner(ModelConfig(str(model)), ServerArgs(**{**args, "disable_cuda_graph": True}))
    for mod in probe.model.modules():
        if isinstance(mod, _LinearBase):
            table[gemv_configs.key("row16", 1, *mod.weight.shape)] = GemvConfig("ew", 4, 64).to_dict()
        if isinstance(mod, QKVParallelLinear):
            table[gemv_configs.key("row16_rope", 1, *mod.weight.shape)] = GemvConfig("ew", 2, 64).to_dict()
    del probe
    picks = tmp_path / "picks.json"
    picks.write_text(json.dumps({"configs": table}))
    monkeypatch.setenv("RADIXSERVE_GEMV_CONFIGS", str(picks))
    gemv_configs.reload()
    try:
        want, plain_attn = run(False)
        got, fused_attn = run(True)
    finally:
        monkeypatch.delenv("RADIXSERVE_GEMV_CONFIGS")
        gemv_configs.reload()
    assert all(m.__dict__.get("_rope_cfg") is None for m in plain_attn)
    assert fused_attn and all(m.__dict__.get("_rope_cfg") is not None for m in fused_attn)
    for (w, w_ids), (o, o_ids) in zip(want, got, strict=True):
        torch.testing.assert_close(o, w, rtol=0.0, atol=0.02 * w.abs().max().item())
        assert o_ids == w_ids
