"""PyTorch `.bin` checkpoints (`--load-format pt`, and "auto" on a folder without safetensors): one file or the shards
of `pytorch_model.bin.index.json` load to the same tokens as transformers; the Trainer's other .bin files are not
weights; a pickle that is not plain tensors is refused without being run."""

from __future__ import annotations

import os
import pickle

import pytest
import torch
from model_utils import hf_greedy, make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch
from radixserve.configs.model_config import ModelConfig
from radixserve.model_loader.weight_utils import checkpoint_format, list_pt_files, pt_weights_iterator

PROMPTS = [[5, 17, 42, 99, 3], list(range(30, 50))]


def save_bin(hf: torch.nn.Module, path: str, shards: int) -> None:
    """The checkpoint as transformers 4 wrote it with safe_serialization=False: pytorch_model.bin, or shards and
    pytorch_model.bin.index.json (transformers 5 writes safetensors only)."""
    import json

    os.makedirs(path, exist_ok=True)
    hf.config.save_pretrained(path)
    state = {k: v.contiguous() for k, v in hf.state_dict().items()}
    if shards == 1:
        torch.save(state, os.path.join(path, "pytorch_model.bin"))
        return
    names = sorted(state)
    weight_map = {}
    for i in range(shards):
        file = f"pytorch_model-{i + 1:05d}-of-{shards:05d}.bin"
        part = {k: state[k] for k in names[i::shards]}
        torch.save(part, os.path.join(path, file))
        weight_map.update({k: file for k in part})
    with open(os.path.join(path, "pytorch_model.bin.index.json"), "w") as f:
        json.dump({"metadata": {}, "weight_map": weight_map}, f)


@pytest.mark.parametrize("shards", [1, 3], ids=["one-file", "sharded"])
def test_bin_checkpoint_matches_transformers(shards: int, tmp_path) -> None:  # noqa: ANN001
    hf = make_tiny_model("llama", str(tmp_path / "st"))
    path = str(tmp_path / "bin")
    save_bin(hf, path, shards)
    torch.save({"lr": torch.tensor(1e-4)}, os.path.join(path, "training_args.bin"))  # not a weight file
    assert checkpoint_format(path) == "pt" and ModelConfig(path).load_format == "pt"
    files = [os.path.basename(f) for f in list_pt_files(path)]
    assert "training_args.bin" not in files and len(files) == shards
    runner = make_runner(path)  # --load-format auto
    assert StaticBatch(runner).generate(PROMPTS, 8) == [hf_greedy(hf, p, 8) for p in PROMPTS]


class _Payload:
    def __reduce__(self):  # noqa: ANN204 - what a malicious checkpoint carries
        return (os.system, ("touch PWNED",))


def test_a_pickle_with_code_is_refused_unrun(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.chdir(tmp_path)
    with open(tmp_path / "pytorch_model.bin", "wb") as f:
        pickle.dump({"model.embed_tokens.weight": _Payload()}, f)
    with pytest.raises(ValueError, match="cannot read PyTorch weights"):
        list(pt_weights_iterator(list_pt_files(str(tmp_path))))
    assert not (tmp_path / "PWNED").exists()


def test_format_errors(tmp_path) -> None:  # noqa: ANN001
    with pytest.raises(ValueError, match="no PyTorch"):
        list_pt_files(str(tmp_path))
    torch.save([torch.zeros(1)], tmp_path / "pytorch_model.bin")  # a list, not a state dict
    with pytest.raises(ValueError, match="not a state dict of tensors"):
        list(pt_weights_iterator(list_pt_files(str(tmp_path))))
    (tmp_path / "pytorch_model.bin.index.json").write_text('{"weight_map": {"a": "pytorch_model-00001.bin"}}')
    with pytest.raises(ValueError, match="pytorch_model-00001.bin named in"):
        list_pt_files(str(tmp_path))


def test_a_legacy_format_file_loads_without_mmap(tmp_path) -> None:  # noqa: ANN001
    """torch.save's pre-1.6 format (some older checkpoints) cannot be memory-mapped: it is read whole instead."""
    state = {"a": torch.arange(4.0), "b": torch.ones(2, 3)}
    torch.save(state, tmp_path / "pytorch_model.bin", _use_new_zipfile_serialization=False)
    got = dict(pt_weights_iterator(list_pt_files(str(tmp_path))))
    assert set(got) == {"a", "b"} and all(torch.equal(got[k], v) for k, v in state.items())
