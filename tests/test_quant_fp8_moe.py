"""FP8 experts (`layers/quantization/fp8_moe.py`): the small-batch and grouped kernels (Triton's interpreter on the
CPU) with per-channel and block-wise scales against the dequantising reference; fp8 MoE checkpoints (block-wise,
per-tensor with static input scales) loading into the stacked experts, greedy-equal to transformers on the
dequantised weights; online quantisation of the experts; block scales sharded with their experts under TP=2."""

from __future__ import annotations

import os

import pytest
import torch
from moe_utils import DEVICE, expert_weights, skewed_ids

from radixserve.layers.moe.fused_moe import MoEConfig, fused_moe
from radixserve.layers.moe.methods import ExpertScales
from radixserve.layers.moe.moe_torch import moe_forward_torch
from radixserve.layers.moe.small_batch import SmallMoEConfig, small_batch_moe
from radixserve.layers.quantization.fp8 import FP8, dequantize_blocks, quantize_blocks, quantize_rows


def _quantize(w: torch.Tensor, block: tuple[int, int] | None) -> tuple[torch.Tensor, torch.Tensor]:
    """[E, N, K] -> fp8 and scales in `ExpertScales`' layout."""
    if block is None:
        parts = [quantize_rows(w[e]) for e in range(w.shape[0])]
        return torch.stack([q for q, _ in parts]), torch.stack([s[:, None] for _, s in parts])
    parts = [quantize_blocks(w[e], *block) for e in range(w.shape[0])]
    return torch.stack([q for q, _ in parts]), torch.stack([s for _, s in parts])


def fp8_experts(e: int, h: int, i: int, block: tuple[int, int] | None, seed: int = 0, gated: bool = True,
                ) -> tuple[torch.Tensor, torch.Tensor, ExpertScales, torch.Tensor, torch.Tensor]:
    """(fp8 w13 ([e, i, h] when not `gated`), fp8 w2, their scales, and the dequantised float32 w13, w2) on
    DEVICE."""
    w13, w2 = expert_weights(e, h, i, seed, gated=gated)
    q13, s13 = _quantize(w13.cpu(), block)
    q2, s2 = _quantize(w2.cpu(), block)
    gn, gk13, gk2 = (1, h, i) if block is None else (block[0], block[1], block[1])
    scales = ExpertScales(s13.to(DEVICE), s2.to(DEVICE), gn, gk13, gk2)
    d13 = torch.stack([dequantize_blocks(q13[x], s13[x], gn, gk13) for x in range(e)])
    d2 = torch.stack([dequantize_blocks(q2[x], s2[x], gn, gk2) for x in range(e)])
    return q13.to(DEVICE), q2.to(DEVICE), scales, d13.to(DEVICE), d2.to(DEVICE)


@pytest.mark.parametrize("block", [None, (16, 16)])
def test_fp8_reference_is_the_dequantised_model(block: tuple[int, int] | None) -> None:
    """The reference with scales is the plain reference on the dequantised weights (float32), and the fp8
    weights stay close to the originals (the quantisation is real, the scales are applied)."""
    e, h, i, t, k = 6, 32, 32, 7, 2
    q13, q2, scales, d13, d2 = fp8_experts(e, h, i, block)
    assert q13.dtype == FP8 and q2.dtype == FP8
    w13, _ = expert_weights(e, h, i)
    assert (d13 - w13).abs().max() < 0.05 * w13.abs().max() and not torch.equal(d13, w13)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(1)).to(DEVICE)
    ids = skewed_ids(t, k, e).to(DEVICE)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(2)).to(DEVICE)
    torch.testing.assert_close(moe_forward_torch(x, q13, q2, weights, ids, scales=scales),
                               moe_forward_torch(x, d13, d2, weights, ids), atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("block", [None, (16, 16)])
@pytest.mark.parametrize("path,tokens,top_k", [("small", 3, 2), ("small", 2, 8), ("grouped", 9, 2),
                                               ("grouped", 5, 1)])
def test_fp8_expert_kernels_match_reference(block: tuple[int, int] | None, path: str, tokens: int,
                                            top_k: int) -> None:
    """Both kernel paths widen the fp8 tiles and scale each K step by its group's scales: sizes with several K
    steps per scale group and several groups per row (block-wise), an expert with no tokens, uneven loads."""
    e, h, i = 10, 64, 32
    q13, q2, scales, d13, d2 = fp8_experts(e, h, i, block, seed=top_k)
    x = torch.randn(tokens, h, generator=torch.Generator().manual_seed(3)).to(DEVICE)
    ids = skewed_ids(tokens, top_k, e).to(DEVICE)
    assert not (ids == e - 1).any()
    weights = torch.rand(tokens, top_k, generator=torch.Generator().manual_seed(4)).to(DEVICE)
    ref = moe_forward_torch(x, d13, d2, weights, ids)
    if path == "small":
        outs = [small_batch_moe(x, q13, q2, weights, ids, scales=scales),
                small_batch_moe(x, q13, q2, weights, ids, scales=scales, config=SmallMoEConfig(16, 64, 32, 64, 1, 1))]
    else:
        outs = [fused_moe(x, q13, q2, weights, ids, scales=scales),
                fused_moe(x, q13, q2, weights, ids, scales=scales, config=MoEConfig(16, 16, 32, 64, 1, 1))]
    for out in outs:  # the second config's 64-wide K step is cut to the 16-wide scale group
        torch.testing.assert_close(out, ref, atol=1e-4, rtol=1e-4)
    if DEVICE == "cuda":  # bfloat16 activations on the tensor cores
        xb = x.bfloat16()
        got = (small_batch_moe if path == "small" else fused_moe)(xb, q13, q2, weights, ids, scales=scales)
        ref_b = moe_forward_torch(xb, q13, q2, weights, ids, scales=scales)
        torch.testing.assert_close(got.float(), ref_b.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("form", ["dot", "rows"])
def test_block_wise_small_batch_forms_match_reference(form: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Block-wise fp8 experts through the small-batch kernels in both forms (`FP8_BLOCKS_FORM`: tensor-core tiles or
    the CUDA cores' runs of 8, each step's sums scaled by its block): several 16-column groups per row, 32-row
    blocks of scales, tiles wider than a group (cut to it), an expert with no tokens; a group that runs of 8 cannot
    tile keeps the dot form."""
    from radixserve.layers.moe import small_batch

    monkeypatch.setattr(small_batch, "FP8_BLOCKS_FORM", form)
    e, h, i, t, k = 10, 64, 64, 3, 4
    q13, q2, scales, d13, d2 = fp8_experts(e, h, i, (32, 16), seed=5)
    assert small_batch.fp8_form(scales) == (3 if form == "rows" else 2)
    assert small_batch.fp8_form(ExpertScales(scales.w13, scales.w2, 32, 12, 16)) == 2
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ids = skewed_ids(t, k, e).to(DEVICE)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    ref = moe_forward_torch(x, d13, d2, weights, ids)
    for cfg in (None, SmallMoEConfig(16, 64, 32, 64, 1, 1), SmallMoEConfig(32, 16, 16, 16, 1, 1)):
        got = small_batch_moe(x, q13, q2, weights, ids, scales=scales, config=cfg)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


def reference_quantises_as_the_kernels(monkeypatch: pytest.MonkeyPatch) -> None:
    """Under Triton's interpreter, the torch reference's activation quantisation (W8A8) done by the kernel the fused
    path uses (the interpreter drops the carry of a few roundings that torch makes; on a GPU the two agree)."""
    from radixserve.layers.moe import moe_torch
    from radixserve.layers.quantization.fp8_kernels import per_token_group_quant_fp8

    def kernel_act(a: torch.Tensor, group: int | None) -> torch.Tensor:
        if group is None:
            return a.float()
        q, sc = per_token_group_quant_fp8(a.contiguous(), group)
        return (q.float().view(a.shape[0], -1, group) * sc[..., None]).view(a.shape)

    if DEVICE == "cpu":
        monkeypatch.setattr(moe_torch, "_act", kernel_act)


@pytest.mark.parametrize("block", [None, (32, 32)])
def test_fp8_w8a8_grouped_kernels_match_reference(block: tuple[int, int] | None,
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """The grouped GEMMs with fp8 activations too (x and the intermediate quantised per row and 32 columns, both
    products on the fp8 tensor cores) against the reference that quantises the same way; and the quantisation
    is real: the result is not the 16-bit-activation one. Under Triton's interpreter the reference quantises with
    the kernel the fused path uses (the interpreter drops the carry of a few roundings that torch makes; on a GPU
    the two quantisers agree bit for bit and torch's is used)."""
    reference_quantises_as_the_kernels(monkeypatch)
    e, h, i, t, k = 8, 64, 32, 11, 2
    q13, q2, scales, d13, d2 = fp8_experts(e, h, i, block, seed=9)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(10)).to(DEVICE)
    ids = skewed_ids(t, k, e).to(DEVICE)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(11)).to(DEVICE)
    ref = moe_forward_torch(x, q13, q2, weights, ids, scales=scales, act_group=32)
    got = fused_moe(x, q13, q2, weights, ids, scales=scales, act_fp8=True, act_group=32)
    scale = ref.abs().max()
    assert (got - ref).abs().max() < 1e-3 * scale, float((got - ref).abs().max() / scale)
    w8a16 = moe_forward_torch(x, d13, d2, weights, ids)
    assert (w8a16 - ref).abs().max() > 1e-3 * scale
    with pytest.raises(ValueError, match="activation group"):
        fused_moe(x, q13, q2, weights, ids, scales=scales, act_fp8=True, act_group=48)
    with pytest.raises(ValueError, match="shortest K step"):  # 16-column groups: too short for the fp8 product
        fused_moe(x, q13, q2, weights, ids, scales=scales, act_fp8=True, act_group=16)
    if block is not None and DEVICE == "cuda":  # automatically W8A16 for groups shorter than 32 columns (bf16:
        # a GPU check, the interpreter's fp8 -> bf16 cast is not the GPU's)
        q13s, q2s, small_groups, _, _ = fp8_experts(e, h, i, (16, 16), seed=9)
        auto = fused_moe(x.bfloat16(), q13s, q2s, weights, ids, scales=small_groups)
        torch.testing.assert_close(auto, moe_forward_torch(x.bfloat16(), q13s, q2s, weights, ids,
                                                           scales=small_groups), atol=3e-2, rtol=3e-2)


def test_fp8_experts_held_elsewhere() -> None:
    """Expert parallelism with fp8 experts: rank 1 of 2 holds experts 4..7 and their scales."""
    e, h, i, t, k = 8, 32, 16, 5, 2
    q13, q2, scales, d13, d2 = fp8_experts(e, h, i, (16, 16), seed=5)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(6)).to(DEVICE)
    ids = torch.stack([torch.randperm(e, generator=torch.Generator().manual_seed(s))[:k] for s in range(t)])
    ids = ids.to(DEVICE, torch.int32)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(7)).to(DEVICE)
    mine = ExpertScales(scales.w13[4:].contiguous(), scales.w2[4:].contiguous(), 16, 16, 16)
    ref = moe_forward_torch(x, d13[4:], d2[4:], weights, ids, expert_offset=4)
    for fn in (small_batch_moe, fused_moe):
        kw = {"num_global_experts": e} if fn is fused_moe else {}
        got = fn(x, q13[4:], q2[4:], weights, ids, 4, scales=mine, **kw)
        torch.testing.assert_close(got, ref, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------- checkpoints
def _write_fp8_moe_checkpoint(path: str, layout: str) -> str:
    """The tiny model saved at `path` rewritten as an fp8 checkpoint (`test_quant_fp8._write_fp8_checkpoint`), and
    its dequantised weights saved with the model's other files in `path`/deq for transformers. Returns that
    folder."""
    import shutil

    from safetensors.torch import save_file
    from test_quant_fp8 import _write_fp8_checkpoint

    deq_dir = os.path.join(path, "deq")
    os.makedirs(deq_dir)
    for f in os.listdir(path):  # before the config gains its quantization_config
        if f.endswith(".json"):
            shutil.copy(os.path.join(path, f), deq_dir)
    save_file(_write_fp8_checkpoint(path, layout), os.path.join(deq_dir, "model.safetensors"))
    return deq_dir


@pytest.mark.parametrize("layout", ["block", "tensor"])
def test_fp8_moe_checkpoint_loads_and_matches_transformers(tmp_path, layout: str,
                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny Qwen3-MoE fp8 checkpoint (experts, attention and all) loads into fp8 stacked experts holding exactly
    the written bytes and scales. Block-wise, with W8A16 forced for the dense layers too, the model is the
    dequantised model: greedy token-identical to transformers on those weights. Per tensor, the dense layers
    quantise their activations with the static scales, so only the experts are compared."""
    import transformers as tf
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import fp8 as fp8mod
    from radixserve.layers.quantization.fp8_moe import Fp8MoEMethod

    path = str(tmp_path)
    make_tiny_model("qwen3_moe", path, initializer_range=0.08)
    deq_dir = _write_fp8_moe_checkpoint(path, layout)
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    runner = make_runner(path)
    experts = runner.model.model.layers[0].mlp.experts
    assert isinstance(experts.quant_method, Fp8MoEMethod)
    assert experts.w13_weight.dtype == FP8 and experts.w2_weight.dtype == FP8
    names = {n for n, _ in experts.named_parameters()}
    assert names == {"w13_weight", "w2_weight", "w13_scale", "w2_scale"}, names
    from safetensors.torch import load_file

    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    sc = experts.quant_method.expert_scales(experts)
    got_up = dequantize_blocks(experts.w13_weight[3], sc.w13[3], sc.group_n, sc.group_k13)[32:]
    torch.testing.assert_close(got_up, want["model.layers.0.mlp.experts.3.up_proj.weight"], rtol=0, atol=0)
    got_down = dequantize_blocks(experts.w2_weight[5], sc.w2[5], sc.group_n, sc.group_k2)
    torch.testing.assert_close(got_down, want["model.layers.0.mlp.experts.5.down_proj.weight"], rtol=0, atol=0)
    if layout == "tensor":
        x = torch.randn(5, 64, generator=torch.Generator().manual_seed(0))
        ids = torch.tensor([[0, 3], [5, 1], [3, 7], [2, 6], [4, 0]], dtype=torch.int32)
        wts = torch.rand(5, 2, generator=torch.Generator().manual_seed(1))
        d13 = torch.stack([torch.cat([want[f"model.layers.0.mlp.experts.{x_}.{p}_proj.weight"] for p in ("gate", "up")])
                           for x_ in range(8)])
        d2 = torch.stack([want[f"model.layers.0.mlp.experts.{x_}.down_proj.weight"] for x_ in range(8)])
        torch.testing.assert_close(experts.quant_method.apply(experts, x, wts, ids),
                                   moe_forward_torch(x, d13, d2, wts, ids), atol=1e-5, rtol=1e-5)
        return
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    prompts = [[5, 17, 99, 3, 42, 7, 100, 8], [1, 2, 3]]
    for prompt, got in zip(prompts, StaticBatch(runner).generate(prompts, 8), strict=True):
        assert got == hf_greedy(hf, prompt, 8)
    assert runner.token_to_kv_pool.available_size() == runner.token_to_kv_pool.size


def test_deepseek_v3_fp8_checkpoint_matches_transformers(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny DeepSeek-V3 checkpoint in DeepSeek's fp8 layout (every projection block-wise, kv_b_proj included):
    the experts and shared experts load fp8, kv_b_proj (read as a matrix by the absorbed attention) is dequantised
    once to the model dtype, and greedy decoding is token-identical to transformers on the dequantised weights."""
    import transformers as tf
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import fp8 as fp8mod
    from radixserve.layers.quantization.base import UnquantizedLinearMethod

    path = str(tmp_path)
    make_tiny_model("deepseek_v3", path, initializer_range=0.08)
    deq_dir = _write_fp8_moe_checkpoint(path, "block")
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    runner = make_runner(path)
    attn = runner.model.model.layers[1].self_attn
    assert isinstance(attn.kv_b_proj.quant_method, UnquantizedLinearMethod)
    assert attn.kv_b_proj.weight.dtype == torch.float32 and attn.q_b_proj.weight.dtype == FP8
    from safetensors.torch import load_file

    want_w = load_file(os.path.join(deq_dir, "model.safetensors"))["model.layers.1.self_attn.kv_b_proj.weight"]
    torch.testing.assert_close(attn.kv_b_proj.weight, want_w, rtol=0, atol=0)
    assert runner.model.model.layers[1].mlp.experts.w13_weight.dtype == FP8
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    prompts = [[5, 17, 99, 3, 42, 7, 100, 8], [1, 2, 3]]
    for prompt, got in zip(prompts, StaticBatch(runner).generate(prompts, 8), strict=True):
        assert got == hf_greedy(hf, prompt, 8)


def test_online_fp8_experts_and_tp_block_scales() -> None:
    """`--quantization fp8` quantises each expert per output row; TP=2 ranks of a block-wise fp8 checkpoint hold
    their halves of the intermediate dimension's weights and scale blocks."""
    from radixserve.layers.moe.layer import FusedMoE
    from radixserve.layers.moe.router import RouterConfig
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.fp8 import Fp8Config

    e, h, i = 4, 32, 64
    w13, w2 = (w.cpu() for w in expert_weights(e, h, i, seed=8))
    online = FusedMoE(RouterConfig(num_experts=e, top_k=2), h, i, ep_size=1)
    apply_quantization(online, Fp8Config(serialized=False))
    online.weight_loader(online.w13_weight, w13)
    online.weight_loader(online.w2_weight, w2)
    finish_quantization(online)
    sc = online.quant_method.expert_scales(online)
    assert online.w13_weight.dtype == FP8 and sc.w13.shape == (e, 2 * i, 1) and sc.group_k13 == h
    torch.testing.assert_close(dequantize_blocks(online.w13_weight[2], sc.w13[2], 1, h), w13[2], atol=0.02,
                               rtol=0.07)
    full13 = {(x, s): quantize_blocks(w13[x, :i] if s == "w1" else w13[x, i:], 16, 16)
              for x in range(e) for s in ("w1", "w3")}
    full2 = {x: quantize_blocks(w2[x], 16, 16) for x in range(e)}
    for rank in range(2):
        layer = FusedMoE(RouterConfig(num_experts=e, top_k=2), h, i, tp_rank=rank, tp_size=2, ep_size=1)
        apply_quantization(layer, Fp8Config(serialized=True, weight_block_size=[16, 16]))
        params = dict(layer.named_parameters())
        for (x, s), (q, scale) in full13.items():
            params["w13_weight"].weight_loader(params["w13_weight"], q, s, x)
            params["w13_weight_scale_inv"].weight_loader(params["w13_weight_scale_inv"], scale, s, x)
        for x, (q, scale) in full2.items():
            params["w2_weight"].weight_loader(params["w2_weight"], q, "w2", x)
            params["w2_weight_scale_inv"].weight_loader(params["w2_weight_scale_inv"], scale, "w2", x)
        finish_quantization(layer)
        sc = layer.quant_method.expert_scales(layer)
        half = slice(rank * i // 2, (rank + 1) * i // 2)
        for x in range(e):
            gate = dequantize_blocks(layer.w13_weight[x], sc.w13[x], 16, 16)[: i // 2]
            ref_gate = dequantize_blocks(*full13[(x, "w1")], 16, 16)[half]
            torch.testing.assert_close(gate, ref_gate, rtol=0, atol=0)
            down = dequantize_blocks(layer.w2_weight[x], sc.w2[x], 16, 16)
            torch.testing.assert_close(down, dequantize_blocks(*full2[x], 16, 16)[:, half], rtol=0, atol=0)
    with pytest.raises(ValueError, match="multiple of the block"):
        layer = FusedMoE(RouterConfig(num_experts=e, top_k=2), h, 48, tp_rank=0, tp_size=2, ep_size=1)
        apply_quantization(layer, Fp8Config(serialized=True, weight_block_size=[16, 16]))


@pytest.mark.skipif(torch.cuda.is_available(), reason="forces the kernels on CPU tensors: Triton's interpreter only")
def test_fp8_tiles_and_precompile_of_fp8_experts() -> None:
    """W8A8 batches take the fp8 table's tiles (Qwen3-30B-A3B's shape), and `precompile` builds the fp8 variants a
    16-bit model's fp8 experts run: fp8 activations (A8) at the configs `moe_config(..., fp8=True)` picks."""
    from radixserve.layers.moe import FusedMoE, RouterConfig
    from radixserve.layers.moe.fused_moe import TUNED, TUNED_FP8, moe_config, precompile
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.fp8 import Fp8Config
    from radixserve.layers.triton_ops.launch import recording
    from radixserve.model_loader.dummy import initialize_dummy_weights

    shape = (128, 768, 2048)
    assert moe_config(256, 8, *shape, fp8=True) == TUNED_FP8[shape][256] != TUNED[shape][1024]
    assert moe_config(256, 8, *shape) == TUNED[shape][1024]
    holder = torch.nn.Module()
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)
    try:
        holder.experts = FusedMoE(RouterConfig(8, 2, renormalize=True), 128, 128, reduce_results=False, ep_size=1)
    finally:
        torch.set_default_dtype(old)
    apply_quantization(holder, Fp8Config(serialized=False))
    initialize_dummy_weights(holder, seed=3)
    finish_quantization(holder)
    assert holder.experts.w13_weight.dtype == FP8 and holder.experts.act_dtype == torch.bfloat16
    with recording() as records:
        assert precompile(holder, 16, force=True) == 1
    launches = [r for r in records if r.fn.fn.__name__ in ("_gate_up_kernel", "_down_kernel")]
    assert launches and all(r.kwargs["A8"] and r.kwargs["QUANT"] for r in launches)
    assert {r.kwargs["BLOCK_M"] for r in launches} == {moe_config(16, 2, 8, 128, 128, fp8=True).block_m}


def test_fp8_experts_leave_the_small_path_earlier(monkeypatch: pytest.MonkeyPatch) -> None:
    """fp8 experts whose grouped GEMMs run W8A8 take the small-batch kernels for fewer tokens than 16-bit ones (the
    H200's crossover: 4 tokens on the CUDA cores, per-row or block-wise scales; 1 for block-wise ones through
    `tl.dot`); W8A16 cases (float32 activations) keep the 16-bit limit; `apply` dispatches by it."""
    import radixserve.layers.moe.fused_moe as fused_mod
    from radixserve.layers.moe import FusedMoE, RouterConfig, small_batch
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.fp8 import Fp8Config
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.model_loader.dummy import initialize_dummy_weights

    def layer(dtype: torch.dtype, config: Fp8Config, hidden: int = 128) -> FusedMoE:
        holder = torch.nn.Module()
        old = torch.get_default_dtype()
        torch.set_default_dtype(dtype)
        try:
            holder.experts = FusedMoE(RouterConfig(8, 2, renormalize=True), hidden, 128, reduce_results=False,
                                      ep_size=1)
        finally:
            torch.set_default_dtype(old)
        apply_quantization(holder, config)
        if not config.serialized:
            initialize_dummy_weights(holder, seed=3)
        else:
            for name, p in holder.experts.named_parameters():
                p.data.fill_(1.0 if "scale" in name else 0.0)
        finish_quantization(holder)
        return holder.experts

    rows = layer(torch.bfloat16, Fp8Config(serialized=False))
    blocks = layer(torch.bfloat16, Fp8Config(serialized=True, weight_block_size=[128, 128]), hidden=256)
    wide = layer(torch.float32, Fp8Config(serialized=False))
    assert rows.quant_method.small_batch_tokens(rows) == small_batch.SMALL_BATCH_TOKENS_FP8 == 4
    monkeypatch.setattr(small_batch, "FP8_BLOCKS_FORM", "rows")  # the default, whatever the environment says
    assert blocks.quant_method.small_batch_tokens(blocks) == 4
    monkeypatch.setattr(small_batch, "FP8_BLOCKS_FORM", "dot")
    assert blocks.quant_method.small_batch_tokens(blocks) == small_batch.SMALL_BATCH_TOKENS_FP8_DOT == 1
    assert wide.quant_method.small_batch_tokens(wide) == small_batch.SMALL_BATCH_TOKENS == 8
    paths: list[tuple[str, int]] = []
    monkeypatch.setattr(small_batch, "small_batch_moe", lambda x, *a, **k: paths.append(("small", len(x))) or x)
    monkeypatch.setattr(fused_mod, "fused_moe", lambda x, *a, **k: paths.append(("grouped", len(x))) or x)
    set_fused_kernels(True)
    try:
        for t in (4, 5):
            x = torch.zeros(t, 128, dtype=torch.bfloat16)
            ids = torch.zeros(t, 2, dtype=torch.int32)
            rows.quant_method.apply(rows, x, torch.ones(t, 2), ids)
    finally:
        set_fused_kernels(None)
    assert paths == [("small", 4), ("grouped", 5)]


def test_dummy_weights_take_a_block_wise_checkpoints_layout(tmp_path) -> None:
    """--load-format dummy with a block-wise fp8 quantization_config (as the DeepSeek-V3 and Qwen3 FP8 releases ship):
    every linear layer and expert stack holds the dummy 16/32-bit weights quantised to the checkpoint's blocks
    (exactly what `quantize_blocks` makes of the unquantised dummy model's weights), and the model decodes."""
    import json

    from model_utils import make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.linear import _LinearBase
    from radixserve.layers.moe.layer import FusedMoE
    from radixserve.model_loader import get_model

    plain, blocks = str(tmp_path / "plain"), str(tmp_path / "blocks")
    make_tiny_model("qwen3_moe", plain)
    make_tiny_model("qwen3_moe", blocks)
    with open(os.path.join(blocks, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic",
                                  "weight_block_size": [16, 16], "ignored_layers": ["lm_head"]}
    with open(os.path.join(blocks, "config.json"), "w") as f:
        json.dump(cfg, f)
    ref = dict(get_model(ModelConfig(plain), load_format="dummy", dtype=torch.float32, device="cpu").named_modules())
    model = get_model(ModelConfig(blocks), load_format="dummy", dtype=torch.float32, device="cpu")
    linears = experts = 0
    for name, module in model.named_modules():
        if isinstance(module, _LinearBase) and module.weight.dtype == FP8:
            q, s = quantize_blocks(ref[name].weight.data, 16, 16)
            assert torch.equal(module.weight.view(torch.uint8), q.view(torch.uint8)), name
            assert torch.equal(module.weight_scale, s), name
            linears += 1
        elif isinstance(module, FusedMoE):
            sc = module.quant_method.expert_scales(module)
            assert (sc.group_n, sc.group_k13, sc.group_k2) == (16, 16, 16)
            for mine, scale, theirs in ((module.w13_weight, sc.w13, ref[name].w13_weight),
                                        (module.w2_weight, sc.w2, ref[name].w2_weight)):
                for x in range(theirs.shape[0]):
                    q, s = quantize_blocks(theirs[x].data, 16, 16)
                    assert torch.equal(mine[x].view(torch.uint8), q.view(torch.uint8)) and torch.equal(scale[x], s)
            experts += 1
    assert linears == 2 * 2 and experts == 2  # qkv_proj and o_proj a layer (MoE MLPs); the LM head as configured
    assert model.lm_head.weight.dtype == torch.float32
    out = StaticBatch(make_runner(blocks, load_format="dummy")).generate([[5, 17, 99, 3], [1, 2]], 4)
    assert [len(o) for o in out] == [4, 4]


@pytest.mark.parametrize("form,block", [("rows", None), ("rows", (16, 16)), ("dot", (16, 16))])
@pytest.mark.parametrize("chunks", [1, 2])
def test_fp8_shared_mlp_rides_along(form: str, block: tuple[int, int] | None, chunks: int,
                                    monkeypatch: pytest.MonkeyPatch) -> None:
    """An fp8 shared MLP (DeepSeek's shared experts) in the small-batch launches of fp8 experts, its scales in the
    experts' form (per row; 16 x 16 blocks on the CUDA cores or through tl.dot): the routed experts plus the shared
    MLP computed on its own, all dequantised; a scale form other than the experts' is a ValueError."""
    import torch.nn.functional as F

    from radixserve.layers.moe import small_batch

    monkeypatch.setattr(small_batch, "FP8_BLOCKS_FORM", form)
    e, h, i, t, k = 8, 64, 32, 3, 2
    q13, q2, scales, d13, d2 = fp8_experts(e, h, i, block, seed=11)
    s = chunks * i
    g = torch.Generator().manual_seed(12)
    sw13, sw2 = torch.randn(2 * s, h, generator=g) * 0.2, torch.randn(h, s, generator=g) * 0.2
    if block is None:
        (sq13, ss13), (sq2, ss2) = quantize_rows(sw13), quantize_rows(sw2)
        ss13, ss2 = ss13.reshape(-1, 1), ss2.reshape(-1, 1)
    else:
        (sq13, ss13), (sq2, ss2) = quantize_blocks(sw13, *block), quantize_blocks(sw2, *block)
    gn, gk = block if block is not None else (1, None)
    dsw13 = dequantize_blocks(sq13, ss13, gn, gk or h)
    dsw2 = dequantize_blocks(sq2, ss2, gn, gk or s)
    x = torch.randn(t, h, generator=torch.Generator().manual_seed(13))
    ids = skewed_ids(t, k, e)
    weights = torch.rand(t, k, generator=torch.Generator().manual_seed(14))
    gu = F.linear(x, dsw13)
    ref = moe_forward_torch(x.to(DEVICE), d13, d2, weights.to(DEVICE), ids.to(DEVICE)).cpu() + \
        F.linear(F.silu(gu[:, :s]) * gu[:, s:], dsw2)
    dev = [v.to(DEVICE) for v in (x, weights, ids, sq13, sq2, ss13, ss2)]
    x_d, w_d, ids_d, sq13_d, sq2_d, ss13_d, ss2_d = dev
    for cfg in (None, SmallMoEConfig(16, 32, 16, 32, 1, 1)):
        got = small_batch_moe(x_d, q13, q2, w_d, ids_d, shared_w13=sq13_d, shared_w2=sq2_d, scales=scales,
                              shared_scales=(ss13_d, ss2_d), config=cfg)
        torch.testing.assert_close(got.cpu(), ref, atol=1e-4, rtol=1e-4)
    with pytest.raises(ValueError, match="shared"):  # fp8 shared weights without their scales
        small_batch_moe(x_d, q13, q2, w_d, ids_d, shared_w13=sq13_d, shared_w2=sq2_d, scales=scales)
    with pytest.raises(ValueError, match="shared gate_up scales"):  # another form than the experts'
        small_batch_moe(x_d, q13, q2, w_d, ids_d, shared_w13=sq13_d, shared_w2=sq2_d, scales=scales,
                        shared_scales=(ss13_d[:1], ss2_d))


@pytest.mark.skipif(torch.cuda.is_available(), reason="forces the kernels on CPU tensors: Triton's interpreter only")
@pytest.mark.parametrize("block", [None, [16, 16]])
def test_deepseek_fp8_shared_experts_fold_into_the_experts_launch(tmp_path, block: list[int] | None) -> None:
    """A DeepSeek MoE layer with fp8 experts and fp8 shared experts (online per row, or dummy weights in a
    block-wise checkpoint's layout): on the kernels' path a one-token batch computes the shared MLP in the
    experts' launches, equal to adding it on its own (the fold turned off)."""
    import json

    from model_utils import make_tiny_model

    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.model_loader import get_model

    make_tiny_model("deepseek_v2", str(tmp_path))
    if block is not None:
        with open(tmp_path / "config.json") as f:
            cfg = json.load(f)
        cfg["quantization_config"] = {"quant_method": "fp8", "activation_scheme": "dynamic", "weight_block_size": block}
        with open(tmp_path / "config.json", "w") as f:
            json.dump(cfg, f)
    model = get_model(ModelConfig(str(tmp_path)), load_format="dummy" if block else "auto", dtype=torch.float32,
                      device="cpu", quantization="fp8")
    moe = model.model.layers[1].mlp
    x = torch.randn(1, 64, generator=torch.Generator().manual_seed(0))
    set_fused_kernels(True)
    try:
        shared = moe.experts.folded_shared_weights(x)
        assert shared is not None and shared.s13 is not None and shared.w13.dtype == FP8
        assert shared.s13.shape == ((64, 1) if block is None else (4, 4))
        folded = moe(x)
        with moe.experts.shared_fold_off():
            assert moe.experts.folded_shared_weights(x) is None
            alone = moe(x)
        assert moe.experts.folded_shared_weights(torch.randn(9, 64)) is None  # past the small-batch limit
    finally:
        set_fused_kernels(None)
    torch.testing.assert_close(folded, alone, atol=1e-4, rtol=1e-4)
