"""Reading Hugging Face checkpoints: safetensors (one file or the shards `model.safetensors.index.json` lists) and
PyTorch `.bin` files (`pytorch_model.bin` or the shards of `pytorch_model.bin.index.json`, `--load-format pt`),
unpickled with torch.load(weights_only=True): tensors and plain containers only, never arbitrary code."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"
PT_INDEX = "pytorch_model.bin.index.json"
# .bin files a Hugging Face folder may hold that are not weights (the Trainer's)
NOT_WEIGHTS = ("training_args.bin", "optimizer.bin", "scheduler.bin", "rng_state.bin", "scaler.bin")


def checkpoint_format(folder: str) -> str:
    """What "auto" loads from a model folder: "safetensors" where it has any (or none of either), else "pt"."""
    if os.path.isfile(os.path.join(folder, SAFETENSORS_INDEX)) or glob.glob(os.path.join(folder, "*.safetensors")):
        return "safetensors"
    return "pt" if os.path.isfile(os.path.join(folder, PT_INDEX)) or _bin_files(folder) else "safetensors"


def _bin_files(folder: str) -> list[str]:
    return sorted(f for f in glob.glob(os.path.join(folder, "*.bin")) if os.path.basename(f) not in NOT_WEIGHTS)


def _index_files(folder: str, index_name: str, kind: str) -> list[str] | None:
    """The files an index's weight map names (sorted, each checked to exist), or None without an index."""
    index_file = os.path.join(folder, index_name)
    if not os.path.isfile(index_file):
        return None
    try:
        with open(index_file, encoding="utf-8") as f:
            weight_map = json.load(f)["weight_map"]
        names = sorted(set(weight_map.values()))
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
        raise ValueError(f"cannot read {kind} index {index_file}: {e!r}") from e
    files = []
    for name in names:
        path = os.path.join(folder, name)
        if not os.path.isfile(path):
            raise ValueError(f"{kind} file {path} named in {index_file} is missing")
        files.append(path)
    if not files:
        raise ValueError(f"{kind} index {index_file} lists no files")
    return files


def list_pt_files(folder: str) -> list[str]:
    """The checkpoint's PyTorch weight files in load order (by `pytorch_model.bin.index.json`, else every weight
    `*.bin` in the folder, sorted)."""
    if not os.path.isdir(folder):
        raise ValueError(f"model folder does not exist: {folder}")
    files = _index_files(folder, PT_INDEX, "PyTorch checkpoint") or _bin_files(folder)
    if not files:
        raise ValueError(f"no PyTorch *.bin weight files in {folder}")
    return files


def _load_pt(path: str) -> dict[str, Any]:
    try:  # mmap: a shard's tensors are read as they are copied into the model, not all at once
        state = _torch_load(path)
    except Exception as e:  # UnpicklingError (not weights only), RuntimeError (not a torch file), OSError
        raise ValueError(f"cannot read PyTorch weights {path}: {e}") from e
    if not isinstance(state, dict) or not all(isinstance(v, torch.Tensor) for v in state.values()):
        raise ValueError(f"PyTorch weights {path} are not a state dict of tensors")
    return state


def _torch_load(path: str) -> Any:
    try:
        return torch.load(path, map_location="cpu", weights_only=True, mmap=True)
    except RuntimeError as e:  # a file in torch's legacy (pre-1.6) format cannot be memory-mapped: read it whole
        if "mmap" not in str(e):
            raise
        return torch.load(path, map_location="cpu", weights_only=True)


def count_pt_tensors(files: list[str]) -> int:
    return sum(len(_load_pt(path)) for path in files)


def pt_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, cpu tensor) for every tensor of every file, in file order."""
    for path in files:
        state = _load_pt(path)
        yield from state.items()
        del state


def list_safetensors_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files in load order.

    With `model.safetensors.index.json` these are the files its weight map names (sorted, so shard 1 comes first),
    each checked to exist; without it, every `*.safetensors` file in the folder, sorted.
    """
    if not os.path.isdir(folder):
        raise ValueError(f"model folder does not exist: {folder}")
    files = _index_files(folder, SAFETENSORS_INDEX, "safetensors")
    if files is not None:
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        others = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = ""
        if others:
            hint = (f" (found {', '.join(sorted(others))}; weights load from safetensors, PyTorch .bin files "
                    f"(--load-format pt) and GGUF)")
        raise ValueError(f"no *.safetensors weight files in {folder}{hint}")
    return files


def _open(path: str) -> Any:
    from safetensors import safe_open

    try:
        return safe_open(path, framework="pt", device="cpu")
    except Exception as e:  # SafetensorError, OSError, ...
        raise ValueError(f"cannot read safetensors file {path}: {e}") from e


def count_safetensors_tensors(files: list[str]) -> int:
    """How many tensors the files hold (reads only the headers)."""
    total = 0
    for path in files:
        with _open(path) as f:
            total += len(list(f.keys()))
    return total


def safetensors_weights_iterator(files: list[str]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, cpu tensor) for every tensor of every file, in file order and each file's stored order."""
    for path in files:
        with _open(path) as f:
            for name in f.keys():
                try:
                    tensor = f.get_tensor(name)
                except Exception as e:
                    raise ValueError(f"cannot read tensor {name!r} from safetensors file {path}: {e}") from e
                yield name, tensor
