"""4-bit weight-only checkpoints: GPTQ (plain and activation order, v1 and v2 zeros), AWQ (GEMM layout) and
compressed-tensors W4A16. The checkpoints are packed here word by word from the formats' descriptions (not with
the code under test), loaded, and checked against the dequantised weights: exact layer weights, the Triton GEMV
and dequantising kernels under the interpreter, greedy token identity with transformers on the dequantised model,
TP sharding, and the configurations that are refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers.quantization import int4_formats as F4
from radixserve.layers.quantization import resolve_quant_config
from radixserve.model_loader import get_model

PROMPTS = [[5, 17, 99, 3, 42, 7, 100, 8], [1, 2, 3]]
AWQ_ORDER = [0, 2, 4, 6, 1, 3, 5, 7]
METHOD = {"gptq": "gptq", "gptq_v2": "gptq", "awq": "awq", "ct": "compressed-tensors"}  # keeps them packed on CPU


def _word(values: list[int], bits: int = 4) -> int:
    """32 / bits values as one int32, the first in the lowest bits."""
    w = sum((v & ((1 << bits) - 1)) << (bits * i) for i, v in enumerate(values))
    return w - (1 << 32) if w >= 1 << 31 else w


def pack_gptq(q: torch.Tensor, zeros: torch.Tensor, v2: bool = False, bits: int = 4,
              ) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K], zeros [N, K/G] -> GPTQ qweight [K*bits/32, N] (along K), qzeros [K/G, N*bits/32] (along N,
    zero - 1)."""
    n, k = q.shape
    per = 32 // bits
    qweight = torch.tensor([[_word(q[c, per * i:per * i + per].tolist(), bits) for c in range(n)]
                            for i in range(k // per)], dtype=torch.int32)
    z = zeros if v2 else zeros - 1
    qzeros = torch.tensor([[_word(z[per * c:per * c + per, g].tolist(), bits) for c in range(n // per)]
                           for g in range(zeros.shape[1])], dtype=torch.int32)
    return qweight, qzeros


def pack_awq(q: torch.Tensor, zeros: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """q [N, K], zeros [N, K/G] -> AWQ qweight [K, N/8], qzeros [K/G, N/8]: value i of a word is column
    8c + AWQ_ORDER[i]."""
    def along_n(t: torch.Tensor) -> torch.Tensor:  # t [R, N]
        return torch.tensor([[_word([int(t[r, 8 * c + AWQ_ORDER[i]]) for i in range(8)])
                              for c in range(t.shape[1] // 8)] for r in range(t.shape[0])], dtype=torch.int32)
    return along_n(q.t()), along_n(zeros.t())


def pack_ct(q: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """q [N, K] (stored value = signed value + 2^(bits-1)) -> compressed-tensors weight_packed [N, K*bits/32]."""
    n, k = q.shape
    per = 32 // bits
    return torch.tensor([[_word(q[r, per * c:per * c + per].tolist(), bits) for c in range(k // per)]
                         for r in range(n)], dtype=torch.int32)


def _rtn(w: torch.Tensor, group: int, sym: bool, bits: int = 4,
         ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """(q [N, K] int64, zeros [N, K/G] int64, scales fp16 [N, K/G], the dequantised float32 weight)."""
    n, k = w.shape
    top = (1 << bits) - 1
    g = w.reshape(n, k // group, group)
    if sym:
        s = (g.abs().amax(-1) / (top / 2)).half().float()
        z = torch.full_like(s, 1 << (bits - 1))
    else:
        lo, hi = g.amin(-1).clamp(max=0), g.amax(-1).clamp(min=0)
        s = ((hi - lo) / top).half().float()
        z = (-lo / s).round().clamp(0, top)
    q = (g / s[..., None] + z[..., None]).round().clamp(0, top)
    deq = ((q - z[..., None]) * s[..., None]).reshape(n, k)
    return q.reshape(n, k).long(), z.long(), s.half(), deq


# ---------------------------------------------------------------- formats
def test_checkpoint_packings_convert_to_our_layout() -> None:
    g = torch.Generator().manual_seed(0)
    n, k, group = 16, 64, 32
    q = torch.randint(0, 16, (n, k), generator=g)
    zeros = torch.randint(1, 16, (n, k // group), generator=g)
    scales = torch.rand(n, k // group, generator=g).half()
    ref = (q - zeros.repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    qw, qz = pack_gptq(q, zeros)
    got = F4.dequantize(F4.gptq_qweight(qw), F4.group_transpose(scales.t()), F4.gptq_qzeros(qz))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    qw, qz = pack_awq(q, zeros)
    got = F4.dequantize(F4.awq_qweight(qw), F4.group_transpose(scales.t()), F4.awq_qzeros(qz))
    torch.testing.assert_close(got, ref, rtol=0, atol=0)
    eights = torch.full_like(zeros, 8).to(torch.uint8)
    got = F4.dequantize(F4.ct_weight_packed(pack_ct(q)), scales, eights)
    torch.testing.assert_close(got, (q - 8) * scales.float().repeat_interleave(group, 1), rtol=0, atol=0)
    assert torch.equal(F4.unpack_pairs(F4.pack_pairs(q.to(torch.uint8))), q.to(torch.uint8))
    words = torch.randint(-(1 << 31), 1 << 31, (3, 5), generator=g, dtype=torch.int64).to(torch.int32)
    assert torch.equal(F4.pack_words(F4.unpack_words(words)), words)
    assert torch.equal(F4.pack_words(F4.unpack_words(words, 8), 8), words)
    # 8 bits: GPTQ (four values a word, zero - 1) and compressed-tensors (plus 128)
    q8 = torch.randint(0, 256, (n, k), generator=g)
    z8 = torch.randint(1, 256, (n, k // group), generator=g)
    ref8 = (q8 - z8.repeat_interleave(group, 1)) * scales.float().repeat_interleave(group, 1)
    qw, qz = pack_gptq(q8, z8, bits=8)
    got = F4.dequantize(F4.gptq_qweight(qw, 8), F4.group_transpose(scales.t()), F4.gptq_qzeros(qz, 8), 8)
    torch.testing.assert_close(got, ref8, rtol=0, atol=0)
    got = F4.dequantize(F4.ct_weight_packed(pack_ct(q8, 8), 8), scales, torch.full_like(zeros, 128).to(torch.uint8),
                        8)
    torch.testing.assert_close(got, (q8 - 128) * scales.float().repeat_interleave(group, 1), rtol=0, atol=0)
    with pytest.raises(ValueError, match="int32"):
        F4.unpack_words(words.to(torch.int64))


# ---------------------------------------------------------------- kernels (the interpreter)
@pytest.mark.parametrize("m,n,k,group,dtype,bits", [(1, 40, 96, 32, torch.float32, 4),
                                                    (3, 17, 256, 128, torch.float32, 4),
                                                    (2, 24, 200, 200, torch.float16, 4),
                                                    (8, 33, 64, 16, torch.float16, 4),
                                                    (2, 24, 192, 64, torch.float32, 8),
                                                    (5, 9, 100, 100, torch.float16, 8)])
def test_int4_kernels_match_reference(m: int, n: int, k: int, group: int, dtype: torch.dtype, bits: int) -> None:
    """(bf16 runs on the GPU only: the interpreter rounds float32 to bf16 otherwise than the hardware does.)"""
    from radixserve.layers.quantization.int4_kernels import int4_dequantize, int4_gemv

    g = torch.Generator().manual_seed(m * 7 + n)
    top = 1 << bits
    q = torch.randint(0, top, (n, k), generator=g).to(torch.uint8)
    qweight = F4.to_layout(q, bits)
    zeros = torch.randint(0, top, (n, k // group), generator=g).to(torch.uint8)
    scales = (torch.rand(n, k // group, generator=g) * 0.1 / (top // 16)).half()
    x = torch.randn(m, k, generator=g).to(dtype)
    bias = torch.randn(n, generator=g).to(dtype)
    w = F4.dequantize(qweight, scales, zeros, bits).to(dtype)
    torch.testing.assert_close(int4_dequantize(qweight, scales, zeros, k, dtype, bits), w, rtol=0, atol=0)
    ref = (x.float() @ w.float().t() + bias.float()).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(int4_gemv(x, qweight, scales, zeros, bias, bits), ref, **tol)
    with pytest.raises(ValueError, match="at most"):
        int4_gemv(torch.zeros(9, k, dtype=dtype), qweight, scales, zeros, bits=bits)
    with pytest.raises(ValueError, match="do not describe"):
        int4_gemv(x, qweight, scales, zeros, bits=12 - bits)  # the other width


# ---------------------------------------------------------------- checkpoints
def write_int4_checkpoint(path: str, fmt: str, group: int = 32, desc_act: bool = False, bits: int = 4,
                          actorder: str | None = None) -> str:
    """Rewrite the tiny model saved at `path` in `fmt` (gptq, gptq_v2, awq, ct): every layer projection 4-bit; the
    dequantised weights go with the other files to `path`/deq. Activation order (gptq): one random permutation
    of the input columns per input (q/k/v share theirs, as do gate/up)."""
    from safetensors.torch import load_file, save_file

    deq_dir = os.path.join(path, "deq")
    os.makedirs(deq_dir)
    for f in os.listdir(path):
        if f.endswith(".json"):
            shutil.copy(os.path.join(path, f), deq_dir)
    out, deq, orders = {}, {}, {}
    gen = torch.Generator().manual_seed(3)
    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        t = t.float()
        if not (".layers." in name and name.endswith(("proj.weight", "proj_with_mqa.weight"))):
            out[name] = deq[name] = t
            continue
        base = name[: -len("weight")]
        sym = fmt in ("gptq", "ct")
        n, k = t.shape
        cols = torch.arange(k)
        if desc_act:  # columns quantised in a permuted order: g_idx[k] = the group of column k
            proj = name.rsplit(".", 2)[-2]
            shared = {"q_proj": "qkv", "k_proj": "qkv", "v_proj": "qkv", "gate_proj": "gate_up", "up_proj": "gate_up"}
            key = (name.split(".layers.")[1].split(".")[0], shared.get(proj, proj))
            if key not in orders:
                orders[key] = torch.randperm(k, generator=gen)
            cols = orders[key]
        q, z, s, d = _rtn(t[:, cols], group, sym, bits)  # quantised in that order
        inv = torch.argsort(cols)
        deq[name] = d[:, inv]
        q = q[:, inv]
        g_idx = (inv // group).to(torch.int32)  # column c sits at position inv[c] of the order
        if fmt in ("gptq", "gptq_v2"):
            qw, qz = pack_gptq(q, z, v2=fmt == "gptq_v2", bits=bits)
            out.update({base + "qweight": qw, base + "qzeros": qz, base + "scales": s.t().contiguous(),
                        base + "g_idx": g_idx})
            if base + "bias" not in out:  # older GPTQ exports: a zero bias on every quantized layer
                out[base + "bias"] = torch.zeros(n)
        elif fmt == "awq":
            qw, qz = pack_awq(q, z)
            out.update({base + "qweight": qw, base + "qzeros": qz, base + "scales": s.t().contiguous()})
        else:
            out.update({base + "weight_packed": pack_ct(q, bits), base + "weight_scale": s.float(),
                        base + "weight_shape": torch.tensor([n, k])})
    save_file(out, os.path.join(path, "model.safetensors"))
    save_file(deq, os.path.join(deq_dir, "model.safetensors"))
    if fmt == "ct":
        qc = {"quant_method": "compressed-tensors", "format": "pack-quantized", "quantization_status": "compressed",
              "ignore": ["lm_head"], "config_groups": {"group_0": {
                  "targets": ["Linear"], "input_activations": None, "weights": {
                      "num_bits": bits, "type": "int", "symmetric": True, "strategy": "group", "group_size": group,
                      "actorder": actorder, "dynamic": False}}}}
    elif fmt == "awq":
        qc = {"quant_method": "awq", "bits": 4, "group_size": group, "zero_point": True, "version": "gemm"}
    else:
        qc = {"quant_method": "gptq", "bits": bits, "group_size": group, "sym": True, "desc_act": desc_act,
              "checkpoint_format": fmt}
    from model_utils import set_quantization_config

    set_quantization_config(path, qc)
    return deq_dir


@pytest.mark.parametrize("fmt,desc_act,bits", [("gptq", False, 4), ("gptq", True, 4), ("gptq_v2", False, 4),
                                               ("awq", False, 4), ("ct", False, 4), ("gptq", True, 8),
                                               ("ct", False, 8)])
def test_int4_checkpoint_matches_transformers(tmp_path, fmt: str, desc_act: bool, bits: int) -> None:
    """Each format loads to exactly the dequantised weights (read back through the layer's own layout, the
    activation order undone) and the model is greedy token-identical to transformers on them."""
    import transformers as tf
    from model_utils import hf_greedy, make_runner, make_tiny_model
    from safetensors.torch import load_file

    from radixserve.bench_one_batch import StaticBatch

    path = str(tmp_path)
    make_tiny_model("qwen2" if fmt == "awq" else "llama", path)  # qwen2: biased q/k/v
    deq_dir = write_int4_checkpoint(path, fmt, desc_act=desc_act, bits=bits)
    runner = make_runner(path, quantization=METHOD[fmt])
    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    for layer, parts in ((runner.model.model.layers[0].self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                         (runner.model.model.layers[1].mlp.gate_up_proj, ("gate_proj", "up_proj"))):
        sub = "self_attn" if "q_proj" in parts else "mlp"
        idx = 0 if sub == "self_attn" else 1
        assert layer.qweight.dtype == torch.uint8 and layer.qweight.shape[1] == 64 * bits // 8
        w = F4.dequantize(layer.qweight, layer.scales, layer.qzeros, bits)
        assert (layer.perm is not None) == desc_act
        if desc_act:
            w = w[:, torch.argsort(layer.perm)]
        torch.testing.assert_close(w, torch.cat([want[f"model.layers.{idx}.{sub}.{p}.weight"] for p in parts]),
                                   rtol=0, atol=0)
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, StaticBatch(runner).generate(PROMPTS, 8), strict=True):
        assert got == hf_greedy(hf, prompt, 8)
    assert runner.token_to_kv_pool.available_size() == runner.token_to_kv_pool.size


@pytest.mark.parametrize("actorder", ["weight", "static"])
def test_ct_w4a16_weight_actorder_is_the_plain_layout(tmp_path, actorder: str) -> None:
    """llm-compressor's GPTQ with actorder "weight" (the value compressed-tensors writes; "static" is its alias)
    orders the columns during calibration only: the checkpoint has no weight_g_idx and loads as a plain W4A16
    one."""
    from model_utils import make_tiny_model
    from safetensors.torch import load_file

    path = str(tmp_path)
    make_tiny_model("llama", path)
    deq_dir = write_int4_checkpoint(path, "ct", actorder=actorder)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    down = model.model.layers[1].mlp.down_proj
    torch.testing.assert_close(down.weight, want["model.layers.1.mlp.down_proj.weight"], rtol=0, atol=0)


@pytest.mark.parametrize("kind,fmt,desc_act", [("qwen3_moe", "gptq", True), ("qwen2_moe", "awq", False),
                                               ("deepseek_v2", "ct", False)])
def test_int4_moe_checkpoints_dequantise_their_experts(tmp_path, kind: str, fmt: str, desc_act: bool) -> None:
    """MoE checkpoints in the 4-bit formats: the linear layers stay 4-bit, the experts are dequantised once loaded
    (each by its own g_idx) into the model dtype, exactly; Qwen2-MoE's one-row shared_expert_gate stays 16-bit as
    the quantisers leave it; MLA's kv_b_proj is dequantised once. Greedy token-identical to transformers on the
    dequantised weights."""
    import transformers as tf
    from model_utils import hf_greedy, make_runner, make_tiny_model
    from safetensors.torch import load_file

    from radixserve.bench_one_batch import StaticBatch

    path = str(tmp_path)
    make_tiny_model(kind, path, initializer_range=0.08)
    deq_dir = write_int4_checkpoint(path, fmt, group=16, desc_act=desc_act)
    runner = make_runner(path, quantization=METHOD[fmt])
    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    li = next(i for i, layer in enumerate(runner.model.model.layers) if hasattr(layer.mlp, "experts"))
    experts = runner.model.model.layers[li].mlp.experts
    assert experts.w13_weight.dtype == torch.float32
    assert {n for n, _ in experts.named_parameters()} == {"w13_weight", "w2_weight"}
    inter = experts.inter_per_rank
    torch.testing.assert_close(experts.w13_weight[3, inter:], want[f"model.layers.{li}.mlp.experts.3.up_proj.weight"],
                               rtol=0, atol=0)
    torch.testing.assert_close(experts.w2_weight[1], want[f"model.layers.{li}.mlp.experts.1.down_proj.weight"],
                               rtol=0, atol=0)
    if kind == "deepseek_v2":
        attn = runner.model.model.layers[li].self_attn
        torch.testing.assert_close(attn.kv_b_proj.weight, want[f"model.layers.{li}.self_attn.kv_b_proj.weight"],
                                   rtol=0, atol=0)
    else:
        assert runner.model.model.layers[li].self_attn.o_proj.qweight.dtype == torch.uint8
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, StaticBatch(runner).generate(PROMPTS, 8), strict=True):
        assert got == hf_greedy(hf, prompt, 8)


def test_int4_layers_are_dequantised_once_on_the_cpu_by_default(tmp_path) -> None:
    """Without --quantization the CPU dequantises each 4-bit layer once loaded (the same products, no per-step
    dequantisation); the weights equal the checkpoint's dequantised ones, activation order undone."""
    from model_utils import make_tiny_model
    from safetensors.torch import load_file

    from radixserve.layers.quantization.base import UnquantizedLinearMethod

    path = str(tmp_path)
    make_tiny_model("llama", path)
    deq_dir = write_int4_checkpoint(path, "gptq", desc_act=True)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    layer = model.model.layers[0].self_attn.qkv_proj
    assert isinstance(layer.quant_method, UnquantizedLinearMethod) and not hasattr(layer, "qweight")
    torch.testing.assert_close(layer.weight, torch.cat([want[f"model.layers.0.self_attn.{p}_proj.weight"]
                                                        for p in "qkv"]), rtol=0, atol=0)
    assert resolve_quant_config(None, {"quant_method": "gptq", "bits": 4, "group_size": 32},
                                packed_default=False).packed is False
    assert resolve_quant_config("gptq", {"quant_method": "gptq", "bits": 4, "group_size": 32},
                                packed_default=False).packed is True


@pytest.mark.skipif(torch.cuda.is_available(), reason="forces the kernels on CPU tensors: Triton's interpreter only")
@pytest.mark.parametrize("rows", [1, 12])
def test_int4_layers_through_the_kernels(tmp_path, rows: int) -> None:
    """The GPU path (the GEMV up to 8 rows, the dequantised buffer above) on a loaded activation-order GPTQ layer
    equals the CPU reference."""
    from model_utils import make_tiny_model

    from radixserve.layers.triton_ops import set_fused_kernels

    path = str(tmp_path)
    make_tiny_model("llama", path)
    write_int4_checkpoint(path, "gptq", desc_act=True)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu", quantization="gptq")
    layer = model.model.layers[0].self_attn.qkv_proj
    x = torch.randn(rows, 64, generator=torch.Generator().manual_seed(rows))
    ref = layer(x)
    set_fused_kernels(True)
    try:
        got = layer(x)
    finally:
        set_fused_kernels(None)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)


def test_int4_tensor_parallel_shards() -> None:
    """TP=2 ranks of GPTQ layers (column- and row-parallel) hold their rows / whole groups of columns (and their
    columns' g_idx, renumbered from their first group): the outputs concatenate, the partial sums add up to the
    single rank's."""
    from radixserve.layers.linear import QKVParallelLinear, RowParallelLinear
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.int4 import Int4Config

    gen = torch.Generator().manual_seed(4)
    cfg = Int4Config("gptq", 16, sym=False)
    mats = {"q": torch.randn(64, 64, generator=gen), "k": torch.randn(32, 64, generator=gen),
            "v": torch.randn(32, 64, generator=gen), None: torch.randn(64, 96, generator=gen)}
    packed = {}
    for sid, w in mats.items():
        q, z, s, _ = _rtn(w, 16, False)
        qw, qz = pack_gptq(q, z)
        packed[sid] = {"qweight": qw, "qzeros": qz, "scales": s.t().contiguous(),
                       "g_idx": (torch.arange(w.shape[1]) // 16).to(torch.int32)}  # plain order, as saved

    def build(rank: int, size: int) -> tuple[QKVParallelLinear, RowParallelLinear]:
        qkv, down = QKVParallelLinear(64, 16, 4, 2, True, rank, size), RowParallelLinear(96, 64, False, rank, size)
        for layer, sids in ((qkv, "qkv"), (down, [None])):
            apply_quantization(layer, cfg)
            for sid in sids:
                for name, t in packed[sid].items():
                    getattr(layer, name).weight_loader(getattr(layer, name), t, sid)
            if layer.bias is not None:
                for sid, rows in (("q", 64), ("k", 32), ("v", 32)):
                    layer.bias.weight_loader(layer.bias, torch.arange(rows, dtype=torch.float32) / rows, sid)
            finish_quantization(layer)
        return qkv, down

    whole, r0, r1 = build(0, 1), build(0, 2), build(1, 2)
    x = torch.randn(3, 96, generator=gen)
    out = whole[0](x[:, :64]).split(whole[0].output_sizes, dim=1)
    parts = [r[0](x[:, :64]).split(r[0].output_sizes, dim=1) for r in (r0, r1)]
    for i, chunk in enumerate(out[:3]):
        torch.testing.assert_close(torch.cat([parts[0][i], parts[1][i]], dim=1), chunk)
    torch.testing.assert_close(r0[1](x[:, :48]) + r1[1](x[:, 48:]), whole[1](x), rtol=1e-5, atol=1e-5)
    with pytest.raises(ValueError, match="whole groups"):
        apply_quantization(RowParallelLinear(96, 64, False, 0, 2), Int4Config("gptq", 32))
    with pytest.raises(ValueError, match="desc_act"):
        apply_quantization(RowParallelLinear(96, 64, False, 0, 2), Int4Config("gptq", 16, desc_act=True))


def test_int4_configs_refused_and_dummy(tmp_path) -> None:
    cases = [({"quant_method": "gptq", "bits": 3, "group_size": 128}, "3-bit"),
             ({"quant_method": "awq", "bits": 8, "group_size": 128}, "8-bit"),
             ({"quant_method": "awq", "bits": 4, "group_size": 128, "version": "gemv"}, "version 'gemv'"),
             ({"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": False}, "zero points"),
             ({"quant_method": "gptq", "bits": 4, "group_size": 128, "dynamic": {"-:.*": {}}}, "dynamic"),
             ({"quant_method": "gptq", "bits": 4, "group_size": 128, "lm_head": True}, "lm_head"),
             ({"quant_method": "gptq", "bits": 4, "group_size": 127}, "group_size"),
             ({"quant_method": "gptq", "bits": 4, "group_size": 128, "checkpoint_format": "marlin"},
              "checkpoint_format")]
    for qc, match in cases:
        with pytest.raises(ValueError, match=match):
            resolve_quant_config(None, qc)
    with pytest.raises(ValueError, match="has none"):
        resolve_quant_config("gptq", None)
    ct = {"quant_method": "compressed-tensors", "config_groups": {"g": {
        "targets": ["Linear"], "format": "pack-quantized", "input_activations": None,
        "weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 32, "actorder": "group"}}}}
    with pytest.raises(ValueError, match="actorder"):
        resolve_quant_config(None, ct)
    ct["config_groups"]["g"]["weights"].update(actorder=None, symmetric=False)
    with pytest.raises(ValueError, match="asymmetric"):
        resolve_quant_config(None, ct)
    from model_utils import make_tiny_model

    # dummy weights with an AWQ config: quantised online to its groups, close to the unquantised model
    dense = str(tmp_path / "dense")
    make_tiny_model("llama", dense)
    plain = get_model(ModelConfig(dense), load_format="dummy", dtype=torch.float32, device="cpu")
    with open(os.path.join(dense, "config.json")) as f:
        cfg = json.load(f)
    cfg["quantization_config"] = {"quant_method": "awq", "bits": 4, "group_size": 32, "version": "gemm"}
    with open(os.path.join(dense, "config.json"), "w") as f:
        json.dump(cfg, f)
    quant = get_model(ModelConfig(dense), load_format="dummy", dtype=torch.float32, device="cpu")
    a, b = plain.model.layers[0].mlp.down_proj, quant.model.layers[0].mlp.down_proj
    assert b.qweight.shape == (64, 64) and b.scales.shape == (64, 4)
    torch.testing.assert_close(F4.dequantize(b.qweight, b.scales, b.qzeros), a.weight, atol=0.01, rtol=0.2)


def test_the_awq_shape_config_resolves() -> None:
    """configs/shapes/qwen2.5-7b-awq (Qwen2.5-7B-Instruct-AWQ's layout, for dummy-weight benchmarks) resolves to
    online AWQ groups of 128 that divide every projection's input, also split over two ranks."""
    import radixserve

    path = os.path.join(os.path.dirname(radixserve.__file__), "configs", "shapes", "qwen2.5-7b-awq", "config.json")
    with open(path) as f:
        cfg = json.load(f)
    qc = resolve_quant_config(None, cfg["quantization_config"], load_format="dummy")
    assert qc.fmt == "awq" and qc.group_size == 128 and not qc.serialized and not qc.sym
    for k in (cfg["hidden_size"], cfg["intermediate_size"], cfg["intermediate_size"] // 2):
        assert k % qc.group_size == 0


@pytest.mark.integration
@pytest.mark.parametrize("fmt", ["gptq", "awq"])
def test_int4_tp2_matches_tp1(tmp_path, fmt: str) -> None:
    """A 4-bit checkpoint served by two tensor-parallel ranks (gloo; one KV head replicated on both, row-parallel
    layers split into whole groups with their g_idx renumbered) generates what one rank does."""
    from parallel_utils import SERVER_KW, make_model, reference_outputs

    from radixserve.entrypoints.engine import Engine

    path = make_model("llama", str(tmp_path), seed=5, num_key_value_heads=1)
    write_int4_checkpoint(path, fmt, group=16)
    greedy = {"max_new_tokens": 8, "temperature": 0.0}
    prompts = [[5, 17, 99, 3, 42, 7], [1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11]]
    want = reference_outputs(path, prompts, greedy)
    with Engine(model_path=path, tp_size=2, quantization=fmt, **SERVER_KW) as engine:
        got = [o["output_ids"] for o in engine.generate(input_ids=prompts, sampling_params=greedy)]
    assert got == want
