"""The router against transformers' routers, and the fused MoE Triton kernel (run by Triton's interpreter on the
CPU) against the per-expert torch reference: uneven loads, an expert with no tokens, top-k 1/2/8, experts held by
another rank (expert parallelism)."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.moe.fused_moe import MoEConfig, fused_moe, moe_align_block_size
from radixserve.layers.moe.moe_torch import moe_forward_torch


def _weights(e: int, h: int, i: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    return torch.randn(e, 2 * i, h, generator=g) * 0.2, torch.randn(e, h, i, generator=g) * 0.2


def _skewed_ids(t: int, k: int, e: int, seed: int = 0) -> torch.Tensor:
    """Top-k ids (distinct per token) where expert 0 is chosen by every token and expert e-1 by none."""
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e - 2, generator=g)[:k - 1] + 1 for _ in range(t)]) if k > 1 \
        else torch.empty(t, 0, dtype=torch.int64)
    return torch.cat([torch.zeros(t, 1, dtype=torch.int64), ids], dim=1).to(torch.int32)


@pytest.mark.parametrize("top_k,tokens", [(1, 5), (2, 19), (8, 6)])
def test_fused_moe_matches_reference(top_k: int, tokens: int) -> None:
    e, h, i = 10, 32, 24
    w13, w2 = _weights(e, h, i)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1))
    ids = _skewed_ids(tokens, top_k, e)
    assert not (ids == e - 1).any()  # an expert with no tokens
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(2))
    ref = moe_forward_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)
    # a larger row block: several experts' rows padded inside one block size, the heavy expert over several blocks
    cfg = MoEConfig(block_m=32, block_n_gate_up=16, block_n_down=32, block_k=16, num_warps=1, num_stages=1)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=cfg), ref, atol=1e-5, rtol=1e-5)


def test_fused_moe_with_experts_held_elsewhere() -> None:
    """Expert parallelism: this rank holds experts 4..7 of 8; the others contribute nothing here, and the two
    ranks' outputs add up to the whole."""
    e, h, i, t, k = 8, 32, 16, 9, 2
    w13, w2 = _weights(e, h, i, seed=3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4))
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(s))[:k] for s in range(t)])
    ids = ids.to(torch.int32)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(5))
    halves = [fused_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, ids, expert_offset=4 * r,
                        num_global_experts=e) for r in range(2)]
    torch.testing.assert_close(halves[1], moe_forward_torch(x, w13[4:], w2[4:], weights, ids, expert_offset=4),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(halves[0] + halves[1], moe_forward_torch(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


def test_align_buckets_every_assignment_once() -> None:
    ids = _skewed_ids(13, 3, 7)
    a = moe_align_block_size(ids, 4, 7)
    total = int(a.total)
    rows = a.sorted_ids[:total].tolist()
    assert sorted(r for r in rows if r < ids.numel()) == list(range(ids.numel()))
    flat = ids.flatten().tolist()
    for b in range(total // 4):  # every real row of a block belongs to the block's expert
        for r in rows[4 * b:4 * b + 4]:
            if r < ids.numel():
                assert flat[r] == int(a.expert_ids[b])
    counts = torch.bincount(ids.flatten().long(), minlength=7)
    assert total == int(((counts + 3) // 4 * 4).sum())


def test_router_matches_transformers_grouped_topk_with_correction_bias() -> None:
    """DeepSeek-V3's router (sigmoid, e_score_correction_bias, groups ranked by their two best, renormalised and
    scaled) and DeepSeek-V2's group-limited greedy, against transformers' router modules."""
    import transformers as tf
    from transformers.models.deepseek_v2.modeling_deepseek_v2 import DeepseekV2TopkRouter
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3TopkRouter

    from radixserve.layers.moe.router import RouterConfig, select_experts

    torch.manual_seed(0)
    x = torch.randn(33, 16)
    cfg3 = tf.DeepseekV3Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=4,
                               n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5)
    hf3 = DeepseekV3TopkRouter(cfg3)
    with torch.no_grad():
        hf3.weight.normal_()
        hf3.e_score_correction_bias.normal_(0, 0.5)
    _, w_ref, ids_ref = hf3(x)
    w, ids = select_experts(torch.nn.functional.linear(x, hf3.weight),
                            RouterConfig(16, 4, "sigmoid", True, 4, 2, "top2_sum", 2.5), hf3.e_score_correction_bias)
    _same_choice(w, ids, w_ref, ids_ref)

    cfg2 = tf.DeepseekV2Config(hidden_size=16, num_attention_heads=4, n_routed_experts=16, num_experts_per_tok=3,
                               n_group=4, topk_group=2, topk_method="group_limited_greedy", routed_scaling_factor=16.0)
    hf2 = DeepseekV2TopkRouter(cfg2)
    with torch.no_grad():
        hf2.weight.normal_()
    _, w_ref, ids_ref = hf2(x)
    w, ids = select_experts(torch.nn.functional.linear(x, hf2.weight),
                            RouterConfig(16, 3, "softmax", False, 4, 2, "max", 16.0))
    _same_choice(w, ids, w_ref, ids_ref)


def _same_choice(w: torch.Tensor, ids: torch.Tensor, w_ref: torch.Tensor, ids_ref: torch.Tensor) -> None:
    order, order_ref = ids.long().sort(dim=1), ids_ref.long().sort(dim=1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.float().gather(1, order_ref.indices))
