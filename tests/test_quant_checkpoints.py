"""FP8 checkpoints in the other published formats: compressed-tensors (llm-compressor: FP8-dynamic per-channel,
FP8 per-tensor static, FP8-block, weight-only) and NVIDIA ModelOpt (per-tensor, static input scales, KV scales),
each written from a tiny random model with the format's tensor names and config, loaded, and checked against the
dequantised weights (exact bytes and scales; the greedy output of transformers on those weights where the product
is the dequantised model's). Targets, ignore lists and the schemes that are refused."""

from __future__ import annotations

import json
import os
import shutil

import pytest
import torch

from radixserve.configs.model_config import ModelConfig
from radixserve.layers.quantization import fp8 as fp8mod
from radixserve.layers.quantization import resolve_quant_config
from radixserve.layers.quantization.fp8 import FP8, dequantize_blocks, fp8_linear_ref, quantize_blocks, quantize_rows
from radixserve.model_loader import get_model

PROMPTS = [[5, 17, 99, 3, 42, 7, 100, 8], [1, 2, 3]]


def _group(strategy: str, acts: str | None, targets: list[str] | None = None) -> dict:
    weights = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": False, "strategy": strategy,
               "block_structure": [16, 16] if strategy == "block" else None, "group_size": None}
    if acts is None:
        input_acts = None
    else:
        input_acts = {"num_bits": 8, "type": "float", "symmetric": True, "dynamic": acts != "static",
                      "strategy": "tensor" if acts == "static" else acts}
    return {"targets": targets or ["Linear"], "weights": weights, "input_activations": input_acts,
            "output_activations": None, "format": "float-quantized"}


SCHEMES = {  # name -> (weight strategy, input activations)
    "channel": ("channel", "token"),  # FP8-dynamic
    "tensor": ("tensor", "static"),  # FP8 (static)
    "block": ("block", "group"),  # FP8-block
    "weight_only": ("channel", None),
}


def _quantized(name: str, t: torch.Tensor, strategy: str) -> tuple[dict[str, torch.Tensor], torch.Tensor]:
    """The compressed-tensors tensors of one weight and its dequantised value."""
    base = name[: -len("weight")]
    if strategy == "block":
        q, s = quantize_blocks(t, 16, 16)
        deq = dequantize_blocks(q, s, 16, 16)
    elif strategy == "channel":
        q, s = quantize_rows(t)
        deq = q.float() * s[:, None]
        s = s[:, None]
    else:
        s = (t.abs().max() / 448.0).float().reshape(1)
        q = (t / s).clamp(-448, 448).to(FP8)
        deq = q.float() * s
    out = {name: q, base + "weight_scale": s}
    if strategy == "tensor":
        out[base + "input_scale"] = torch.tensor([0.02])
    return out, deq


def write_checkpoint(path: str, fmt: str, scheme: str = "channel", qc_extra: dict | None = None,
                     quantize: tuple[str, ...] = ("proj.weight", "proj_with_mqa.weight"),
                     skip: tuple[str, ...] = ()) -> str:
    """Rewrite the tiny model saved at `path` in `fmt` ("ct": compressed-tensors, "modelopt"), every layer
    projection whose name ends with one of `quantize` (and none of `skip`) quantized; the dequantised weights are
    saved with the other files in `path`/deq (for transformers). Returns that folder."""
    from safetensors.torch import load_file, save_file

    deq_dir = os.path.join(path, "deq")
    os.makedirs(deq_dir)
    for f in os.listdir(path):
        if f.endswith(".json"):
            shutil.copy(os.path.join(path, f), deq_dir)
    strategy = SCHEMES[scheme][0] if fmt == "ct" else "tensor"
    out, deq = {}, {}
    for name, t in load_file(os.path.join(path, "model.safetensors")).items():
        t = t.float()
        if ".layers." in name and name.endswith(quantize) and not any(s in name for s in skip):
            tensors, deq[name] = _quantized(name, t, strategy)
            out.update(tensors)
        else:
            out[name] = deq[name] = t
    save_file(out, os.path.join(path, "model.safetensors"))
    save_file(deq, os.path.join(deq_dir, "model.safetensors"))
    if fmt == "ct":
        qc = {"quant_method": "compressed-tensors", "format": "float-quantized", "quantization_status": "compressed",
              "config_groups": {"group_0": _group(*SCHEMES[scheme])}, "kv_cache_scheme": None,
              "ignore": ["lm_head", r"re:.*mlp\.gate$", r"re:.*shared_expert_gate$"]}
    else:
        qc = {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": None,
              "exclude_modules": ["lm_head"]}
    qc.update(qc_extra or {})
    from model_utils import set_quantization_config

    set_quantization_config(path, qc)
    return deq_dir


def _greedy_matches(path: str, deq_dir: str) -> None:
    import transformers as tf
    from model_utils import hf_greedy, make_runner

    from radixserve.bench_one_batch import StaticBatch

    runner = make_runner(path)
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    for prompt, got in zip(PROMPTS, StaticBatch(runner).generate(PROMPTS, 8), strict=True):
        assert got == hf_greedy(hf, prompt, 8)
    assert runner.token_to_kv_pool.available_size() == runner.token_to_kv_pool.size


# ---------------------------------------------------------------- compressed-tensors
@pytest.mark.parametrize("scheme", list(SCHEMES))
def test_compressed_tensors_fp8_llama(tmp_path, scheme: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """Each FP8 scheme loads the written bytes and scales exactly; the layer's product is the reference's for its
    activation scheme (weight-only: 16-bit activations at any batch, where the others quantise them above SMALL_M
    rows); with W8A16 forced the model is the dequantised model, token-identical to transformers."""
    from model_utils import make_tiny_model

    path = str(tmp_path)
    make_tiny_model("llama", path)
    deq_dir = write_checkpoint(path, "ct", scheme)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    from safetensors.torch import load_file

    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    strategy, acts = SCHEMES[scheme]
    bn, bk = (16, 16) if strategy == "block" else (1, 64)
    for layer, parts in ((model.model.layers[0].self_attn.qkv_proj, ("q_proj", "k_proj", "v_proj")),
                         (model.model.layers[1].mlp.down_proj, ("down_proj",))):
        assert layer.weight.dtype == FP8
        sub = "self_attn" if "q_proj" in parts else "mlp"
        idx = 0 if sub == "self_attn" else 1
        ref_w = torch.cat([want[f"model.layers.{idx}.{sub}.{p}.weight"] for p in parts])
        k = ref_w.shape[1]
        torch.testing.assert_close(dequantize_blocks(layer.weight, layer.weight_scale, bn, bk if bn > 1 else k),
                                   ref_w, rtol=0, atol=0)
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert (getattr(qkv, "input_scale", None) is not None) == (acts == "static")
    x = torch.randn(40, 64, generator=torch.Generator().manual_seed(0))  # above SMALL_M: W8A8 unless weight-only
    act_group = None if acts is None else (16 if strategy == "block" else 64)
    ref = fp8_linear_ref(x, qkv.weight, qkv.weight_scale, bn, bk if bn > 1 else 64, None, act_group,
                         qkv.input_scale if acts == "static" else None)
    torch.testing.assert_close(qkv(x), ref)
    if acts is None:  # really 16-bit activations: the W8A8 product differs
        w8a8 = fp8_linear_ref(x, qkv.weight, qkv.weight_scale, 1, 64, None, 64)
        assert not torch.allclose(qkv(x), w8a8)
    if acts == "static":
        return  # the static activation scale rounds x: not the dequantised model
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    _greedy_matches(path, deq_dir)


@pytest.mark.parametrize("kind,scheme", [("qwen3_moe", "channel"), ("deepseek_v3", "block"),
                                         ("qwen2_moe", "weight_only")])
def test_compressed_tensors_fp8_moe_and_mla(tmp_path, kind: str, scheme: str,
                                            monkeypatch: pytest.MonkeyPatch) -> None:
    """MoE checkpoints: the experts' per-channel or block scales stack with their weights (this rank's rows of the
    intermediate dim), MLA's kv_b_proj is dequantised once, and the model (W8A16 forced) is token-identical to
    transformers on the dequantised weights."""
    from model_utils import make_tiny_model
    from safetensors.torch import load_file

    from radixserve.layers.quantization.fp8_moe import Fp8MoEMethod

    path = str(tmp_path)
    make_tiny_model(kind, path, initializer_range=0.08)
    deq_dir = write_checkpoint(path, "ct", scheme)
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    li = next(i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "experts"))
    experts = model.model.layers[li].mlp.experts
    assert isinstance(experts.quant_method, Fp8MoEMethod) and experts.w13_weight.dtype == FP8
    assert {n for n, _ in experts.named_parameters()} == {"w13_weight", "w2_weight", "w13_scale", "w2_scale"}
    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    sc = experts.quant_method.expert_scales(experts)
    inter = experts.inter_per_rank
    got_up = dequantize_blocks(experts.w13_weight[3], sc.w13[3], sc.group_n, sc.group_k13)[inter:]
    torch.testing.assert_close(got_up, want[f"model.layers.{li}.mlp.experts.3.up_proj.weight"], rtol=0, atol=0)
    got_down = dequantize_blocks(experts.w2_weight[2], sc.w2[2], sc.group_n, sc.group_k2)
    torch.testing.assert_close(got_down, want[f"model.layers.{li}.mlp.experts.2.down_proj.weight"], rtol=0, atol=0)
    assert experts.quant_method.activations_fp8(experts) is (False if scheme == "weight_only" else None)
    if kind == "deepseek_v3":
        kv_b = model.model.layers[1].self_attn.kv_b_proj
        assert kv_b.weight.dtype == torch.float32
        torch.testing.assert_close(kv_b.weight, want["model.layers.1.self_attn.kv_b_proj.weight"], rtol=0, atol=0)
    del model
    _greedy_matches(path, deq_dir)


def test_compressed_tensors_targets_and_ignore(tmp_path) -> None:
    """Only what a group targets is quantized (a regex on down_proj here), the ignore list wins, and a stacked
    layer whose matrices fall into different groups is refused."""
    from model_utils import make_tiny_model

    path = str(tmp_path)
    make_tiny_model("llama", path)
    write_checkpoint(path, "ct", "channel", quantize=("down_proj.weight",), skip=("layers.0.",),
                     qc_extra={"config_groups": {"g": _group("channel", "token", [r"re:.*\.down_proj$"])},
                               "ignore": ["lm_head", "model.layers.0.mlp.down_proj"]})
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    assert model.model.layers[1].mlp.down_proj.weight.dtype == FP8
    assert model.model.layers[0].mlp.down_proj.weight.dtype == torch.float32  # ignored
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == torch.float32  # not targeted
    assert model.model.layers[1].self_attn.qkv_proj.weight.dtype == torch.float32
    mixed = {"quant_method": "compressed-tensors", "config_groups": {
        "a": _group("channel", "token", [r"re:.*q_proj$"]), "b": _group("tensor", "static", [r"re:.*[kv]_proj$"])}}
    cfg = resolve_quant_config(None, mixed)
    qkv = model.model.layers[1].self_attn.qkv_proj
    with pytest.raises(ValueError, match="different compressed-tensors groups"):
        cfg.get_quant_method(qkv, "model.layers.1.self_attn.qkv_proj")
    split = {"quant_method": "compressed-tensors", "config_groups": {"a": _group("channel", "token")},
             "ignore": ["re:.*q_proj$"]}
    with pytest.raises(ValueError, match="some of its stacked matrices"):
        resolve_quant_config(None, split).get_quant_method(qkv, "model.layers.1.self_attn.qkv_proj")


def test_compressed_tensors_plain_names_are_whole_layer_names(tmp_path) -> None:
    """compressed-tensors (and llm-compressor, vLLM) match a plain `ignore` / `targets` entry against a layer's
    whole name (`re:` entries from its start): "down_proj" names no layer, so the checkpoint's down_proj layers
    are quantized and load so; a group targeting "o_proj" targets nothing, the full name targets that layer."""
    from model_utils import make_tiny_model

    path = str(tmp_path)
    make_tiny_model("llama", path)
    write_checkpoint(path, "ct", "channel", qc_extra={"ignore": ["lm_head", "down_proj", "mlp"]})
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    assert model.model.layers[0].mlp.down_proj.weight.dtype == FP8
    assert model.model.layers[1].mlp.gate_up_proj.weight.dtype == FP8
    cfg = resolve_quant_config(None, {"quant_method": "compressed-tensors", "config_groups": {
        "short": _group("channel", "token", ["o_proj"]),
        "full": _group("tensor", "static", ["model.layers.1.self_attn.o_proj"])}})
    assert [g.specificity("model.layers.0.self_attn.o_proj") for g in cfg.groups] == [0, 0]
    assert [g.specificity("model.layers.1.self_attn.o_proj") for g in cfg.groups] == [0, 3]
    from radixserve.layers.quantization.compressed_tensors import ct_name_matches

    assert ct_name_matches("model.layers.0.mlp.down_proj", r"re:.*down_proj$")
    assert not ct_name_matches("model.layers.0.mlp.down_proj", r"re:down_proj")


@pytest.mark.parametrize("change,match", [
    ({"weights": {"num_bits": 4, "type": "int", "strategy": "group", "group_size": 128}, "format": "pack-quantized"},
     "4-bit int weights with quantized activations"),
    ({"weights": {"num_bits": 2, "type": "int", "strategy": "channel"}, "format": "pack-quantized",
      "input_activations": None}, "2-bit int weights"),
    ({"weights": {"num_bits": 4, "type": "float", "strategy": "group", "group_size": 16},
      "format": "nvfp4-pack-quantized"}, "nvfp4"),
    ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}, "format": "int-quantized"},
     "format 'int-quantized'"),
    ({"weights": {"num_bits": 8, "type": "int", "strategy": "channel"}}, "8-bit int"),
    ({"weights": {"num_bits": 8, "type": "float", "strategy": "group", "group_size": 32}}, "strategy 'group'"),
    ({"weights": {"num_bits": 8, "type": "float", "strategy": "channel", "symmetric": False}}, "asymmetric"),
    ({"input_activations": {"num_bits": 8, "type": "float", "strategy": "token", "dynamic": False}},
     "static input activations"),
    ({"output_activations": {"num_bits": 8, "type": "float"}}, "output activations"),
    ({"targets": []}, "no targets"),
])
def test_compressed_tensors_refuses_what_is_not_fp8(change: dict, match: str) -> None:
    group = {**_group("channel", "token"), **change}
    with pytest.raises(ValueError, match=match):
        resolve_quant_config(None, {"quant_method": "compressed-tensors", "config_groups": {"g": group}})


def test_compressed_tensors_config_checks() -> None:
    ok = {"quant_method": "compressed-tensors", "config_groups": {"g": _group("block", "group")}}
    cfg = resolve_quant_config(None, ok)
    scheme = cfg.groups[0].scheme
    assert scheme.weight_block_size == [16, 16] and scheme.block_scale_name == "weight_scale"
    for extra, match in [({"quantization_status": "frozen"}, "quantization_status"),
                         ({"sparsity_config": {"format": "sparse-24-bitmask", "sparsity_structure": "2:4"}},
                          "sparsity"),
                         ({"transform_config": {"config_groups": {}}}, "transform"),
                         ({"config_groups": {}}, "no config_groups")]:
        with pytest.raises(ValueError, match=match):
            resolve_quant_config(None, {**ok, **extra})
    with pytest.raises(ValueError, match="contradicts"):
        resolve_quant_config("fp8", ok)
    with pytest.raises(ValueError, match="has none"):
        resolve_quant_config("compressed-tensors", None)
    dense = {**ok, "sparsity_config": {"format": "dense", "sparsity_structure": None}}
    assert resolve_quant_config(None, dense) is not None


def test_compressed_tensors_dummy_weights_take_the_layout(tmp_path) -> None:
    """--load-format dummy with a compressed-tensors config: each group's layers quantised online to its layout
    (blocks here), untargeted layers unquantized, a static scheme dynamic (nothing to read)."""
    from model_utils import make_tiny_model

    path = str(tmp_path)
    make_tiny_model("llama", path)
    write_checkpoint(path, "ct", "block", qc_extra={"config_groups": {
        "g": _group("block", "group", [r"re:.*mlp\..*"]), "h": _group("tensor", "static", [r"re:.*o_proj$"])}})
    model = get_model(ModelConfig(path), load_format="dummy", dtype=torch.float32, device="cpu")
    layer = model.model.layers[0]
    assert layer.mlp.gate_up_proj.weight.dtype == FP8 and layer.mlp.gate_up_proj.weight_scale.shape == (256 // 16, 4)
    assert layer.self_attn.o_proj.weight.dtype == FP8 and layer.self_attn.o_proj.weight_scale.shape == (64,)
    assert getattr(layer.self_attn.o_proj, "input_scale", None) is None
    assert layer.self_attn.qkv_proj.weight.dtype == torch.float32


# ---------------------------------------------------------------- ModelOpt
@pytest.mark.parametrize("layout", ["config", "hf_quant_config"])
def test_modelopt_fp8_checkpoint(tmp_path, layout: str) -> None:
    """A ModelOpt FP8 export (per-tensor weight scales, static input scales, k/v scales on k_proj / v_proj), its
    settings in config.json or in the older hf_quant_config.json: exact weights, the static product, the KV
    scales on the attention layers, excluded modules left alone."""
    from model_utils import make_tiny_model
    from safetensors.torch import load_file, save_file

    path = str(tmp_path)
    make_tiny_model("llama", path)
    deq_dir = write_checkpoint(path, "modelopt", qc_extra={"exclude_modules": ["lm_head", "model.layers.1.mlp.*"]},
                               skip=("layers.1.mlp.",))
    sd = load_file(os.path.join(path, "model.safetensors"))
    for i in range(2):
        sd[f"model.layers.{i}.self_attn.k_proj.k_scale"] = torch.tensor(0.5 + i)
        sd[f"model.layers.{i}.self_attn.v_proj.v_scale"] = torch.tensor(0.25)
    save_file(sd, os.path.join(path, "model.safetensors"))
    if layout == "hf_quant_config":
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        qc = cfg.pop("quantization_config")
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)
        qc.pop("quant_method")
        with open(os.path.join(path, "hf_quant_config.json"), "w") as f:
            json.dump({"producer": {"name": "modelopt", "version": "0.19"}, "quantization": qc}, f)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    want = load_file(os.path.join(deq_dir, "model.safetensors"))
    qkv = model.model.layers[0].self_attn.qkv_proj
    assert qkv.weight.dtype == FP8 and qkv.input_scale.shape == (1,)
    ref_w = torch.cat([want[f"model.layers.0.self_attn.{p}_proj.weight"] for p in "qkv"])
    torch.testing.assert_close(dequantize_blocks(qkv.weight, qkv.weight_scale, 1, 64), ref_w, rtol=0, atol=0)
    x = torch.randn(3, 64, generator=torch.Generator().manual_seed(0))
    torch.testing.assert_close(qkv(x), fp8_linear_ref(x, qkv.weight, qkv.weight_scale, 1, 64, None, 64,
                                                      qkv.input_scale))
    assert model.model.layers[1].mlp.down_proj.weight.dtype == torch.float32  # excluded
    assert model.model.layers[1].self_attn.o_proj.weight.dtype == FP8
    attn = model.model.layers[1].self_attn.attn
    assert (attn.k_scale, attn.v_scale) == (1.5, 0.25)


def test_modelopt_refuses_other_algorithms(tmp_path) -> None:
    with pytest.raises(ValueError, match="NVFP4"):
        resolve_quant_config(None, {"quant_method": "modelopt", "quant_algo": "NVFP4"})
    with pytest.raises(ValueError, match="kv_cache_quant_algo"):
        resolve_quant_config(None, {"quant_method": "modelopt", "quant_algo": "FP8", "kv_cache_quant_algo": "NVFP4"})
    with pytest.raises(ValueError, match="has neither"):
        resolve_quant_config("modelopt", None)
    nested = resolve_quant_config(None, {"quant_method": "modelopt", "quantization": {"quant_algo": "FP8",
                                                                                     "exclude_modules": ["lm_head"]}})
    assert nested.serialized and nested.activation_scheme == "static" and nested.ignored_layers == ["lm_head"]
    dummy = resolve_quant_config(None, {"quant_method": "modelopt", "quant_algo": "FP8"}, load_format="dummy")
    assert not dummy.serialized and dummy.activation_scheme == "dynamic"
    bad = tmp_path / "m"
    bad.mkdir()
    (bad / "hf_quant_config.json").write_text(json.dumps({"producer": {}}))
    from radixserve.model_loader.loader import _hf_quant_config

    class _Cfg:
        hf_config = object()
        is_gguf = False
        model_path = str(bad)

    with pytest.raises(ValueError, match="'quantization' section"):
        _hf_quant_config(_Cfg())


# ---------------------------------------------------------------- tensor parallelism
def test_channel_scales_shard_with_their_weights() -> None:
    """TP=2 ranks of per-channel fp8 layers (compressed-tensors' [N, 1] scales) hold exactly their rows' scales:
    column-parallel outputs concatenate to the whole, row-parallel partial sums add up to it; the experts' scales
    split with the intermediate dim (and EP=2 ranks keep their experts')."""
    from test_quant_fp8 import _full_weights, _layers, _load

    from radixserve.layers.moe.layer import FusedMoE
    from radixserve.layers.moe.router import RouterConfig
    from radixserve.layers.quantization import apply_quantization, finish_quantization
    from radixserve.layers.quantization.fp8 import Fp8Config

    cfg = Fp8Config(serialized=True, weight_strategy="channel")
    full = _full_weights(5)
    quant = {name: {sid: quantize_rows(w) for sid, w in shards.items()} for name, shards in full.items()}
    layers = [_layers(), _layers(0, 2), _layers(1, 2)]
    for group in layers:
        for name, layer in group.items():
            apply_quantization(layer, cfg)
            _load(layer, {sid: q for sid, (q, _) in quant[name].items()},
                  {"weight_scale": {sid: s[:, None] for sid, (_, s) in quant[name].items()}})
            finish_quantization(layer)
    whole, r0, r1 = layers
    x = torch.randn(5, 96, generator=torch.Generator().manual_seed(2))
    for name in ("qkv", "gate_up"):
        ref = whole[name](x[:, :64]).split(whole[name].output_sizes, dim=1)
        parts = [r[name](x[:, :64]).split(r[name].output_sizes, dim=1) for r in (r0, r1)]
        for i, chunk in enumerate(ref):
            torch.testing.assert_close(torch.cat([parts[0][i], parts[1][i]], dim=1), chunk)
    torch.testing.assert_close(r0["down"](x[:, :48]) + r1["down"](x[:, 48:]), whole["down"](x), rtol=1e-5,
                               atol=1e-5)
    with pytest.raises(ValueError, match="shape mismatch"):  # a per-tensor scale where a column is expected
        bad = _layers()["down"]
        apply_quantization(bad, cfg)
        bad.weight_scale.weight_loader(bad.weight_scale, torch.ones(1))

    e, h, i = 4, 32, 64
    g = torch.Generator().manual_seed(9)
    w13 = {(x_, s): quantize_rows(torch.randn(i, h, generator=g)) for x_ in range(e) for s in ("w1", "w3")}
    w2 = {x_: quantize_rows(torch.randn(h, i, generator=g)) for x_ in range(e)}
    for tp_rank, tp_size, ep_size in ((0, 2, 1), (1, 2, 1), (1, 2, 2)):
        kw = {"tp_rank": tp_rank, "tp_size": tp_size, "ep_size": ep_size}
        layer = FusedMoE(RouterConfig(num_experts=e, top_k=2), h, i, **kw)
        apply_quantization(layer, cfg)
        params = dict(layer.named_parameters())
        for (x_, s), (q, sc) in w13.items():
            params["w13_weight"].weight_loader(params["w13_weight"], q, s, x_)
            params["w13_weight_scale"].weight_loader(params["w13_weight_scale"], sc[:, None], s, x_)
        for x_, (q, sc) in w2.items():
            params["w2_weight"].weight_loader(params["w2_weight"], q, "w2", x_)
            params["w2_weight_scale"].weight_loader(params["w2_weight_scale"], sc[:, None], "w2", x_)
        finish_quantization(layer)
        sc = layer.quant_method.expert_scales(layer)
        part = slice(layer.moe_tp_rank * layer.inter_per_rank, (layer.moe_tp_rank + 1) * layer.inter_per_rank)
        for local in range(layer.num_local_experts):
            x_ = layer.expert_offset + local
            up = dequantize_blocks(layer.w13_weight[local], sc.w13[local], 1, h)[layer.inter_per_rank:]
            ref_up = w13[(x_, "w3")][0].float() * w13[(x_, "w3")][1][:, None]
            torch.testing.assert_close(up, ref_up[part], rtol=0, atol=0)
            down = dequantize_blocks(layer.w2_weight[local], sc.w2[local], 1, layer.inter_per_rank)
            torch.testing.assert_close(down, (w2[x_][0].float() * w2[x_][1][:, None])[:, part], rtol=0, atol=0)
