"""FP8 linear layers: online quantisation, per-tensor and block-wise checkpoints, TP sharding of scales, and the
Triton kernels (per-token-group quantisation, the block-scaled GEMM in W8A8 and W8A16 form) against the torch
references. On the CPU the kernels run under TRITON_INTERPRET=1 (set in conftest; the interpreter handles the
float8 dtypes)."""

from __future__ import annotations

import json
import os
import types

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, RowParallelLinear
from radixserve.layers.quantization import apply_quantization, finish_quantization, resolve_quant_config
from radixserve.layers.quantization import fp8 as fp8mod
from radixserve.layers.quantization.fp8 import (
    FP8,
    Fp8Config,
    dequantize_blocks,
    fp8_linear_ref,
    quantize_blocks,
    quantize_groups_ref,
    quantize_rows,
)
from radixserve.layers.quantization.fp8_kernels import fp8_gemm, per_token_group_quant_fp8
from radixserve.model_loader import get_model

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).norm() / b.float().norm())


# ---------------------------------------------------------------- references
def test_quantize_rows_and_blocks_round_trip() -> None:
    g = torch.Generator().manual_seed(0)
    w = torch.randn(40, 48, generator=g)
    q, s = quantize_rows(w)
    assert q.dtype == FP8 and s.shape == (40,)
    assert _rel(dequantize_blocks(q, s, 1, 48), w) < 0.04
    assert float(q.float().abs().amax(dim=1).min()) == 448.0  # every row uses the full fp8 range
    qb, sb = quantize_blocks(w, 16, 32)  # ragged: 40 rows = 2.5 blocks, 48 columns = 1.5 blocks
    assert sb.shape == (3, 2)
    assert _rel(dequantize_blocks(qb, sb, 16, 32), w) < 0.04


@pytest.mark.parametrize("two_pass", [False, True])
@pytest.mark.parametrize("m,k,group", [(1, 64, 64), (5, 96, 32), (3, 256, 128), (0, 32, 16), (2, 200, 200)])
def test_per_token_group_quant_kernel(m: int, k: int, group: int, two_pass: bool,
                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """Both forms of the kernel: a group in registers (one pass), and a group wider than that (two passes)."""
    from radixserve.layers.quantization import fp8_kernels

    if two_pass:
        monkeypatch.setattr(fp8_kernels, "ONE_PASS_MAX", 8)
    g = torch.Generator().manual_seed(m + k)
    x = torch.randn(m, k, generator=g) * 5
    x[:, :group] *= 0  # an all-zero group: scale floored, no NaN
    q, s = per_token_group_quant_fp8(x.to(DEV), group)
    rq, rs = quantize_groups_ref(x, group)
    torch.testing.assert_close(s.cpu(), rs)
    if DEV == "cuda":  # round to nearest, as torch does
        assert torch.equal(q.cpu().view(torch.uint8), rq.view(torch.uint8))
    else:
        assert_fp8_equal_but_interpreter_carry(q, rq)


def assert_fp8_equal_but_interpreter_carry(q: torch.Tensor, ref: torch.Tensor) -> None:
    """Equal float8 tensors (on a GPU: bit for bit), except for two faults of Triton's CPU interpreter: it drops the
    carry of a mantissa that rounds up into the next power of two (64 for 127.9 where the GPU and torch give 128),
    and it rounds subnormals differently (differences below the smallest normal value)."""
    if q.is_cuda:
        assert torch.equal(q.view(torch.uint8), ref.to(q.device).view(torch.uint8))
        return
    a, b = q.cpu().float(), ref.cpu().float()
    bad = a != b
    pow2 = (b.abs() > 0) & (torch.frexp(b.abs())[0] == 0.5)
    tiny = (a - b).abs() <= torch.finfo(ref.dtype).smallest_normal
    ok = (pow2 & (a * 2 == b)) | tiny
    assert bool(ok[bad].all()), f"{int(bad.sum())} values differ"


@pytest.mark.parametrize("a_fp8", [True, False])
@pytest.mark.parametrize("m,n,k,bn,bk", [(1, 48, 64, 16, 16), (20, 40, 64, 16, 32), (3, 32, 96, 1, 96),
                                         (17, 50, 128, 1, 128)])
def test_fp8_gemm_kernel_matches_reference(a_fp8: bool, m: int, n: int, k: int, bn: int, bk: int) -> None:
    g = torch.Generator().manual_seed(m * n + k)
    w = torch.randn(n, k, generator=g)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    q, s = quantize_rows(w) if bn == 1 else quantize_blocks(w, bn, bk)
    s2 = s.view(-1, 1) if s.dim() == 1 else s
    if a_fp8:
        xq, xs = per_token_group_quant_fp8(x.to(DEV), bk)
        out = fp8_gemm(xq, q.to(DEV), s2.to(DEV), bn, bk, torch.float32, a_scale=xs, a_group_k=bk, bias=bias.to(DEV))
        x = (xq.cpu().float().view(m, -1, bk) * xs.cpu()[..., None]).view(m, k)  # the kernel's quantised x
    else:
        out = fp8_gemm(x.to(DEV), q.to(DEV), s2.to(DEV), bn, bk, torch.float32, bias=bias.to(DEV))
    ref = fp8_linear_ref(x, q, s, bn, bk, bias, None)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-4)


# ---------------------------------------------------------------- layers
def _layers(tp_rank: int = 0, tp_size: int = 1) -> dict[str, torch.nn.Module]:
    return {"qkv": QKVParallelLinear(64, 16, 4, 2, False, tp_rank, tp_size),
            "gate_up": MergedColumnParallelLinear(64, [96, 96], False, tp_rank, tp_size),
            "down": RowParallelLinear(96, 64, True, tp_rank, tp_size)}


def _full_weights(seed: int = 0) -> dict[str, dict]:
    g = torch.Generator().manual_seed(seed)
    return {"qkv": {"q": torch.randn(64, 64, generator=g), "k": torch.randn(32, 64, generator=g),
                    "v": torch.randn(32, 64, generator=g)},
            "gate_up": {0: torch.randn(96, 64, generator=g), 1: torch.randn(96, 64, generator=g)},
            "down": {None: torch.randn(64, 96, generator=g)}}


def _load(layer: torch.nn.Module, shards: dict, suffix_tensors: dict | None = None) -> None:
    for sid, w in shards.items():
        layer.weight.weight_loader(layer.weight, w, sid)
    for name, per_shard in (suffix_tensors or {}).items():
        param = getattr(layer, name)
        for sid, t in per_shard.items():
            param.weight_loader(param, t, sid)
    if layer.bias is not None:
        layer.bias.weight_loader(layer.bias, torch.arange(64, dtype=torch.float32) / 64)


@pytest.mark.parametrize("m", [3, 40])  # W8A16 (small batch) and W8A8 (dynamic per-token activation scales)
def test_online_fp8_layers_match_reference(m: int) -> None:
    full = _full_weights()
    x = torch.randn(m, 96, generator=torch.Generator().manual_seed(1))
    for name, layer in _layers().items():
        _load(layer, full[name])
        w = layer.weight.data.clone()
        apply_quantization(layer, Fp8Config(serialized=False))
        _load(layer, full[name])
        finish_quantization(layer)
        assert layer.weight.dtype == FP8 and layer.weight_scale.shape == (w.shape[0],)
        xi = x[:, : w.shape[1]]
        q, s = quantize_rows(w)
        ref = fp8_linear_ref(xi, q, s, 1, w.shape[1], layer.bias, None if m <= fp8mod.SMALL_M else w.shape[1])
        torch.testing.assert_close(layer(xi), ref)
        exact = torch.nn.functional.linear(xi, w, layer.bias)
        assert _rel(layer(xi), exact) < 0.06  # the quantisation error itself is small


def test_block_scales_shard_with_their_weights() -> None:
    """TP=2 ranks of block-wise fp8 layers hold exactly their rows/columns of the weight and of the scale grid."""
    full = _full_weights(3)
    cfg = Fp8Config(serialized=True, weight_block_size=[16, 16])
    quant = {name: {sid: quantize_blocks(w, 16, 16) for sid, w in shards.items()} for name, shards in full.items()}
    whole = _layers()
    ranks = [_layers(r, 2) for r in range(2)]
    for layers in [whole, *ranks]:
        for name, layer in layers.items():
            apply_quantization(layer, cfg)
            _load(layer, {sid: q for sid, (q, _) in quant[name].items()},
                  {"weight_scale_inv": {sid: s for sid, (_, s) in quant[name].items()}})
            finish_quantization(layer)
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    for name in ("qkv", "gate_up"):
        out = whole[name](x[:, :64])
        parts = [r[name](x[:, :64]) for r in ranks]
        # rank r holds its slice of each stacked matrix
        sizes = whole[name].output_sizes
        ref_chunks = out.split(sizes, dim=1)
        for i, chunk in enumerate(ref_chunks):
            halves = [p.split(ranks[0][name].output_sizes, dim=1)[i] for p in parts]
            torch.testing.assert_close(torch.cat(halves, dim=1), chunk)
    # row-parallel: the partial sums add up to the whole (the bias only on rank 0)
    total = ranks[0]["down"](x[:, :48]) + ranks[1]["down"](x[:, 48:])
    assert ranks[0]["down"].weight_scale.shape == (4, 3) and ranks[1]["down"].weight_scale.shape == (4, 3)
    ref = fp8_linear_ref(x, *quant["down"][None], 16, 16, whole["down"].bias, None)
    torch.testing.assert_close(total, ref, rtol=1e-5, atol=1e-5)


def test_block_wise_stacking_rejects_unaligned_shards() -> None:
    layer = QKVParallelLinear(64, 8, 6, 2)  # q has 48 rows: not a multiple of the 32-row block
    with pytest.raises(ValueError, match="multiple of the block"):
        apply_quantization(layer, Fp8Config(serialized=True, weight_block_size=[32, 32]))


# ---------------------------------------------------------------- checkpoints
def _write_fp8_checkpoint(path: str, layout: str) -> dict[str, torch.Tensor]:
    """Rewrite the tiny model saved at `path` as an fp8 checkpoint ('block': 16x16 weight_scale_inv on every
    projection of the layers, MoE experts and MLA's included; 'tensor': per-tensor weight_scale and a static
    input_scale). Returns the dequantised state dict (what the fp8 model computes with), under the file's names."""
    from safetensors.torch import load_file, save_file

    sd = load_file(os.path.join(path, "model.safetensors"))
    out, deq = {}, {}
    for name, t in sd.items():
        t = t.float()
        if name.endswith(("proj.weight", "proj_with_mqa.weight")) and ".layers." in name:
            base = name[: -len("weight")]
            if layout == "block":
                q, s = quantize_blocks(t, 16, 16)
                out[base + "weight_scale_inv"] = s
                deq[name] = dequantize_blocks(q, s, 16, 16)
            else:
                s = (t.abs().max() / 448.0).float()
                q = (t / s).clamp(-448, 448).to(FP8)
                out[base + "weight_scale"] = s.reshape(())
                out[base + "input_scale"] = torch.tensor(0.02)
                deq[name] = q.float() * s
            out[name] = q
        else:
            out[name] = deq[name] = t
    save_file(out, os.path.join(path, "model.safetensors"))
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    qc = {"quant_method": "fp8", "activation_scheme": "dynamic" if layout == "block" else "static"}
    if layout == "block":
        qc["weight_block_size"] = [16, 16]
    cfg["quantization_config"] = qc
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)
    return deq


@pytest.mark.parametrize("layout", ["block", "tensor"])
def test_fp8_checkpoint_loads_and_matches(tmp_path, layout: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A tiny fp8 checkpoint (block-wise 16x16, or per-tensor with a static activation scale) loads with the
    weights it was written with; with W8A16 forced for every batch the block-wise model is exactly the
    dequantised model, so its greedy output equals transformers' on the dequantised weights."""
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch

    path = str(tmp_path)
    hf = make_tiny_model("llama", path)
    deq = _write_fp8_checkpoint(path, layout)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8
    if layout == "block":
        assert qkv.weight_scale.shape == (128 // 16, 64 // 16)
    else:  # q, k, v scales spread over their rows; one static activation scale
        assert qkv.weight_scale.shape == (128,) and qkv.input_scale.shape == (1,)
    w_ref = torch.cat([deq[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    bn, bk = (16, 16) if layout == "block" else (1, 64)
    torch.testing.assert_close(dequantize_blocks(qkv.weight, qkv.weight_scale, bn, bk), w_ref, rtol=0, atol=0)
    x = torch.randn(4, 64, generator=torch.Generator().manual_seed(0))
    ref = fp8_linear_ref(x, qkv.weight, qkv.weight_scale, bn, bk, None, None if layout == "block" else bk,
                         qkv.input_scale if layout == "tensor" else None)
    torch.testing.assert_close(qkv(x), ref)
    if layout == "tensor":
        return
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    hf.load_state_dict(deq)
    runner = make_runner(path)
    prompts = [[5, 17, 99, 3, 42, 7, 100, 8], [1, 2, 3]]
    for prompt, got in zip(prompts, StaticBatch(runner).generate(prompts, 8), strict=True):
        assert got == hf_greedy(hf, prompt, 8)


# ---------------------------------------------------------------- selection
def test_resolve_quant_config() -> None:
    assert resolve_quant_config(None, None) is None
    cfg = resolve_quant_config(None, {"quant_method": "fp8", "weight_block_size": [128, 128]})
    assert isinstance(cfg, Fp8Config) and cfg.serialized and cfg.weight_block_size == [128, 128]
    online = resolve_quant_config("fp8", None)
    assert isinstance(online, Fp8Config) and not online.serialized
    dummy = resolve_quant_config(None, {"quant_method": "fp8", "weight_block_size": [128, 128]}, load_format="dummy")
    assert not dummy.serialized and dummy.weight_block_size == [128, 128]  # nothing on disk: online, its blocks
    static = resolve_quant_config(None, {"quant_method": "fp8", "activation_scheme": "static",
                                         "ignored_layers": ["lm_head"]}, load_format="dummy")
    assert not static.serialized and static.weight_block_size is None and static.activation_scheme == "dynamic"
    assert static.ignored_layers == ["lm_head"]  # no input scales to read: dynamic ones
    with pytest.raises(ValueError, match="static"):
        Fp8Config(serialized=False, activation_scheme="static")
    with pytest.raises(ValueError, match="not supported"):
        resolve_quant_config(None, {"quant_method": "bitsandbytes"})
    with pytest.raises(ValueError, match="unknown quantization"):
        resolve_quant_config("int3", None)
    with pytest.raises(ValueError, match="weight_block_size"):
        Fp8Config(serialized=True, weight_block_size=[100, 128])
    from radixserve.server_args import ServerArgs

    with pytest.raises(ValueError, match="--quantization"):
        ServerArgs(quantization="int3", device="cpu")


@pytest.mark.parametrize("bn,bk", [(1, 512), (16, 128), (128, 128)])
@pytest.mark.parametrize("m", [1, 3])
def test_fp8_gemv_kernel_matches_reference(m: int, bn: int, bk: int) -> None:
    from radixserve.layers.quantization.fp8_kernels import fp8_gemv

    g = torch.Generator().manual_seed(m * bn)
    n, k = 40, 512
    w = torch.randn(n, k, generator=g)
    q, s = quantize_rows(w) if bn == 1 else quantize_blocks(w, bn, bk)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    out = fp8_gemv(x.to(DEV), q.to(DEV), (s.view(-1, 1) if s.dim() == 1 else s).to(DEV), bn, bk, torch.float32,
                   bias.to(DEV))
    torch.testing.assert_close(out.cpu(), fp8_linear_ref(x, q, s, bn, bk, bias, None), rtol=1e-4, atol=1e-4)
    assert fp8_gemv(x[:, :96].contiguous(), q[:, :96].contiguous(), s.view(-1, 1), 1, 96, torch.float32) is None


@pytest.mark.parametrize("m,kernel,block_n,block_k,variant", [
    (1, "ew", 4, 128, ""), (1, "ew", 8, 64, "f16"), (2, "ew", 2, 128, ""), (2, "ew", 4, 64, "f16"),
    (3, "dot", 16, 64, ""), (16, "dot", 32, 32, ""), (3, "ew", 4, 64, ""), (1, "ew", 4, 128, "r8"),
    (1, "ew", 2, 64, "ef+r8"), (2, "ew", 2, 128, "r8"), (1, "ew", 2, 64, "f16+r8+ef")])
def test_fp8_skinny_gemv_matches_reference(m: int, kernel: str, block_n: int, block_k: int, variant: str) -> None:
    """The decode kernels of `fp8_gemv` on per-channel weights: elementwise (Triton's widening and the bit-moving
    one, which must be exact on subnormal fp8 values too) and tensor-core; rows not a multiple of the tile; an "ew"
    config asked for more than two rows runs the tensor-core kernel."""
    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator().manual_seed(m * block_n + block_k)
    n, k = 37, 256
    w = torch.randn(n, k, generator=g)
    w[0, :16] = 1e-5 * torch.arange(16)  # fp8 subnormals after scaling (amax of the row is ~3)
    q, s = quantize_rows(w)
    assert (q[0, :16].view(torch.uint8) & 0x78 == 0).any() and (q[0, 1:16].float() != 0).any()
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    cfg = GemvConfig(kernel, block_n, block_k, variant=variant)
    out = fp8_skinny_gemv(x.to(DEV), q.to(DEV), s.to(DEV), torch.float32, bias.to(DEV), cfg)
    torch.testing.assert_close(out.cpu(), fp8_linear_ref(x, q, s, 1, k, bias, None), rtol=1e-4, atol=1e-4)
    out = fp8_skinny_gemv(x.to(DEV), q.to(DEV), s.view(-1, 1).to(DEV), torch.float32, None, cfg)
    torch.testing.assert_close(out.cpu(), fp8_linear_ref(x, q, s, 1, k, None, None), rtol=1e-4, atol=1e-4)
    qb, sb = quantize_blocks(w, 16, 128)
    assert fp8_skinny_gemv(x, qb, sb, torch.float32) is None  # block-wise scales without their block: not these
    assert fp8_skinny_gemv(torch.randn(17, k), q, s, torch.float32) is None  # more rows than they take


@pytest.mark.parametrize("m,block_n,block_k,variant,block", [
    (1, 4, 128, "", (16, 32)), (1, 2, 64, "r8", (16, 128)), (2, 4, 64, "f16+r8+ef", (16, 16)),
    (2, 32, 128, "r8", (16, 64)), (1, 4, 64, "dot", (32, 16))])
def test_fp8_skinny_gemv_block_wise(m: int, block_n: int, block_k: int, variant: str, block: tuple[int, int]
                                    ) -> None:
    """Block-wise scales in the elementwise GEMV (one or two rows): each step's products, or runs of 8, scaled by
    their column group's scale: K steps wider and narrower than a group, a tile taller than the row block (cut to
    it), rows ending inside a row block, and a "dot" tile (per-channel only) replaced by the elementwise default;
    gate_up with SiLU·mul; the shapes the kernel does not take return None (the caller's W8A16 fallback)."""
    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator().manual_seed(m * block_n + block_k + block[1])
    n, k = 40, 256
    q, s = quantize_blocks(torch.randn(n, k, generator=g) * torch.rand(n, 1, generator=g) * 3, *block)
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    cfg = GemvConfig("dot", 16, block_k) if variant == "dot" else GemvConfig("ew", block_n, block_k, variant=variant)
    out = fp8_skinny_gemv(x.to(DEV), q.to(DEV), s.to(DEV), torch.float32, bias.to(DEV), cfg, block=block)
    torch.testing.assert_close(out.cpu(), fp8_linear_ref(x, q, s, *block, bias, None), rtol=1e-4, atol=1e-4)
    n2 = 2 * 32  # [gate; up], each half whole row blocks
    q2, s2 = quantize_blocks(torch.randn(n2, k, generator=g), *block)
    ref = fp8_linear_ref(x[:1], q2, s2, *block, None, None)
    out = fp8_skinny_gemv(x[:1].to(DEV), q2.to(DEV), s2.to(DEV), torch.float32, None,
                          None if variant == "dot" else cfg, silu_mul=True, block=block)
    torch.testing.assert_close(out.cpu(), torch.nn.functional.silu(ref[:, :32]) * ref[:, 32:], rtol=1e-4, atol=1e-4)
    assert fp8_skinny_gemv(torch.randn(3, k), q, s, torch.float32, block=block) is None  # more than two rows
    assert fp8_skinny_gemv(x[:1], q, s, torch.float32, silu_mul=True, block=block) is None  # 20 | 20: inside a block
    assert fp8_skinny_gemv(x, q, s.t().contiguous(), torch.float32, block=block) is None  # scales of another shape


@pytest.mark.parametrize("variant", ["", "ef", "r8", "r8+ef"])
def test_fp8_skinny_gemv_silu_mul_variants(variant: str) -> None:
    """gate_up with SiLU·mul in the elementwise GEMV's epilogue, for each way of streaming the weight (runs of 8
    summed in the thread, evict-first): silu(x @ gate.T) * (x @ up.T) of the reference;
    an unknown flag is a ValueError."""
    from radixserve.layers.quantization.fp8_gemv import fp8_skinny_gemv
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator().manual_seed(7)
    n, k = 2 * 19, 384
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    x = torch.randn(1, k, generator=g)
    ref = fp8_linear_ref(x, q, s, 1, k, None, None)
    want = torch.nn.functional.silu(ref[:, :19]) * ref[:, 19:]
    cfg = GemvConfig("ew", 4, 128, variant=variant)
    out = fp8_skinny_gemv(x.to(DEV), q.to(DEV), s.to(DEV), torch.float32, None, cfg, silu_mul=True)
    torch.testing.assert_close(out.cpu(), want, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="unknown variant"):
        fp8_skinny_gemv(x.to(DEV), q.to(DEV), s.to(DEV), torch.float32, None, GemvConfig("ew", 4, 128, variant="r8+x"))


@pytest.mark.parametrize("m", [1, 2, 5])
def test_fp8_mlp_fuses_silu_mul_into_gate_up(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """An online-fp8 Llama MLP on the fused-kernel path: at decode sizes gate_up's GEMV writes silu(gate) * up
    itself (one kernel less), giving what the GEMV + SiluAndMul path gives; with LoRA on the layer it does not."""
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(m)
    mlp = LlamaMLP(64, 96, False, 0, 1).to(torch.bfloat16)
    apply_quantization(mlp, Fp8Config(serialized=False))
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=g).to(torch.bfloat16) * 0.1)
    finish_quantization(mlp)
    x = torch.randn(m, 64, generator=g).to(torch.bfloat16).to(DEV)
    mlp = mlp.to(DEV)
    set_fused_kernels(True if DEV == "cpu" else None)
    try:
        calls = []
        real = fp8mod.Fp8LinearMethod.apply_silu_and_mul
        monkeypatch.setattr(fp8mod.Fp8LinearMethod, "apply_silu_and_mul",
                            lambda self, *a: calls.append(1) or real(self, *a))
        fused = mlp(x)
        assert calls and mlp.gate_up_proj.silu_and_mul(x) is not None
        monkeypatch.setattr(fp8mod.Fp8LinearMethod, "apply_silu_and_mul", lambda self, *a: None)
        plain = mlp(x)
        torch.testing.assert_close(fused.float(), plain.float(), rtol=2e-2, atol=2e-2)
        # a layer with adapters asks its LoRA hook (which fuses only its own one-row stacked path), never the
        # quantization method's fused product (LoRA adds to gate_up before the activation)
        asked = []
        mlp.gate_up_proj.lora = types.SimpleNamespace(silu_and_mul=lambda t: asked.append(t) and None)
        monkeypatch.setattr(fp8mod.Fp8LinearMethod, "apply_silu_and_mul", real)
        assert mlp.gate_up_proj.silu_and_mul(x) is None and len(asked) == 1
    finally:
        set_fused_kernels(None)


@pytest.mark.parametrize("m", [1, 2, 3])
def test_block_wise_mlp_takes_the_skinny_gemv_at_one_or_two_rows(m: int, monkeypatch: pytest.MonkeyPatch) -> None:
    """A block-wise fp8 MLP (quantised online to 16 x 16 blocks) on the fused-kernel path: at one or two rows its
    products run the elementwise GEMV (gate_up with SiLU·mul at one), at three the W8A16 `fp8_gemm`; each layer's
    output is the dequantising reference's."""
    from radixserve.layers.quantization import fp8_gemv
    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.models.llama import LlamaMLP

    g = torch.Generator().manual_seed(m)
    mlp = LlamaMLP(64, 96, False, 0, 1)
    apply_quantization(mlp, Fp8Config(serialized=False, weight_block_size=[16, 16]))
    for lin in (mlp.gate_up_proj, mlp.down_proj):
        lin.weight.data.copy_(torch.randn(lin.weight.shape, generator=g) * 0.1)
    finish_quantization(mlp)
    assert mlp.gate_up_proj.weight_scale.shape == (2 * 96 // 16, 64 // 16)
    x = torch.randn(m, 64, generator=g).to(DEV)
    mlp = mlp.to(DEV)
    calls: list[bool] = []
    real = fp8_gemv.fp8_skinny_gemv
    monkeypatch.setattr(fp8_gemv, "fp8_skinny_gemv",
                        lambda *a, **kw: (lambda out: calls.append(out is not None) or out)(real(*a, **kw)))
    set_fused_kernels(True if DEV == "cpu" else None)
    try:
        gu = mlp.gate_up_proj
        ref = fp8_linear_ref(x, gu.weight, gu.weight_scale, 16, 16, None, None)
        torch.testing.assert_close(gu(x), ref, rtol=1e-4, atol=1e-4)
        fused = gu.silu_and_mul(x)
        if m == 1:
            torch.testing.assert_close(fused, torch.nn.functional.silu(ref[:, :96]) * ref[:, 96:], rtol=1e-4,
                                       atol=1e-4)
        else:
            assert fused is None
        h = torch.randn(m, 96, generator=g).to(DEV)
        down = mlp.down_proj
        torch.testing.assert_close(down(h), fp8_linear_ref(h, down.weight, down.weight_scale, 16, 16, None, None),
                                   rtol=1e-4, atol=1e-4)
    finally:
        set_fused_kernels(None)
    assert calls == ([True, True, True] if m == 1 else [True, False, True] if m == 2 else [False, False, False])


def test_gemv_config_table_and_override(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.layers.quantization import gemv_configs as gc

    assert gc.bucket(1) == 1 and gc.bucket(3) == 4 and gc.bucket(16) == 16
    assert gc.key("fp8", 3, 4096, 14336) == "fp8/4/4096/14336"
    path = tmp_path / "picks.json"
    pick = gc.GemvConfig("ew", 8, 2048, 8, 2, "f16")
    path.write_text(json.dumps({"configs": {gc.key("fp8", 1, 111, 4096): pick.to_dict()}}))
    monkeypatch.setenv("RADIXSERVE_GEMV_CONFIGS", str(path))
    gc.reload()
    try:
        assert gc.get("fp8", 1, 111, 4096) == pick
        assert gc.get("fp8", 1, 111, 4096, cuda=False) == gc.default("fp8", 1, False)  # the interpreter's tiles
        assert gc.get("fp8", 2, 111, 4096) == gc.default("fp8", 2, True)
    finally:
        monkeypatch.delenv("RADIXSERVE_GEMV_CONFIGS")
        gc.reload()


@pytest.mark.parametrize("kind", ["deepseek_v2", "qwen2_moe"])
def test_online_fp8_on_moe_and_mla_models(kind: str, tmp_path) -> None:
    """--quantization fp8 on MoE / MLA models: dense and attention linears and the experts in fp8, MLA's kv_b_proj
    (read as a matrix by the absorbed attention) left in the model dtype; the logits stay close to float32's."""
    from model_utils import make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch

    make_tiny_model(kind, str(tmp_path))
    prompts = [[5, 17, 99, 3, 42, 7, 100, 8], [1, 2, 3]]
    logits = []
    for q in (None, "fp8"):
        runner = make_runner(str(tmp_path), quantization=q)
        sb = StaticBatch(runner)
        batch, _ = sb.prefill(prompts)
        logits.append(sb.last_logits.next_token_logits.clone())
        sb.release(batch)
        if q:
            kinds = {type(getattr(m, "quant_method", None)).__name__ for m in runner.model.modules()}
            assert "Fp8LinearMethod" in kinds
            for name, m in runner.model.named_modules():
                if name.endswith("kv_b_proj"):
                    assert m.weight.dtype == torch.float32
                if hasattr(m, "w13_weight"):
                    assert m.w13_weight.dtype == FP8 and type(m.quant_method).__name__ == "Fp8MoEMethod"
    assert _rel(logits[1], logits[0]) < 0.1


@pytest.mark.parametrize("kernel,m,block_n,block_m,block_k", [
    ("w8a8", 20, 32, 16, 64), ("w8a8", 33, 16, 32, 128), ("w8a16", 24, 32, 32, 64), ("w8a16", 17, 16, 16, 32)])
def test_fp8_mid_kernel_matches_reference(kernel: str, m: int, block_n: int, block_m: int, block_k: int) -> None:
    """The transposed product for 17..256 rows (`fp8_mid`): W8A8 (x quantised per token) against the reference with
    the same activation quantisation, W8A16 against the W8A16 reference; N and M not multiples of the tiles, bias;
    configs it does not run give None."""
    from radixserve.layers.quantization.fp8_mid import fp8_mid_mm
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator().manual_seed(m + block_k)
    n, k = 45, 256
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    cfg = GemvConfig(kernel, block_n, block_k, block_m=block_m)
    out = fp8_mid_mm(x.to(DEV), q.to(DEV), s.to(DEV), torch.float32, cfg, bias.to(DEV))
    if kernel == "w8a8":  # x as the kernel quantised it (the interpreter's fp8 rounding drops a carry, see above)
        xq, xs = per_token_group_quant_fp8(x.to(DEV), k)
        ref = (xq.cpu().float() * xs.cpu()) @ (q.float() * s[:, None]).t() + bias
        assert_fp8_equal_but_interpreter_carry(xq, fp8mod.quantize_groups_ref(x, k)[0])
    else:
        ref = fp8_linear_ref(x, q, s, 1, k, bias, None)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-3)
    assert fp8_mid_mm(x, q, s, torch.float32, GemvConfig("scaled_mm", 0, 0)) is None
    assert fp8_mid_mm(torch.randn(257, k), q, s, torch.float32, cfg) is None


@pytest.mark.parametrize("m", [20, 32])
def test_fp8_mid_scaled_mm_transposed_matches_reference(m: int) -> None:
    """"scaled_mm_t": cuBLASLt's row-wise fp8 product computed as (W @ x.T).T, the batch padded to 16 rows: the
    same numbers as the per-token W8A8 reference (the padding's columns dropped), contiguous [M, N], bias added."""
    from radixserve.layers.quantization.fp8_mid import fp8_mid_mm
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator().manual_seed(m)
    n, k = 48, 256
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    out = fp8_mid_mm(x.to(DEV), q.to(DEV), s.to(DEV), torch.float32, GemvConfig("scaled_mm_t", 0, 0), bias.to(DEV))
    xq, xs = per_token_group_quant_fp8(x.to(DEV), k)
    ref = (xq.cpu().float() * xs.cpu()) @ (q.float() * s[:, None]).t() + bias
    assert out.shape == (m, n) and out.is_contiguous()
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-3)


@pytest.mark.parametrize("m,out_dtype", [(20, torch.float32), (33, torch.bfloat16)])
def test_fp8_mid_scaled_mm_unit_matches_reference(m: int, out_dtype: torch.dtype) -> None:
    """"scaled_mm_unit": the tensor-wise product with scales of 1, then x's per-token and the weight's per-channel
    scales and the bias in one Triton pass (interpreted here): the per-token W8A8 reference's numbers (bf16: within
    its rounding); float16 (whose range the unscaled product exceeds) and unaligned N are declined."""
    from radixserve.layers.quantization.fp8_mid import fp8_mid_mm
    from radixserve.layers.quantization.gemv_configs import GemvConfig

    g = torch.Generator().manual_seed(m)
    n, k = 272, 128  # N spans two 256-column tiles of the scaling pass, M two or three 16-row ones
    q, s = quantize_rows(torch.randn(n, k, generator=g))
    x = torch.randn(m, k, generator=g)
    bias = torch.randn(n, generator=g)
    cfg = GemvConfig("scaled_mm_unit", 0, 0)
    out = fp8_mid_mm(x.to(DEV), q.to(DEV), s.to(DEV), out_dtype, cfg, bias.to(DEV))
    xq, xs = per_token_group_quant_fp8(x.to(DEV), k)
    ref = (xq.cpu().float() * xs.cpu()) @ (q.float() * s[:, None]).t() + bias
    assert out.shape == (m, n) and out.dtype == out_dtype
    if out_dtype == torch.float32:
        torch.testing.assert_close(out.cpu(), ref, rtol=1e-4, atol=1e-3)
    else:
        assert float((out.cpu().float() - ref).norm() / ref.norm()) < 8e-3
    assert fp8_mid_mm(x.to(DEV), q.to(DEV), s.to(DEV), torch.float16, cfg) is None
    assert fp8_mid_mm(x.to(DEV), q[:40].to(DEV), s[:40].to(DEV), out_dtype, cfg) is None


def test_mid_table_lookup(monkeypatch: pytest.MonkeyPatch, tmp_path) -> None:
    """`gemv_configs.get_mid`: the entry swept at the smallest M >= m, the largest within a quarter above it, None
    past that or for a shape the table lacks; the fp8 layer runs what the entry names."""
    import json

    from radixserve.layers.quantization import gemv_configs

    table = {"configs": {"fp8_mid/64/96/256": {"kernel": "w8a16", "block_n": 16, "block_k": 64, "block_m": 32},
                         "fp8_mid/160/96/256": {"kernel": "scaled_mm", "block_n": 0, "block_k": 0}}}
    path = tmp_path / "t.json"
    path.write_text(json.dumps(table))
    monkeypatch.setenv("RADIXSERVE_GEMV_CONFIGS", str(path))
    gemv_configs.reload()
    try:
        assert gemv_configs.get_mid(17, 96, 256).kernel == "w8a16"
        assert gemv_configs.get_mid(64, 96, 256).kernel == "w8a16"
        assert gemv_configs.get_mid(65, 96, 256).kernel == "scaled_mm"
        assert gemv_configs.get_mid(200, 96, 256).kernel == "scaled_mm"
        assert gemv_configs.get_mid(201, 96, 256) is None
        assert gemv_configs.get_mid(32, 128, 256) is None
    finally:
        monkeypatch.delenv("RADIXSERVE_GEMV_CONFIGS")
        gemv_configs.reload()
