"""Sampling defaults from the model's `generation_config.json` (as vLLM does by default): the values a request
leaves unset. `--sampling-defaults none` keeps the engine's own (temperature 1, top_p 1, top_k off, ...)."""

from __future__ import annotations

import json
import logging
import os
from typing import Any

logger = logging.getLogger(__name__)

FIELDS = ("temperature", "top_p", "top_k", "min_p", "repetition_penalty")


def load_sampling_defaults(model_path: str | None) -> dict[str, Any]:
    """The sampling fields the model's generation_config.json sets ({} when it has none or there is no file)."""
    if model_path is None or not os.path.isdir(model_path):
        return {}
    path = os.path.join(model_path, "generation_config.json")
    if not os.path.isfile(path):
        return {}
    try:
        with open(path, encoding="utf-8") as f:
            cfg = json.load(f)
    except (OSError, ValueError) as e:
        logger.warning("ignoring %s: %s", path, e)
        return {}
    out = {k: cfg[k] for k in FIELDS if isinstance(cfg, dict) and cfg.get(k) is not None}
    from radixserve.sampling.sampling_params import SamplingParams

    try:
        SamplingParams.from_dict(dict(out)).verify()
    except (ValueError, TypeError) as e:
        logger.warning("ignoring the sampling defaults of %s: %s", path, e)
        return {}
    return out


def apply_defaults(params: dict[str, Any], defaults: dict[str, Any]) -> dict[str, Any]:
    """`params` with each default filled in where the request left the field unset (absent or null)."""
    for key, value in defaults.items():
        if params.get(key) is None:
            params[key] = value
    return params
