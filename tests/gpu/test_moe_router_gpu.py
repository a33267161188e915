"""On CUDA, at the served models' shapes: the tensor-core router (`gate_gemm.py`) against the float32 linear layer
and `select_experts`, the top-k sum against torch's, and a bf16 MoE layer's output with the new router and sum
equal to the float32-router path's. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


@pytest.mark.parametrize("experts,k,sigmoid", [(64, 6, False), (128, 8, False), (256, 8, True)])
@pytest.mark.parametrize("tokens", [2, 512, 4096])
def test_gate_kernel_at_served_shapes(experts: int, k: int, sigmoid: bool, tokens: int) -> None:
    from radixserve.layers.moe.gate_gemm import gate_logits, gate_topk_blocks
    from radixserve.layers.moe.router import RouterConfig, select_experts

    g = torch.Generator(device="cuda").manual_seed(experts + tokens)
    x = torch.randn(tokens, 2048, device="cuda", generator=g).bfloat16()
    w = (torch.randn(experts, 2048, device="cuda", generator=g) * 0.02).bfloat16()
    bias = torch.randn(experts, device="cuda", generator=g) * 0.1 if sigmoid else None
    want = F.linear(x.float(), w.float())
    torch.testing.assert_close(gate_logits(x, w), want, atol=2e-5, rtol=2e-5)
    cfg = RouterConfig(experts, k, "sigmoid" if sigmoid else "softmax", sigmoid, routed_scaling_factor=2.0)
    ref_w, ref_ids = select_experts(want, cfg, bias)
    got_w, got_ids = gate_topk_blocks(x, w, k, sigmoid, sigmoid, 2.0, bias)
    same = (got_ids.long().sort(dim=1).values == ref_ids.long().sort(dim=1).values).all(dim=1)
    assert same.float().mean() > 0.995  # only near-ties (sums in another order) may pick differently
    torch.testing.assert_close(got_w.sort(dim=1).values[same], ref_w.sort(dim=1).values[same], atol=1e-5,
                               rtol=1e-5)


@pytest.mark.parametrize("tokens,k", [(512, 6), (256, 8), (16384, 6)])
def test_moe_sum_at_served_shapes(tokens: int, k: int) -> None:
    from radixserve.layers.moe.fused_moe import moe_sum

    rows = torch.randn(tokens * k, 2048, device="cuda").bfloat16()
    want = rows.view(tokens, k, 2048).sum(dim=1)
    got = moe_sum(rows, tokens, k)
    torch.testing.assert_close(got.float(), want.float(), atol=1e-2, rtol=1e-2)
    assert (got == want).float().mean() > 0.99  # one float32 sum rounded once, as torch's


def test_bf16_deepseek_moe_layer_same_with_the_tensor_core_router() -> None:
    """A DeepSeek-V2-Lite-shaped MoE block in bf16 at 512 tokens: the half-precision router equals the float32
    one's output (routing decisions the same but for near-ties)."""
    from types import SimpleNamespace

    from radixserve.model_loader.dummy import initialize_dummy_weights
    from radixserve.models.deepseek_v2 import DeepseekMoE

    cfg = SimpleNamespace(hidden_size=2048, n_routed_experts=64, num_experts_per_tok=6, topk_method="greedy",
                          norm_topk_prob=False, n_group=1, topk_group=1, routed_scaling_factor=1.0,
                          moe_intermediate_size=1408, n_shared_experts=2)
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        with torch.device("cuda"):
            block = DeepseekMoE(cfg, 0, 1, v3=False)
    finally:
        torch.set_default_dtype(old)
    initialize_dummy_weights(block)
    block.gate.after_weights_loaded()
    assert block.gate.weight_half is not None
    x = torch.randn(512, 2048, device="cuda").bfloat16()
    with torch.no_grad():
        fast = block(x)
        half, block.gate.weight_half = block.gate.weight_half, None
        slow = block(x)
        block.gate.weight_half = half
    close = torch.isclose(fast.float(), slow.float(), atol=2e-2, rtol=2e-2).all(dim=1)
    assert close.float().mean() > 0.99
