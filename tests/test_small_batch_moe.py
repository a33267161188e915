"""The small-batch MoE path (two launches, no sort: `layers/moe/small_batch.py`), run by Triton's interpreter on the
CPU, against the per-expert torch reference: top-k 1/2/8, uneven loads, an expert with no tokens, experts held by
another rank, shared experts folded in as extra assignments; GPT-OSS's and Nemotron 3's (non-gated relu2) experts; and
FusedMoE choosing it for small batches only."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_utils import DEVICE, expert_weights, skewed_ids

from radixserve.layers.moe.activation import RELU2, ExpertActivation, ExpertBias
from radixserve.layers.moe.fused_moe import fused_moe
from radixserve.layers.moe.moe_torch import moe_forward_torch
from radixserve.layers.moe.small_batch import SmallMoEConfig, small_batch_moe


def _inputs(t: int, k: int, e: int, h: int, seed: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(seed)).to(DEVICE)
    ids = skewed_ids(t, k, e, seed).to(DEVICE)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(seed + 1)).to(DEVICE)
    return x, ids, weights


def _count_small_batch_calls(monkeypatch: pytest.MonkeyPatch) -> list[int]:
    """The token counts of the small-batch launches from now on (at most 4 tokens take that path)."""
    from radixserve.layers.moe import small_batch

    calls: list[int] = []
    real = small_batch.small_batch_moe

    def counting(x: torch.Tensor, *args: object, **kwargs: object) -> torch.Tensor:
        calls.append(x.shape[0])
        return real(x, *args, **kwargs)

    monkeypatch.setattr(small_batch, "small_batch_moe", counting)
    monkeypatch.setattr(small_batch, "SMALL_BATCH_TOKENS", 4)
    return calls


@pytest.mark.parametrize("top_k,tokens", [(1, 3), (2, 5), (8, 4)])
def test_small_batch_moe_matches_reference(top_k: int, tokens: int) -> None:
    e, h, i = 11, 24, 20  # sizes off the tile sizes: every mask is exercised
    w13, w2 = expert_weights(e, h, i)
    x, ids, weights = _inputs(tokens, top_k, e, h, seed=top_k)
    assert not (ids == e - 1).any()  # an expert with no tokens
    ref = moe_forward_torch(x, w13, w2, weights, ids)
    torch.testing.assert_close(small_batch_moe(x, w13, w2, weights, ids), ref, atol=1e-5, rtol=1e-5)
    # other tile shapes: a column block wider than the intermediate size, several K steps in the down kernel
    cfg = SmallMoEConfig(32, 16, 32, 16, 1, 1)
    torch.testing.assert_close(small_batch_moe(x, w13, w2, weights, ids, config=cfg), ref, atol=1e-5, rtol=1e-5)


def test_small_batch_moe_with_experts_held_elsewhere() -> None:
    """Expert parallelism: rank r holds experts 4r..4r+3 of 8; the two partial outputs add up to the whole."""
    e, h, i, t, k = 8, 16, 12, 3, 2
    w13, w2 = expert_weights(e, h, i, seed=3)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ids = torch.tensor([[0, 5], [6, 7], [1, 2]], dtype=torch.int32, device=DEVICE)  # token 1: none on rank 0
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(5)).to(DEVICE)
    halves = [small_batch_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, ids, expert_offset=4 * r)
              for r in range(2)]
    torch.testing.assert_close(halves[0], moe_forward_torch(x, w13[:4], w2[:4], weights, ids), atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(halves[0] + halves[1], moe_forward_torch(x, w13, w2, weights, ids),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("chunks", [1, 2])
def test_small_batch_moe_folds_the_shared_experts(chunks: int) -> None:
    """A shared MLP of intermediate size chunks·I ([2S, H] gate rows then up rows, [H, S]) added as weight-1
    assignments equals the routed experts plus the MLP computed on its own."""
    e, h, i, t, k = 6, 16, 12, 3, 2
    w13, w2 = expert_weights(e, h, i, seed=6)
    x, ids, weights = _inputs(t, k, e, h, seed=7)
    g = torch.Generator().manual_seed(8)
    s = chunks * i
    sw13, sw2 = (torch.randn(2 * s, h, generator=g) * 0.2).to(DEVICE), (torch.randn(h, s, generator=g) * 0.2).to(DEVICE)
    gu = F.linear(x, sw13)
    shared = F.linear(F.silu(gu[:, :s]) * gu[:, s:], sw2)
    ref = moe_forward_torch(x, w13, w2, weights, ids) + shared
    got = small_batch_moe(x, w13, w2, weights, ids, shared_w13=sw13, shared_w2=sw2)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="multiple of"):
        small_batch_moe(x, w13, w2, weights, ids, shared_w13=sw13[:, :-1], shared_w2=sw2)


def test_fused_moe_layer_takes_the_small_path_only_for_small_batches(monkeypatch: pytest.MonkeyPatch) -> None:
    """FusedMoE with the kernels on: up to SMALL_BATCH_TOKENS tokens go through small_batch_moe, more through the
    sorted grouped GEMM; both equal the reference."""
    from radixserve.layers.moe import FusedMoE, RouterConfig
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.model_loader.dummy import initialize_dummy_weights

    holder = torch.nn.Module()
    holder.experts = FusedMoE(RouterConfig(8, 2, renormalize=True), 16, 8, reduce_results=False)
    initialize_dummy_weights(holder, seed=1)
    holder.to(DEVICE)
    layer = holder.experts
    calls = _count_small_batch_calls(monkeypatch)
    set_fused_kernels(True)
    try:
        for t in (3, 4, 5):
            x = torch.randn(t, 16, generator=torch.Generator().manual_seed(t)).to(DEVICE)
            logits = torch.randn(t, 8, generator=torch.Generator().manual_seed(t + 1)).to(DEVICE)
            w, ids = _route(logits, layer)
            ref = moe_forward_torch(x, layer.w13_weight, layer.w2_weight, w, ids)
            torch.testing.assert_close(layer(x, logits), ref, atol=1e-5, rtol=1e-5)
    finally:
        set_fused_kernels(None)
    assert calls == [3, 4]


def _route(logits: torch.Tensor, layer: torch.nn.Module) -> tuple[torch.Tensor, torch.Tensor]:
    from radixserve.layers.moe import select_experts

    return select_experts(logits, layer.router)


def _gpt_oss_experts(e: int, h: int, i: int, seed: int) -> tuple[torch.Tensor, ...]:
    """GPT-OSS-style experts: weights and biases [E, 2I] / [E, H], on DEVICE."""
    w13, w2 = expert_weights(e, h, i, seed=seed)
    g = torch.Generator().manual_seed(seed + 100)
    b13, b2 = torch.randn(e, 2 * i, generator=g) * 0.5, torch.randn(e, h, generator=g) * 0.5
    return w13, w2, b13.to(DEVICE), b2.to(DEVICE)


# a limit the products cross on both sides, so that both clamps act
_OAI = ExpertActivation("swiglu_oai", alpha=1.702, limit=0.75)


@pytest.mark.parametrize("top_k,tokens", [(2, 1), (1, 3), (4, 3)])
def test_small_batch_moe_gpt_oss_experts_match_reference(top_k: int, tokens: int) -> None:
    """Biased experts with the clamped SwiGLU: gate/up bias before the activation, down bias before the routing
    weight, as `moe_forward_torch` computes them; in both tile shapes of the test above."""
    e, h, i = 11, 24, 20
    w13, w2, b13, b2 = _gpt_oss_experts(e, h, i, seed=top_k + 20)
    x, ids, weights = _inputs(tokens, top_k, e, h, seed=top_k + 30)
    bias = ExpertBias(b13, b2)
    gu = torch.einsum("th,eih->tei", x, w13) + b13  # every expert's pre-activation products
    assert (gu[..., :i] > _OAI.limit).any() and (gu[..., i:] > _OAI.limit).any() and (gu[..., i:] < -_OAI.limit).any()
    ref = moe_forward_torch(x, w13, w2, weights, ids, act=_OAI, bias=bias)
    got = small_batch_moe(x, w13, w2, weights, ids, act=_OAI, bias=bias)
    torch.testing.assert_close(got, ref, atol=1e-5, rtol=1e-5)
    cfg = SmallMoEConfig(32, 16, 32, 16, 1, 1)
    torch.testing.assert_close(small_batch_moe(x, w13, w2, weights, ids, config=cfg, act=_OAI, bias=bias), ref,
                               atol=1e-5, rtol=1e-5)
    # the activation and each bias change the result (the comparisons above can fail)
    silu = small_batch_moe(x, w13, w2, weights, ids, bias=bias)
    torch.testing.assert_close(silu, moe_forward_torch(x, w13, w2, weights, ids, bias=bias), atol=1e-5, rtol=1e-5)
    assert (silu - got).abs().max() > 1e-2
    for partial in (ExpertBias(b13, None), ExpertBias(None, b2)):
        assert (small_batch_moe(x, w13, w2, weights, ids, act=_OAI, bias=partial) - got).abs().max() > 1e-2


def test_small_batch_moe_gpt_oss_experts_held_elsewhere() -> None:
    """Expert parallelism with biases: an expert held by another rank adds neither its product nor its bias."""
    e, h, i, t, k = 8, 16, 12, 3, 2
    w13, w2, b13, b2 = _gpt_oss_experts(e, h, i, seed=40)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(41)).to(DEVICE)
    ids = torch.tensor([[0, 5], [6, 7], [1, 2]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(42)).to(DEVICE)
    halves = [small_batch_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, ids, expert_offset=4 * r,
                              act=_OAI, bias=ExpertBias(b13[r * 4:(r + 1) * 4], b2[r * 4:(r + 1) * 4]))
              for r in range(2)]
    assert not halves[0][1].any()  # token 1 chose no expert of rank 0
    torch.testing.assert_close(halves[0] + halves[1], moe_forward_torch(x, w13, w2, weights, ids, act=_OAI,
                                                                        bias=ExpertBias(b13, b2)),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="bias"):
        small_batch_moe(x, w13[:4], w2[:4], weights, ids, act=_OAI, bias=ExpertBias(b13, b2[:4]))
    sw13, sw2 = torch.zeros(2 * i, h, device=DEVICE), torch.zeros(h, i, device=DEVICE)
    with pytest.raises(ValueError, match="shared MLP"):
        small_batch_moe(x, w13, w2, weights, ids, shared_w13=sw13, shared_w2=sw2, act=_OAI)


def test_fused_moe_layer_takes_the_small_path_for_gpt_oss_experts(monkeypatch: pytest.MonkeyPatch) -> None:
    """FusedMoE with GPT-OSS's experts (activation, biases) and the kernels on: up to SMALL_BATCH_TOKENS tokens go
    through small_batch_moe, more through the grouped GEMMs; both equal the reference. An attached shared MLP is
    never folded into their launch (it is into a plain layer's)."""
    from types import SimpleNamespace

    from radixserve.layers.moe import FusedMoE, RouterConfig
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.model_loader.dummy import initialize_dummy_weights

    holder = torch.nn.Module()
    holder.experts = FusedMoE(RouterConfig(8, 2, renormalize=True), 16, 8, reduce_results=False, activation=_OAI,
                              bias=True)
    holder.plain = FusedMoE(RouterConfig(8, 2, renormalize=True), 16, 8, reduce_results=False)
    initialize_dummy_weights(holder, seed=2)
    holder.to(DEVICE)
    layer = holder.experts
    assert not layer.plain_experts and layer.w2_bias.abs().sum() > 0
    calls = _count_small_batch_calls(monkeypatch)
    mlp = SimpleNamespace(gate_up_proj=torch.nn.Linear(16, 16, bias=False).to(DEVICE),
                          down_proj=torch.nn.Linear(8, 16, bias=False).to(DEVICE))
    set_fused_kernels(True)
    try:
        for t in (1, 3, 5):
            x = torch.randn(t, 16, generator=torch.Generator().manual_seed(t + 50)).to(DEVICE)
            logits = torch.randn(t, 8, generator=torch.Generator().manual_seed(t + 51)).to(DEVICE)
            w, ids = _route(logits, layer)
            ref = moe_forward_torch(x, layer.w13_weight, layer.w2_weight, w, ids, act=_OAI,
                                    bias=layer.expert_bias())
            torch.testing.assert_close(layer(x, logits), ref, atol=1e-5, rtol=1e-5)
        for lay in (layer, holder.plain):
            lay.attach_shared_experts(mlp)
        x1 = torch.randn(1, 16, device=DEVICE)
        assert holder.plain.shared_folded(x1) and not layer.shared_folded(x1)
    finally:
        set_fused_kernels(None)
    assert calls == [1, 3]


@pytest.mark.parametrize("top_k,tokens", [(1, 3), (2, 5), (8, 4)])
def test_small_batch_moe_non_gated_relu2_experts_match_reference(top_k: int, tokens: int) -> None:
    """Nemotron 3's experts (w13 [E, I, H], up rows alone; relu(up)²): uneven loads, an expert with no tokens, both
    tile shapes; with a bias on the up rows too (the kernels read it at the up rows' offset, 0)."""
    e, h, i = 11, 24, 20
    w13, w2 = expert_weights(e, h, i, seed=top_k + 60, gated=False)
    x, ids, weights = _inputs(tokens, top_k, e, h, seed=top_k + 61)
    assert not (ids == e - 1).any()
    assert (F.linear(x, w13[0]) < 0).any()  # relu cuts some products
    ref = moe_forward_torch(x, w13, w2, weights, ids, act=RELU2)
    torch.testing.assert_close(small_batch_moe(x, w13, w2, weights, ids, act=RELU2), ref, atol=1e-5, rtol=1e-5)
    cfg = SmallMoEConfig(32, 16, 32, 16, 1, 1)
    torch.testing.assert_close(small_batch_moe(x, w13, w2, weights, ids, config=cfg, act=RELU2), ref,
                               atol=1e-5, rtol=1e-5)
    g = torch.Generator().manual_seed(62)
    bias = ExpertBias((torch.randn(e, i, generator=g) * 0.5).to(DEVICE),
                      (torch.randn(e, h, generator=g) * 0.5).to(DEVICE))
    ref_b = moe_forward_torch(x, w13, w2, weights, ids, act=RELU2, bias=bias)
    assert (ref_b - ref).abs().max() > 1e-2
    torch.testing.assert_close(small_batch_moe(x, w13, w2, weights, ids, act=RELU2, bias=bias), ref_b,
                               atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(fused_moe(x, w13, w2, weights, ids, act=RELU2, bias=bias), ref_b, atol=1e-5, rtol=1e-5)


def test_small_batch_moe_non_gated_experts_held_elsewhere() -> None:
    """Expert parallelism with relu2 experts: the two ranks' partial outputs add up to the whole; a shared MLP
    (gated SiLU) cannot ride along."""
    e, h, i, t, k = 8, 16, 12, 3, 2
    w13, w2 = expert_weights(e, h, i, seed=70, gated=False)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(71)).to(DEVICE)
    ids = torch.tensor([[0, 5], [6, 7], [1, 2]], dtype=torch.int32, device=DEVICE)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(72)).to(DEVICE)
    halves = [small_batch_moe(x, w13[r * 4:(r + 1) * 4], w2[r * 4:(r + 1) * 4], weights, ids, expert_offset=4 * r,
                              act=RELU2) for r in range(2)]
    assert not halves[0][1].any()
    torch.testing.assert_close(halves[0] + halves[1], moe_forward_torch(x, w13, w2, weights, ids, act=RELU2),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="do not match"):
        small_batch_moe(x, w13, w2, weights, ids)  # [E, I, H] is not a gated stack
    sw13, sw2 = torch.zeros(2 * i, h, device=DEVICE), torch.zeros(h, i, device=DEVICE)
    with pytest.raises(ValueError, match="shared MLP"):
        small_batch_moe(x, w13, w2, weights, ids, shared_w13=sw13, shared_w2=sw2, act=RELU2)


def test_fused_moe_layer_serves_non_gated_experts_on_both_kernel_paths(monkeypatch: pytest.MonkeyPatch) -> None:
    """FusedMoE with relu2 experts and the kernels on: small batches through small_batch_moe, larger ones through
    the grouped GEMMs, each equal to the reference; an attached shared MLP is never folded in."""
    from types import SimpleNamespace

    from radixserve.layers.moe import FusedMoE, RouterConfig
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.model_loader.dummy import initialize_dummy_weights

    holder = torch.nn.Module()
    holder.experts = FusedMoE(RouterConfig(8, 2, "sigmoid", renormalize=True, routed_scaling_factor=2.5), 16, 8,
                              reduce_results=False, activation=RELU2)
    initialize_dummy_weights(holder, seed=4)
    holder.to(DEVICE)
    layer = holder.experts
    assert layer.w13_weight.shape == (8, 8, 16) and not layer.plain_experts
    calls = _count_small_batch_calls(monkeypatch)
    layer.attach_shared_experts(SimpleNamespace(gate_up_proj=torch.nn.Linear(16, 16, bias=False).to(DEVICE),
                                                down_proj=torch.nn.Linear(8, 16, bias=False).to(DEVICE)))
    set_fused_kernels(True)
    try:
        for t in (2, 6):
            x = torch.randn(t, 16, generator=torch.Generator().manual_seed(t + 80)).to(DEVICE)
            logits = torch.randn(t, 8, generator=torch.Generator().manual_seed(t + 81)).to(DEVICE)
            w, ids = _route(logits, layer)
            ref = moe_forward_torch(x, layer.w13_weight, layer.w2_weight, w, ids, act=RELU2)
            assert not layer.shared_folded(x)
            torch.testing.assert_close(layer(x, logits), ref, atol=1e-5, rtol=1e-5)
    finally:
        set_fused_kernels(None)
    assert calls == [2]
