"""The families added with Llama 4 .. dots.llm1 where they meet the engine's other features, on each family's tiny
model (its test module's builder): online fp8 (`--quantization fp8`), dummy weights under TP=2, LoRA on the
families whose q/k rows are laid out at load, and expert parallelism (integration).

fp8 oracle: a tiny random model's logits are chaotic under 2-3 % weight noise (a flipped expert choice moves the
logits of the MoE ones by 60-100 %), so a bound on the fp8 logits against the 16-bit ones would be either loose or
flaky. Instead: every quantized weight dequantises to its 16-bit weight within fp8's rounding (per row scale
amax / 448; e4m3 keeps 3 mantissa bits, a relative rounding error of at most 1/16 an element, about 2.5 % RMS), and
the fp8 model's logits equal (to float32 rounding) those of the 16-bit model given the dequantised weights: the CPU
runs the dequantising reference with 16-bit activations (W8A16) for at most SMALL_M rows. Together they show that
each layer is quantized where it lies (the q/k row layout, DBRX's split Wqkv, stacked experts) and that the forward
runs every family step (clip_qkv, the norms, the input-weighted experts, the biased LM head) on those weights."""

from __future__ import annotations

from collections.abc import Callable

import pytest
import torch
from model_utils import make_runner

from radixserve.bench_one_batch import StaticBatch

PROMPT = [5, 17, 42, 99, 3, 200, 7, 8, 9, 10, 11, 12, 13, 14]  # 14 rows: at most SMALL_M (the W8A16 product)
LORA_PROMPTS = [[5, 17, 42, 99, 3, 200, 7, 8], [1, 2, 3]]
STEPS = 5


def _builders() -> dict[str, Callable[[str], torch.nn.Module]]:
    import test_arcee
    import test_dbrx
    import test_dots1
    import test_exaone4
    import test_granitemoe
    import test_hunyuan
    import test_llama4
    import test_minimax_m2
    import test_nemotron
    import test_olmoe
    import test_phimoe
    import test_qwen3_next
    import test_seed_oss
    import test_starcoder2

    return {"llama4": test_llama4.llama4, "minimax_m2": test_minimax_m2.minimax, "seed_oss": test_seed_oss.seed_oss,
            "exaone4": test_exaone4.exaone, "granitemoe": lambda p: test_granitemoe.granite_moe("granitemoe", p),
            "granitemoeshared": lambda p: test_granitemoe.granite_moe("granitemoeshared", p),
            "hunyuan_moe": test_hunyuan.hunyuan, "hunyuan_dense": lambda p: test_hunyuan.hunyuan(p, moe=False),
            "phimoe": test_phimoe.phimoe, "starcoder2": test_starcoder2.starcoder2,
            "nemotron": test_nemotron.nemotron, "arcee": test_arcee.arcee, "olmoe": test_olmoe.olmoe,
            "dbrx": test_dbrx.dbrx, "dots1": test_dots1.dots1,
            "qwen3_next": test_qwen3_next.hybrid, "qwen3_5": lambda p: test_qwen3_next.hybrid(p, "qwen3_5")}


FAMILIES = ["llama4", "minimax_m2", "seed_oss", "exaone4", "granitemoe", "granitemoeshared", "hunyuan_moe",
            "hunyuan_dense", "phimoe", "starcoder2", "nemotron", "arcee", "olmoe", "dbrx", "dots1"]


def build(family: str, path: str) -> None:
    _builders()[family](path)


def last_logits(runner: object) -> torch.Tensor:
    sb = StaticBatch(runner)
    batch, _ = sb.prefill([PROMPT])
    out = sb.last_logits.next_token_logits.float().clone()
    sb.release(batch)
    return out


def _dequantised(q: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """An fp8 linear weight [N, K] with per-row scales [N], or stacked experts [E, N, K] with [E, N, 1]."""
    from radixserve.layers.quantization.fp8 import dequantize_blocks

    if q.dim() == 3:
        return torch.stack([dequantize_blocks(q[e], scale[e].reshape(-1), 1, q.shape[2]) for e in range(q.shape[0])])
    return dequantize_blocks(q, scale, 1, q.shape[1])


_FP8_WEIGHTS = (("weight", "weight_scale"), ("w13_weight", "w13_scale"), ("w2_weight", "w2_scale"))


@pytest.mark.parametrize("family", [*FAMILIES, "qwen3_next", "qwen3_5"])  # (and the hybrid Qwen models)
def test_online_fp8_is_the_model_with_dequantised_weights(family: str, tmp_path) -> None:  # noqa: ANN001
    from radixserve.layers.moe import MoEGate
    from radixserve.layers.quantization.fp8 import FP8

    path = str(tmp_path)
    build(family, path)
    fp8, oracle = make_runner(path, quantization="fp8"), make_runner(path)  # (oracle: no forward before the copy)
    plain = dict(oracle.model.named_modules())
    quantized = 0
    for name, module in fp8.model.named_modules():
        if isinstance(module, MoEGate):  # routers stay 16/32-bit
            assert module.weight.dtype != FP8, name
        for leaf, scale_leaf in _FP8_WEIGHTS:
            w = getattr(module, leaf, None)
            if not isinstance(w, torch.Tensor) or w.dtype != FP8:
                continue
            target = getattr(plain[name], leaf)
            deq = _dequantised(w.data, getattr(module, scale_leaf).data)
            assert deq.shape == target.shape, f"{name}.{leaf}"
            err = float((deq - target).norm() / target.norm())
            assert err < 0.04, f"{name}.{leaf}: dequantised fp8 weight {err:.3f} off the 16-bit one"
            target.data.copy_(deq)
            quantized += 1
    assert quantized >= 4 * oracle.model_config.hf_config.num_hidden_layers // 2
    got, want = last_logits(fp8), last_logits(oracle)
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4 * float(want.abs().max()))


@pytest.mark.parametrize("family", FAMILIES)
def test_dummy_weights_do_not_depend_on_the_tp_split(family: str, tmp_path) -> None:  # noqa: ANN001
    """Every parameter of each TP=2 rank built with dummy weights is its slice of the TP=1 dummy model's: held whole
    by both, split along one dim, q/k/v split per section (KV heads possibly replicated), gate/up halves split, or a
    row-parallel bias on rank 0 only."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
    from radixserve.model_loader.dummy import initialize_dummy_weights
    from radixserve.models.registry import get_model_class

    path = str(tmp_path)
    build(family, path)
    cfg = ModelConfig(path).hf_config
    cls = get_model_class(cfg.architectures)
    models = []
    for rank, size in ((0, 1), (0, 2), (1, 2)):
        model = cls(cfg, rank, size)
        initialize_dummy_weights(model)
        models.append(model)
    whole, rank0, rank1 = (dict(m.named_parameters()) for m in models)
    modules = dict(models[1].named_modules())

    def is_slice(name: str, w: torch.Tensor, a: torch.Tensor, b: torch.Tensor) -> bool:
        module = modules[name.rsplit(".", 1)[0]]
        if torch.equal(a, w) and torch.equal(b, w):
            return True
        if isinstance(module, RowParallelLinear) and w.dim() == 1:
            return torch.equal(a, w) and not b.any()
        if isinstance(module, QKVParallelLinear):
            q, kv = module.num_heads * module.head_dim, module.num_kv_heads * module.head_dim
            wq, wkv = w.split([2 * q, w.shape[0] - 2 * q])
            (aq, ak, av), (bq, bk, bv) = a.split([q, kv, kv]), b.split([q, kv, kv])
            wk, wv = wkv.chunk(2)
            return torch.equal(torch.cat([aq, bq]), wq) and all(
                torch.equal(torch.cat([x, y]), full) or (torch.equal(x, full) and torch.equal(y, full))
                for x, y, full in ((ak, bk, wk), (av, bv, wv)))
        if isinstance(module, MergedColumnParallelLinear) or name.endswith(("w13_weight", "w13_bias")):
            d = 0 if isinstance(module, MergedColumnParallelLinear) else 1
            return all(torch.equal(torch.cat([x, y], d), full)
                       for x, y, full in zip(a.chunk(2, d), b.chunk(2, d), w.chunk(2, d), strict=True))
        return any(a.shape[d] * 2 == w.shape[d] and torch.equal(torch.cat([a, b], d), w) for d in range(w.dim()))

    bad = [n for n, w in whole.items() if not is_slice(n, w.data, rank0[n].data, rank1[n].data)]
    assert not bad, f"{family}: TP=2 dummy parameters that are not their slice of TP=1's: {bad}"


@pytest.mark.parametrize("family", ["llama4", "minimax_m2", "nemotron"])
def test_qkvo_lora_matches_transformers_peft(family: str, tmp_path) -> None:  # noqa: ANN001
    """q/k rows laid out at load (interleaved pairs, partial rotation): the adapter's q/k B rows are laid out too
    (`lora_b_layout`), so the tokens are transformers + PEFT's."""
    from lora_utils import make_adapter, peft_greedy
    from test_lora import submit_lora
    from test_scheduler import drain, make_scheduler

    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    build(family, base)
    make_adapter(base, adapter, 4, 8, False, ["q_proj", "k_proj", "v_proj", "o_proj"], seed=3)
    want = peft_greedy(base, adapter, LORA_PROMPTS, STEPS)
    assert want != peft_greedy(base, None, LORA_PROMPTS, STEPS)
    s = make_scheduler(base, lora_paths=[f"a={adapter}"])
    for i, prompt in enumerate(LORA_PROMPTS):
        submit_lora(s, str(i), prompt, STEPS, "a")
    res = drain(s)
    assert [res[str(i)]["ids"] for i in range(len(LORA_PROMPTS))] == want


def test_llama4_dense_mlp_lora_matches_transformers_peft(tmp_path) -> None:  # noqa: ANN001
    """Llama 4 names its MLP `feed_forward`: an adapter on its dense layers' gate/up/down (PEFT targets given as
    dotted suffixes, "feed_forward.down_proj", which leave the MoE layers' shared experts alone) and q_proj gives
    transformers + PEFT's tokens."""
    from lora_utils import make_adapter, peft_greedy
    from test_lora import submit_lora
    from test_scheduler import drain, make_scheduler

    base, adapter = str(tmp_path / "base"), str(tmp_path / "adapter")
    build("llama4", base)
    make_adapter(base, adapter, 4, 8, False, ["q_proj", "feed_forward.gate_proj", "feed_forward.up_proj",
                                              "feed_forward.down_proj"], seed=3)
    want = peft_greedy(base, adapter, LORA_PROMPTS, STEPS)
    assert want != peft_greedy(base, None, LORA_PROMPTS, STEPS)
    s = make_scheduler(base, lora_paths=[f"a={adapter}"])
    for i, prompt in enumerate(LORA_PROMPTS):
        submit_lora(s, str(i), prompt, STEPS, "a")
    res = drain(s)
    assert [res[str(i)]["ids"] for i in range(len(LORA_PROMPTS))] == want


def test_lora_on_modules_a_family_lacks_is_refused(tmp_path) -> None:  # noqa: ANN001
    """The ungated MLP's up_proj (no gate_up_proj to carry it) and StarCoder2's c_fc are refused by name."""
    from lora_utils import make_adapter
    from test_scheduler import make_scheduler

    for family, targets, match in (("nemotron", ["up_proj", "down_proj"], "no LoRA layer for it"),
                                   ("starcoder2", ["c_fc"], "c_fc not supported")):
        base, adapter = str(tmp_path / family), str(tmp_path / f"{family}-adapter")
        build(family, base)
        make_adapter(base, adapter, 4, 8, False, targets, seed=3)
        with pytest.raises(ValueError, match=match):
            make_scheduler(base, lora_paths=[f"a={adapter}"])


@pytest.mark.integration
@pytest.mark.parametrize("family", ["dbrx", "llama4", "granitemoeshared", "phimoe"])
def test_expert_parallel_matches_tp1(family: str, tmp_path) -> None:  # noqa: ANN001
    """--ep-size 2 (each rank holds half the experts whole) through the families' own expert loaders: DBRX's
    per-expert w1 / v1 / w2 slices, Llama 4's transposed stack, Granite's fused input_linear, Phi-MoE's stack."""
    from parallel_utils import tp2_and_tp1_outputs

    path = str(tmp_path)
    build(family, path)
    got, want = tp2_and_tp1_outputs(path, [PROMPT, [1, 2, 3]], max_new_tokens=6, ep_size=2)
    assert got == want
