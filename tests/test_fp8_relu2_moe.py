"""FP8 non-gated relu2 experts (Nemotron 3's; `fp8_moe.py`): w13 [E, I, H] holds the up rows alone and its scales
as many rows. The small-batch and grouped kernels (Triton's interpreter on the CPU; per-row and block-wise scales,
both small-batch block forms, W8A8) against the reference on the dequantised weights; the layer loading each expert's
`up_proj` / `down_proj` with per-tensor (ModelOpt: and static input scales), per-channel and block-wise scales, whole
or split over TP=2, and quantising them online."""

from __future__ import annotations

import pytest
import torch
from moe_utils import DEVICE, expert_weights, skewed_ids
from test_quant_fp8_moe import fp8_experts, reference_quantises_as_the_kernels

from radixserve.layers.moe.activation import RELU2
from radixserve.layers.moe.fused_moe import MoEConfig, fused_moe
from radixserve.layers.moe.methods import ExpertScales
from radixserve.layers.moe.moe_torch import moe_forward_torch
from radixserve.layers.moe.small_batch import SmallMoEConfig, small_batch_moe
from radixserve.layers.quantization.fp8 import FP8, dequantize_blocks, quantize_blocks, quantize_rows


@pytest.mark.parametrize("block", [None, (16, 16)])
@pytest.mark.parametrize("path,tokens,top_k", [("small-dot", 3, 2), ("small-rows", 2, 4), ("grouped", 9, 2),
                                               ("grouped-a8", 11, 2)])
def test_fp8_relu2_kernels_match_reference(block: tuple[int, int] | None, path: str, tokens: int, top_k: int,
                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """relu(x W_up^T)² W_down^T with fp8 up rows alone: the up rows' scales are read from row 0 of w13's (no gate
    rows before them), on every path; an expert with no tokens, uneven loads, tiles whose K step is cut to the scale
    group; expert parallelism's halves. W8A8 (x and the intermediate quantised per row and 32 columns, 32 x 32 blocks)
    against the reference quantising alike."""
    from radixserve.layers.moe import small_batch

    e, h, i = 10, 64, 32
    if path == "grouped-a8" and block is not None:
        block = (32, 32)  # (the fp8 product's shortest K step)
    q13, q2, scales, d13, d2 = fp8_experts(e, h, i, block, seed=top_k + 3, gated=False)
    assert q13.shape == (e, i, h) and scales.w13.shape[1] == (i if block is None else i // block[0])
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = skewed_ids(tokens, top_k, e).to(DEVICE)
    assert not (ids == e - 1).any()
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref = moe_forward_torch(x, d13, d2, weights, ids, act=RELU2)
    torch.testing.assert_close(moe_forward_torch(x, q13, q2, weights, ids, scales=scales, act=RELU2), ref,
                               atol=1e-5, rtol=1e-5)
    if path.startswith("small"):
        monkeypatch.setattr(small_batch, "FP8_BLOCKS_FORM", path.split("-")[1])
        outs = [small_batch_moe(x, q13, q2, weights, ids, scales=scales, act=RELU2),
                small_batch_moe(x, q13, q2, weights, ids, scales=scales, act=RELU2,
                                config=SmallMoEConfig(16, 64, 32, 64, 1, 1))]
    elif path == "grouped":
        outs = [fused_moe(x, q13, q2, weights, ids, scales=scales, act=RELU2),
                fused_moe(x, q13, q2, weights, ids, scales=scales, act=RELU2, config=MoEConfig(16, 16, 32, 64, 1, 1))]
    else:
        reference_quantises_as_the_kernels(monkeypatch)
        a8_ref = moe_forward_torch(x, q13, q2, weights, ids, scales=scales, act_group=32, act=RELU2)
        got = fused_moe(x, q13, q2, weights, ids, scales=scales, act_fp8=True, act_group=32, act=RELU2)
        assert (got - a8_ref).abs().max() < 1e-3 * a8_ref.abs().max()
        assert (a8_ref - ref).abs().max() > 1e-3 * ref.abs().max()  # (the activations were quantised)
        return
    for out in outs:
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    halves = [(small_batch_moe if path.startswith("small") else fused_moe)(
        x, q13[r * 5:(r + 1) * 5], q2[r * 5:(r + 1) * 5], weights, ids, 5 * r, act=RELU2,
        scales=ExpertScales(scales.w13[r * 5:(r + 1) * 5].contiguous(), scales.w2[r * 5:(r + 1) * 5].contiguous(),
                            scales.group_n, scales.group_k13, scales.group_k2),
        **({} if path.startswith("small") else {"num_global_experts": e})) for r in range(2)]
    torch.testing.assert_close(halves[0] + halves[1], ref, atol=1e-4, rtol=1e-4)  # expert parallelism


def _checkpoint(e: int, h: int, i: int, strategy: str) -> dict[str, torch.Tensor]:
    """Per-expert fp8 tensors as checkpoints name them (`mlp.experts.J.{up,down}_proj.*`): per-tensor scales with
    static input scales (ModelOpt), per-channel [N, 1] (compressed-tensors) or 16 x 16 blocks (`weight_scale_inv`)."""
    w13, w2 = (w.cpu() for w in expert_weights(e, h, i, seed=21, gated=False))
    out = {}
    for j in range(e):
        for part, w in (("up_proj", w13[j]), ("down_proj", w2[j])):
            base = f"mlp.experts.{j}.{part}."
            if strategy == "tensor":
                s = w.abs().max() / 448.0
                out[base + "weight"], out[base + "weight_scale"] = (w / s).to(FP8), s.reshape(())
                out[base + "input_scale"] = torch.tensor(0.01 * (j + 1))
            elif strategy == "channel":
                q, s = quantize_rows(w)
                out[base + "weight"], out[base + "weight_scale"] = q, s[:, None]
            else:
                out[base + "weight"], out[base + "weight_scale_inv"] = quantize_blocks(w, 16, 16)
    return out


def _dequantized(ckpt: dict[str, torch.Tensor], e: int, part: str, strategy: str) -> torch.Tensor:
    ts = []
    for j in range(e):
        base = f"mlp.experts.{j}.{part}."
        q = ckpt[base + "weight"]
        if strategy == "block":
            ts.append(dequantize_blocks(q, ckpt[base + "weight_scale_inv"], 16, 16))
        else:
            ts.append(q.float() * ckpt[base + "weight_scale"].float().reshape(-1, 1))
    return torch.stack(ts)


@pytest.mark.parametrize("strategy", ["tensor", "channel", "block", "online"])
def test_fp8_relu2_layer_loads_each_scale_form(strategy: str) -> None:
    """FusedMoE with relu2 experts under fp8: w13 [E, I, H] fp8 with I rows of scales; each expert's up_proj fills
    it whole (per-tensor: its one scale on every row; static input scales load, then go); TP=2 ranks hold their half
    of I (rows, row blocks) and their partial outputs add up to the reference on the dequantised weights. Online:
    each row quantised after loading, within rounding of the 16-bit weights."""
    from radixserve.layers.moe import FusedMoE, RouterConfig, load_expert_weight
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.fp8 import Fp8Config

    e, h, i = 6, 32, 32
    ckpt = _checkpoint(e, h, i, "tensor" if strategy == "online" else strategy)
    d13, d2 = _dequantized(ckpt, e, "up_proj", strategy), _dequantized(ckpt, e, "down_proj", strategy)
    if strategy == "online":
        ckpt = {n: (d13 if "up_proj" in n else d2)[int(n.split(".")[2])] for n in ckpt if n.endswith(".weight")}
        config = Fp8Config(serialized=False)
    elif strategy == "tensor":
        config = Fp8Config(serialized=True, activation_scheme="static")
    else:
        config = Fp8Config(serialized=True, weight_strategy=strategy,
                           weight_block_size=[16, 16] if strategy == "block" else None)
    router = RouterConfig(e, 2, renormalize=True)
    x = torch.randn(5, h, generator=torch.Generator().manual_seed(0))
    logits = torch.randn(5, e, generator=torch.Generator().manual_seed(1)) * 3
    parts = []
    for rank, tp in ((0, 1), (0, 2), (1, 2)):
        holder = torch.nn.Module()
        holder.mlp = torch.nn.Module()
        holder.mlp.experts = layer = FusedMoE(router, h, i, rank, tp, ep_size=1, reduce_results=False,
                                              activation=RELU2)
        apply_quantization(holder, config)
        if strategy == "tensor":
            assert layer.w13_weight_scale.shape == (e, 1) and layer.w13_input_scale.shape == (e, 1)
        params = dict(holder.named_parameters())
        for name, t in ckpt.items():
            assert load_expert_weight(params, name, t) is not None
        if strategy == "tensor":
            assert float(layer.w13_input_scale[3, 0]) == pytest.approx(0.04)
        finish_quantization(holder)
        assert layer.w13_weight.dtype == FP8 and layer.w13_weight.shape == (e, i // tp, h)
        sc = layer.quant_method.expert_scales(layer)
        assert sc.w13.shape[1] == (i // tp // 16 if strategy == "block" else i // tp)
        assert not hasattr(layer, "w13_input_scale")
        mine = slice(rank * i // tp, (rank + 1) * i // tp)
        up = torch.stack([dequantize_blocks(layer.w13_weight[j], sc.w13[j], sc.group_n, sc.group_k13)
                          for j in range(e)])
        if strategy == "online":
            torch.testing.assert_close(up, d13[:, mine], atol=0.02, rtol=0.07)
        else:
            torch.testing.assert_close(up, d13[:, mine], rtol=0, atol=0)
        parts.append(layer(x, logits))
    ref = FusedMoE(router, h, i, activation=RELU2)
    ref.w13_weight.data.copy_(d13)
    ref.w2_weight.data.copy_(d2)
    want = ref(x, logits)
    tol = 0.05 * float(want.abs().max()) if strategy == "online" else 1e-5
    torch.testing.assert_close(parts[0], want, atol=tol, rtol=0)
    torch.testing.assert_close(parts[1] + parts[2], want, atol=tol, rtol=0)
