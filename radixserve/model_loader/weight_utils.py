"""Reading Hugging Face safetensors checkpoints: one file or shards listed by `model.safetensors.index.json`."""

from __future__ import annotations

import glob
import json
import os
from collections.abc import Iterator
from typing import Any

import torch

SAFETENSORS_INDEX = "model.safetensors.index.json"


def list_safetensors_files(folder: str) -> list[str]:
    """The checkpoint's safetensors files in load order.

    With `model.safetensors.index.json` these are the files its weight map names (sorted, so shard 1 comes first),
    each checked to exist; without it, every `*.safetensors` file in the folder, sorted.
    """
    if not os.path.isdir(folder):
        raise ValueError(f"model folder does not exist: {folder}")
    index_file = os.path.join(folder, SAFETENSORS_INDEX)
    if os.path.isfile(index_file):
        try:
            with open(index_file, encoding="utf-8") as f:
                weight_map = json.load(f)["weight_map"]
            names = sorted(set(weight_map.values()))
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, AttributeError) as e:
            raise ValueError(f"cannot read safetensors index {index_file}: {e!r}") from e
        files = []
        for name in names:
            path = os.path.join(folder, name)
            if not os.path.isfile(path):
                raise ValueError(f"safetensors file {path} named in {index_file} is missing")
            files.append(path)
        if not files:
            raise ValueError(f"safetensors index {index_file} lists no files")
        return files
    files = sorted(glob.glob(os.path.join(folder, "*.safetensors")))
    if not files:
        others = [f for f in os.listdir(folder) if f.endswith((".bin", ".pt", ".pth", ".gguf"))]
        hint = ""
        if others:
            hint = f" (found {', '.join(sorted(others))}; only safetensors and GGUF weights are supported)"
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
