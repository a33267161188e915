"""The router on the tensor cores for many tokens (`gate_gemm.py`, Triton's interpreter on the CPU): float32 logits
of bf16 operands equal to the float32 linear layer, the top-k in the same launch equal to `select_experts`;
MoEGate keeps the half-precision copy only when it is exact, and dummy weights are rounded as a checkpoint of the
model's dtype would give them. And the MoE layer's top-k sum kernel against torch's sum."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from moe_utils import DEVICE

from radixserve.layers.moe.gate_gemm import gate_logits, gate_topk_blocks
from radixserve.layers.moe.router import MoEGate, RouterConfig, select_experts
from radixserve.layers.triton_ops import set_fused_kernels

INTERP = DEVICE == "cpu"


def _inputs(tokens: int, experts: int, hidden: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, hidden, generator=g).to(torch.bfloat16)
    w = (torch.randn(experts, hidden, generator=g) * 0.3).to(torch.bfloat16)
    return x.to(DEVICE), w.to(DEVICE)


@pytest.mark.parametrize("tokens,experts", [(2, 20), (37, 64), (16, 256)])
def test_gate_logits_equal_the_float32_linear_layer(tokens: int, experts: int) -> None:
    x, w = _inputs(tokens, experts, 80, tokens)
    got = gate_logits(x, w, INTERP)
    want = F.linear(x.float().cpu(), w.float().cpu())
    assert got.dtype == torch.float32 and got.shape == (tokens, experts)
    torch.testing.assert_close(got.cpu(), want, atol=1e-5, rtol=1e-5)


def _same_choice(w: torch.Tensor, ids: torch.Tensor, w_ref: torch.Tensor, ids_ref: torch.Tensor) -> None:
    order, order_ref = ids.long().sort(dim=1), ids_ref.long().sort(dim=1)
    assert torch.equal(order.values, order_ref.values)
    torch.testing.assert_close(w.gather(1, order.indices), w_ref.gather(1, order_ref.indices), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("scoring,renorm,bias,k,tokens,experts", [
    ("softmax", True, False, 2, 3, 20), ("softmax", False, False, 8, 37, 64), ("sigmoid", True, True, 3, 19, 20),
    ("softmax", True, False, 1, 5, 128)])
def test_gate_topk_in_one_launch_equals_linear_then_router(scoring: str, renorm: bool, bias: bool, k: int,
                                                           tokens: int, experts: int) -> None:
    x, w = _inputs(tokens, experts, 96, k + tokens)  # 96: the hidden dim in 3 chunks
    g = torch.Generator().manual_seed(7)
    correction = (torch.randn(experts, generator=g) * 0.5).to(DEVICE) if bias else None
    cfg = RouterConfig(experts, k, scoring, renorm, routed_scaling_factor=2.5)
    got_w, got_ids = gate_topk_blocks(x, w, k, scoring == "sigmoid", renorm, 2.5, correction, INTERP)
    ref_w, ref_ids = select_experts(F.linear(x.float().cpu(), w.float().cpu()), cfg,
                                    None if correction is None else correction.cpu())
    assert got_ids.dtype == torch.int32 and got_w.shape == (tokens, k)
    _same_choice(got_w.cpu(), got_ids.cpu(), ref_w, ref_ids)


def test_gate_kernels_refuse_what_they_cannot_take() -> None:
    x, w = _inputs(4, 20, 32, 0)
    with pytest.raises(ValueError, match="same dtype"):
        gate_logits(x.float(), w, INTERP)
    with pytest.raises(ValueError, match="top_k"):
        gate_topk_blocks(x, w, 21, False, False, 1.0, None, INTERP)


def _gate(dtype: torch.dtype, experts: int = 20, hidden: int = 32) -> MoEGate:
    old = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        return MoEGate(hidden, experts).to(DEVICE)
    finally:
        torch.set_default_dtype(old)


def test_moe_gate_keeps_the_half_copy_only_when_exact() -> None:
    from radixserve.model_loader.dummy import initialize_dummy_weights

    gate = _gate(torch.bfloat16)
    assert gate.weight.dtype == torch.float32
    initialize_dummy_weights(gate)  # a bf16 model's random gate: bf16 values, as its checkpoint stores them
    gate.after_weights_loaded()
    assert gate.weight_half is not None and gate.weight_half.dtype == torch.bfloat16
    assert torch.equal(gate.weight_half.float(), gate.weight)
    with torch.no_grad():
        gate.weight[0, 0] += 1e-4  # no longer a bf16 value: the float32 path only
    gate.after_weights_loaded()
    assert gate.weight_half is None
    f32 = _gate(torch.float32)
    initialize_dummy_weights(f32)
    f32.after_weights_loaded()
    assert f32.weight_half is None and not torch.equal(f32.weight, f32.weight.bfloat16().float())


def test_moe_gate_routes_many_tokens_through_the_half_copy() -> None:
    gate = _gate(torch.bfloat16, experts=64, hidden=48)
    with torch.no_grad():
        gate.weight.copy_((torch.randn(64, 48, generator=torch.Generator().manual_seed(3)) * 0.3).bfloat16())
    gate.after_weights_loaded()
    x = torch.randn(23, 48, generator=torch.Generator().manual_seed(4)).bfloat16().to(DEVICE)
    cfg = RouterConfig(64, 6, "softmax", False, routed_scaling_factor=1.5)
    ref_logits = F.linear(x.float(), gate.weight)
    ref_w, ref_ids = select_experts(ref_logits.cpu(), cfg)
    set_fused_kernels(True)
    try:
        torch.testing.assert_close(gate(x), ref_logits, atol=1e-5, rtol=1e-5)
        routed = gate.route(x, cfg)
    finally:
        set_fused_kernels(None)
    assert routed is not None and routed[2] is x and routed[3] is None
    _same_choice(routed[0].cpu(), routed[1].cpu(), ref_w, ref_ids)


@pytest.mark.parametrize("tokens,k,hidden", [(5, 6, 80), (1, 1, 2048), (9, 8, 100)])
def test_moe_sum_equals_torch_sum(tokens: int, k: int, hidden: int) -> None:
    from radixserve.layers.moe.fused_moe import moe_sum

    rows = torch.randn(tokens * k, hidden, generator=torch.Generator().manual_seed(k)).to(DEVICE)
    torch.testing.assert_close(moe_sum(rows, tokens, k, INTERP), rows.view(tokens, k, hidden).sum(dim=1),
                               atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="contiguous rows"):
        moe_sum(rows, tokens + 1, k, INTERP)


def test_gate_config_overrides_the_heuristic() -> None:
    x, w = _inputs(21, 20, 96, 5)
    ref_w, ref_ids = gate_topk_blocks(x, w, 3, False, True, 1.0, None, INTERP)
    for cfg in ((16, 16, 1, 4), (32, 32, 3, 2), (16, 16, 6, 1)):  # 1, 3 and 6 chunks of the hidden dim
        got_w, got_ids = gate_topk_blocks(x, w, 3, False, True, 1.0, None, INTERP, config=cfg)
        _same_choice(got_w.cpu(), got_ids.cpu(), ref_w.cpu(), ref_ids.cpu())
    with pytest.raises(ValueError, match="powers of two"):
        gate_topk_blocks(x, w, 3, False, True, 1.0, None, INTERP, config=(24, 16, 1, 4))


def test_gate_kernels_compile_one_variant_whatever_the_batch() -> None:
    """The hidden-dim chunk count changes with the batch (interpreted: 3 chunks at 2 tokens, 1 at 300; on a GPU with
    a 2,048-wide hidden dim 8 at 2 tokens, fewer at 3,000); the launches' constexprs do not, so no batch seen first
    while serving compiles a variant of its own."""
    from radixserve.layers.triton_ops.launch import recording

    hidden, sizes = (96, (2, 40, 300)) if INTERP else (2048, (2, 40, 3000))
    with recording() as records:
        for tokens in sizes:
            x, w = _inputs(tokens, 20, hidden, tokens)
            gate_topk_blocks(x, w, 3, False, True, 1.0, None, INTERP)
    chunks = {r.args[0].shape[0] for r in records if r.fn.fn.__name__ == "_gate_finish_kernel"}
    assert len(chunks) > 1  # the batches did take different chunk counts
    variants = {(r.fn.fn.__name__, tuple(sorted(r.kwargs.items()))) for r in records}
    assert len(variants) == 2, variants  # the partial sums and the finish, one variant each


def test_bench_router_many_tokens_compares_both_paths() -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
    from bench_router import many_tokens

    rows = many_tokens([3], layers=1, reps=1)
    paths = {(r["shape"], r["path"]) for r in rows}
    assert ("deepseek-v2-lite", "float32 linear, top-k") in paths
    assert ("qwen3-30b-a3b", "tensor cores, heuristic") in paths
    assert all(r["same_ids"] == 1.0 for r in rows if "same_ids" in r) and all(r["us"] > 0 for r in rows)
