"""The router against transformers' routers, and the fused MoE Triton kernel (run by Triton's interpreter on the
CPU) against the per-expert torch reference, its grid in either order: uneven loads, an expert with no tokens, top-k
1/2/8, experts held by another rank (expert parallelism)."""

from __future__ import annotations

import pytest
import torch
from moe_utils import DEVICE, expert_weights, skewed_ids

from radixserve.layers.moe.activation import RELU2
from radixserve.layers.moe.fused_moe import MoEConfig, fused_moe, moe_align_block_size
from radixserve.layers.moe.moe_torch import moe_forward_torch


@pytest.mark.parametrize("top_k,tokens,one_program", [(1, 5, True), (2, 19, False), (8, 6, True)])
def test_fused_moe_matches_reference(top_k: int, tokens: int, one_program: bool,
                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.layers.moe import fused_moe as fm

    monkeypatch.setattr(fm, "SMALL_ALIGN", 1024 if one_program else 0)
    e, h, i = 10, 32, 24
    w13, w2 = expert_weights(e, h, i)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids = skewed_ids(tokens, top_k, e).to(DEVICE)
    assert not (ids == e - 1).any()  # an expert with no tokens
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    ref = moe_forward_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)
    # a larger row block: several experts' rows padded inside one block size, the heavy expert over several blocks
    cfg = MoEConfig(block_m=32, block_n_gate_up=16, block_n_down=32, block_k=16, num_warps=1, num_stages=1)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=cfg), ref, atol=1e-5, rtol=1e-5)
    # the grid in either order (row blocks first; or column blocks first, as launched past MAX_GRID_Y row blocks)
    for n_first in (False, True):
        cfg = MoEConfig(16, 8, 16, 16, 1, 1, n_first=n_first)
        torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=cfg), ref, atol=1e-5, rtol=1e-5)
    monkeypatch.setattr(fm, "MAX_GRID_Y", 1)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=MoEConfig(16, 8, 16, 16, 1, 1)), ref,
                               atol=1e-5, rtol=1e-5)


def test_fused_moe_with_experts_held_elsewhere() -> None:
    """Expert parallelism: this rank holds experts 4..7 of 8; the others contribute nothing here, and the two
    ranks' outputs add up to the whole."""
    e, h, i, t, k = 8, 32, 16, 9, 2
    w13, w2 = expert_weights(e, h, i, seed=3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(s))[:k] for s in range(t)])
    ids = ids.to(DEVICE, torch.int32)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    halves = [fused_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, ids, expert_offset=4 * r,
                        num_global_experts=e) for r in range(2)]
    torch.testing.assert_close(halves[1], moe_forward_torch(x, w13[4:], w2[4:], weights, ids, expert_offset=4),
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(halves[0] + halves[1], moe_forward_torch(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("one_program", [True, False])
def test_align_buckets_every_assignment_once(one_program: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Both align paths: the one-program one (decode sizes) and the parallel one (prefill sizes; several programs
    count, the last lays out the buckets, several scatter and share out the blocks' experts and the padding), twice
    in a row (the parallel path's counts and ticket are zero again after each call), and with the experts of another
    rank left out."""
    from radixserve.layers.moe import fused_moe as fm
    from radixserve.layers.triton_ops import device_buffers

    monkeypatch.setattr(fm, "SMALL_ALIGN", 1024 if one_program else 0)
    monkeypatch.setattr(fm, "ALIGN_CHUNK", 8)
    monkeypatch.setattr(fm, "ALIGN_SCATTER_CHUNK", 8)
    for seed, (num_local, offset) in enumerate([(7, 0), (7, 0), (4, 3)]):
        ids = skewed_ids(13, 3, 7, seed=seed).to(DEVICE)
        a = moe_align_block_size(ids, 4, num_local, offset)
        n = ids.numel()
        flat = ids.flatten().tolist()
        held = [i for i, e in enumerate(flat) if offset <= e < offset + num_local]
        total = int(a.total)
        rows = a.sorted_ids[:total].tolist()
        assert sorted(r for r in rows if r != n) == held  # each held assignment once, the others left out
        for b in range(total // 4):  # every real row of a block belongs to the block's expert
            for r in rows[4 * b:4 * b + 4]:
                if r != n:
                    assert flat[r] - offset == int(a.expert_ids[b])
        counts = torch.tensor([flat.count(offset + e) for e in range(num_local)])
        assert total == int(((counts + 3) // 4 * 4).sum())
        if not one_program:
            state = device_buffers._KEPT[(f"moe align state {1 << num_local.bit_length()}", ids.device)]  # used
            assert not state.any()


def test_parallel_align_compiles_one_variant_a_block_size() -> None:
    """The parallel align's launches take the same constexprs at every batch size (assignments past SMALL_ALIGN) for
    a given block size, so no batch seen first while serving compiles a variant of its own."""
    from radixserve.layers.moe import fused_moe as fm
    from radixserve.layers.triton_ops.launch import recording

    g = torch.Generator().manual_seed(0)
    with recording() as records:
        for n in (fm.SMALL_ALIGN + 1, 2048, 3000, 20000):
            ids = torch.randint(0, 128, (n,), generator=g, dtype=torch.int32).to(DEVICE)
            moe_align_block_size(ids, 64, 128)
    variants = {(r.fn.fn.__name__, tuple(sorted(r.kwargs.items()))) for r in records}
    assert len(variants) == 2, variants  # the count and the scatter, one variant each


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


def test_tp_and_ep_shards_add_up_to_the_whole_layer() -> None:
    """Dummy weights are the same model at every TP/EP size, and the ranks' partial outputs (before the all-reduce)
    sum to the unsharded layer's: TP=2 splits each expert's intermediate dim, EP=2 splits the experts."""
    from radixserve.layers.moe import FusedMoE, RouterConfig
    from radixserve.model_loader.dummy import initialize_dummy_weights

    router = RouterConfig(8, 2, renormalize=True)

    def build(rank: int, tp: int, ep: int) -> FusedMoE:
        holder = torch.nn.Module()
        holder.experts = FusedMoE(router, 16, 8, rank, tp, ep_size=ep, reduce_results=False)
        initialize_dummy_weights(holder, seed=3)
        return holder.experts

    full = build(0, 1, 1)
    x = torch.randn(11, 16, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(11, 8, generator=torch.Generator().manual_seed(1)) * 3
    ref = full(x, logits)
    for ep in (1, 2):
        parts = [build(r, 2, ep) for r in range(2)]
        if ep == 2:
            assert torch.equal(parts[1].w13_weight, full.w13_weight[4:])
        else:
            assert torch.equal(parts[1].w13_weight[:, :4], full.w13_weight[:, 4:8])
            assert torch.equal(parts[1].w2_weight, full.w2_weight[:, :, 4:])
        torch.testing.assert_close(sum(p(x, logits) for p in parts), ref, atol=1e-6, rtol=1e-5)


@pytest.mark.parametrize("scoring,renorm,bias,k", [("softmax", True, False, 2), ("softmax", False, False, 8),
                                                    ("sigmoid", True, True, 3)])
def test_fused_topk_kernel_matches_the_torch_router(scoring: str, renorm: bool, bias: bool, k: int) -> None:
    """The one-launch router (CUDA's path for ungrouped routers) against select_experts' torch code."""
    from radixserve.layers.moe.router import RouterConfig, select_experts
    from radixserve.layers.moe.topk_kernel import fused_topk

    g = torch.Generator().manual_seed(k)
    logits = (torch.randn(9, 20, generator=g) * 2).to(DEVICE)
    correction = (torch.randn(20, generator=g) * 0.5).to(DEVICE) if bias else None
    w, ids = fused_topk(logits, k, scoring == "sigmoid", renorm, 2.5, correction)
    w_ref, ids_ref = select_experts(logits.cpu(), RouterConfig(20, k, scoring, renorm, routed_scaling_factor=2.5),
                                    None if correction is None else correction.cpu())
    _same_choice(w.cpu(), ids.cpu(), w_ref, ids_ref)


@pytest.mark.parametrize("scoring,renorm,bias,k,tokens", [("softmax", True, False, 2, 3),
                                                          ("softmax", False, False, 8, 1),
                                                          ("sigmoid", True, True, 3, 5)])
def test_gate_and_topk_in_one_launch_match_linear_then_router(scoring: str, renorm: bool, bias: bool, k: int,
                                                              tokens: int) -> None:
    """The router's linear layer + top-k as one kernel (its last program selects) equals the linear layer followed
    by select_experts; the counter it uses is back at 0 after each launch."""
    from radixserve.layers.moe.router import RouterConfig, select_experts
    from radixserve.layers.moe.topk_kernel import fused_gate_topk

    g = torch.Generator().manual_seed(k + tokens)
    e, h = 20, 24  # 20 experts: the last expert block is partly empty
    x = torch.randn(tokens, h, generator=g).to(DEVICE)
    weight = torch.randn(e, h, generator=g).to(DEVICE)
    correction = (torch.randn(e, generator=g) * 0.5).to(DEVICE) if bias else None
    done = torch.zeros(1, dtype=torch.int32, device=DEVICE)
    cfg = RouterConfig(e, k, scoring, renorm, routed_scaling_factor=2.5)
    ref_w, ref_ids = select_experts(torch.nn.functional.linear(x.cpu(), weight.cpu()), cfg,
                                    None if correction is None else correction.cpu())
    for _ in range(2):
        w, ids, no_x, no_res = fused_gate_topk(x, weight, done, k, scoring == "sigmoid", renorm, 2.5, correction,
                                               interpreted=DEVICE == "cpu")
        _same_choice(w.cpu(), ids.cpu(), ref_w, ref_ids)
        assert int(done) == 0 and no_x is None and no_res is None
    # with the residual add and RMSNorm in the same launch: fused_add_rmsnorm's outputs, then the same routing
    from radixserve.layers.triton_ops.norm import fused_add_rmsnorm

    residual = torch.randn(tokens, h, generator=g).to(DEVICE)
    norm_w = (torch.rand(h, generator=g) + 0.5).to(DEVICE)
    want_x, want_res = fused_add_rmsnorm(x, residual, norm_w, 1e-6)
    ref_w, ref_ids = select_experts(torch.nn.functional.linear(want_x.cpu(), weight.cpu()), cfg,
                                    None if correction is None else correction.cpu())
    w, ids, got_x, got_res = fused_gate_topk(x, weight, done, k, scoring == "sigmoid", renorm, 2.5, correction,
                                             interpreted=DEVICE == "cpu", norm=(residual, norm_w, 1e-6))
    _same_choice(w.cpu(), ids.cpu(), ref_w, ref_ids)
    torch.testing.assert_close(got_x, want_x, atol=1e-5, rtol=1e-5)
    assert torch.equal(got_res, want_res) and int(done) == 0
    with pytest.raises(ValueError, match="float32"):
        fused_gate_topk(x, weight.double(), done, k, False, renorm, 1.0)


@pytest.mark.skipif(torch.cuda.is_available(), reason="forces the kernels on CPU tensors: Triton's interpreter only")
def test_precompile_runs_every_block_config_a_batch_may_pick() -> None:
    """`precompile` runs the grouped GEMM once per distinct config of batches up to max_tokens (here the heuristic's
    first two), on the model's first MoE layer, and the parallel align at each config's block_m, and leaves the
    weights as they were."""
    from radixserve.layers.moe import FusedMoE, RouterConfig
    from radixserve.layers.moe.fused_moe import moe_config, precompile
    from radixserve.layers.triton_ops.launch import recording
    from radixserve.model_loader.dummy import initialize_dummy_weights

    holder = torch.nn.Module()
    holder.experts = FusedMoE(RouterConfig(8, 2, renormalize=True), 16, 8, reduce_results=False)
    initialize_dummy_weights(holder, seed=3)
    before = holder.experts.w13_weight.clone()
    assert precompile(holder, 256) == 0  # weights on the CPU: nothing to compile unless forced
    configs = {moe_config(n, 2, 8, 8, 16) for n in (9, 256)}
    assert len(configs) == 2
    with recording() as records:
        assert precompile(holder, 256, force=True) == 2
    assert torch.equal(holder.experts.w13_weight, before)
    aligned = {(r.fn.fn.__name__, r.kwargs["BLOCK_M"]) for r in records if "BLOCK_M" in r.kwargs}
    for cfg in configs:  # the parallel align (batches over SMALL_ALIGN assignments) at each config's block_m
        assert {("_align_count_kernel", cfg.block_m), ("_align_scatter_kernel", cfg.block_m)} <= aligned


@pytest.mark.parametrize("top_k,tokens", [(1, 7), (2, 19), (8, 6)])
def test_fused_moe_non_gated_relu2_experts_match_reference(top_k: int, tokens: int) -> None:
    """Nemotron 3's experts: w13 holds the up rows alone ([E, I, H]), relu(x W_up^T)² then W_down; uneven loads, an
    expert with no tokens, experts held by another rank; the reference is the per-expert formula itself."""
    e, h, i = 10, 32, 24
    w13, w2 = expert_weights(e, h, i, seed=top_k + 7, gated=False)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(8)).to(DEVICE)
    ids = skewed_ids(tokens, top_k, e, seed=top_k).to(DEVICE)
    assert not (ids == e - 1).any()
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(9)).to(DEVICE)
    ref = moe_forward_torch(x, w13, w2, weights, ids, act=RELU2)
    by_hand = torch.zeros_like(x)
    for t in range(tokens):
        for j in range(top_k):
            ex = int(ids[t, j])
            by_hand[t] += weights[t, j] * (torch.relu(x[t] @ w13[ex].T) ** 2 @ w2[ex].T)
    torch.testing.assert_close(ref, by_hand, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, act=RELU2), ref, atol=1e-5, rtol=1e-5)
    cfg = MoEConfig(block_m=32, block_n_gate_up=16, block_n_down=32, block_k=16, num_warps=1, num_stages=1)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, config=cfg, act=RELU2), ref, atol=1e-5, rtol=1e-5)
    halves = [fused_moe(x, w13[r * 5:(r + 1) * 5], w2[r * 5:(r + 1) * 5], weights, ids, expert_offset=5 * r,
                        num_global_experts=e, act=RELU2) for r in range(2)]
    torch.testing.assert_close(halves[0] + halves[1], ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not match"):  # gated weights are not taken for non-gated experts
        fused_moe(x, torch.cat([w13, w13], dim=1), w2, weights, ids, act=RELU2)


def test_non_gated_tp_and_ep_shards_add_up_to_the_whole_layer() -> None:
    """FusedMoE with relu2 experts: w13 is [E, I, H] (up rows alone), per-expert `up_proj` tensors load as shard w3
    (a gate shard is refused; fp8 holds them too), and TP=2 / EP=2 ranks' partial outputs sum to the one-rank
    layer's."""
    from radixserve.layers.moe import FusedMoE, RouterConfig, load_expert_weight

    router = RouterConfig(8, 2, renormalize=True)
    g = torch.Generator().manual_seed(11)
    ups, downs = torch.randn(8, 12, 16, generator=g), torch.randn(8, 16, 12, generator=g)

    def build(rank: int, tp: int, ep: int) -> FusedMoE:
        holder = torch.nn.Module()
        holder.mlp = torch.nn.Module()
        holder.mlp.experts = FusedMoE(router, 16, 12, rank, tp, ep_size=ep, reduce_results=False, activation=RELU2)
        params = dict(holder.named_parameters())
        for j in range(8):
            assert load_expert_weight(params, f"mlp.experts.{j}.up_proj.weight", ups[j]) == "mlp.experts.w13_weight"
            load_expert_weight(params, f"mlp.experts.{j}.down_proj.weight", downs[j])
        return holder.mlp.experts

    full = build(0, 1, 1)
    assert full.w13_weight.shape == (8, 12, 16) and torch.equal(full.w13_weight, ups)
    assert full.full_shape("w13_weight") == (8, 12, 16)
    x = torch.randn(9, 16, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(9, 8, generator=torch.Generator().manual_seed(1)) * 3
    ref = full(x, logits)
    for ep in (1, 2):
        parts = [build(r, 2, ep) for r in range(2)]
        if ep == 1:
            assert torch.equal(parts[1].w13_weight, ups[:, 6:]) and torch.equal(parts[1].w2_weight, downs[:, :, 6:])
        torch.testing.assert_close(sum(p(x, logits) for p in parts), ref, atol=1e-5, rtol=1e-5)
    stacked = FusedMoE(router, 16, 12, 1, 2, ep_size=1, reduce_results=False, activation=RELU2)
    stacked.weight_loader(stacked.w13_weight, ups, None)  # a whole stacked tensor (the dummy loader, transformers 5)
    assert torch.equal(stacked.w13_weight, ups[:, 6:])
    with pytest.raises(ValueError, match="no gate"):
        full.weight_loader(full.w13_weight, ups[0], "w1", 0)
    from radixserve.layers.quantization.fp8 import FP8, Fp8Config
    from radixserve.layers.quantization.fp8_moe import Fp8MoEMethod

    full.set_quant_method(Fp8MoEMethod(Fp8Config(serialized=True)))  # fp8 holds them: up rows alone, one scale
    assert full.w13_weight.shape == (8, 12, 16) and full.w13_weight.dtype == FP8
    assert full.w13_weight_scale.shape == (8, 1)
    with pytest.raises(ValueError, match="no gate projection's scale"):
        full.w13_weight_scale.weight_loader(full.w13_weight_scale, torch.tensor(1.0), "w1", 0)
