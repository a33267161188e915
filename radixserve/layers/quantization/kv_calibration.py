"""Per-layer fp8 KV-cache scales measured at startup (`--calculate-kv-scales`), for checkpoints that ship none.

An fp8 pool stores k / k_scale; with the default scale of 1.0 a model whose keys and values are small (SmolLM2's
largest |v| in a layer is ~0.8) keeps most of them in e4m3's subnormal range, and perplexity suffers. This runs one
prefill over a fixed calibration text before the CUDA graphs are captured, records the largest |k| and |v| each
attention layer receives (after rotary), and sets k_scale = HEADROOM * amax(k) / fp8 max (likewise v) on every layer
whose checkpoint gave no scale. Values beyond the calibrated range later saturate at the fp8 maximum (HEADROOM
leaves them a factor of 2). The text is the Zen of Python, read from the standard library's `this` module: short,
English, and unrelated to any evaluation text. vLLM's `--calculate-kv-scales` does the same from the first batch it
serves; measuring once at startup keeps the scales fixed for the CUDA graphs and identical between runs."""

from __future__ import annotations

import codecs
import importlib.util
import logging
import re
from typing import TYPE_CHECKING

import torch

if TYPE_CHECKING:
    from radixserve.model_executor.model_runner import ModelRunner

logger = logging.getLogger(__name__)

HEADROOM = 2.0


def calibration_text() -> str:
    """The Zen of Python, decoded from the `this` module's source (importing it would print it)."""
    spec = importlib.util.find_spec("this")
    if spec is None or spec.origin is None:
        raise ValueError("--calculate-kv-scales: the standard library's `this` module was not found")
    with open(spec.origin, encoding="utf-8") as f:
        src = f.read()
    m = re.search(r's = """(.*?)"""', src, re.S)
    if m is None:
        raise ValueError("--calculate-kv-scales: could not read the calibration text from the `this` module")
    return codecs.decode(m.group(1), "rot13")


def calculate_kv_scales(runner: ModelRunner, ids: list[int]) -> dict[int, tuple[float, float]]:
    """Prefill `ids` once through `runner` (its KV slots are freed afterwards) and set k_scale / v_scale on every
    attention layer whose checkpoint set none. Returns {layer_id: (k_scale, v_scale)} of the layers it set."""
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.managers.schedule_batch import Req, ScheduleBatch
    from radixserve.managers.tp_worker import run_model_worker_batch
    from radixserve.sampling.sampling_params import SamplingParams

    if not ids:
        raise ValueError("--calculate-kv-scales: the calibration text tokenized to nothing")
    layers = [m for m in runner.model.modules() if isinstance(m, RadixAttention)
              and not getattr(m, "kv_scales_from_checkpoint", False)]
    amax: dict[int, list[float]] = {}

    def record(mod: RadixAttention, args: tuple) -> None:
        k, v = args[1], args[2]
        seen = amax.setdefault(id(mod), [0.0, 0.0])
        seen[0] = max(seen[0], float(k.float().abs().max()))
        seen[1] = max(seen[1], float(v.float().abs().max()))

    hooks = [m.register_forward_pre_hook(record) for m in layers]
    try:
        req = Req("kv-calibration", list(ids), SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 1}))
        req.init_next_round_input(None)
        batch = ScheduleBatch([req], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                              runner.model_config.vocab_size)
        batch.prepare_for_extend()
        with torch.inference_mode():
            run_model_worker_batch(runner, batch.get_model_worker_batch())
        runner.token_to_kv_pool.free(runner.req_to_token_pool.read(req.req_pool_idx, 0, req.kv_committed_len))
        runner.req_to_token_pool.free(req.req_pool_idx)
    finally:
        for h in hooks:
            h.remove()
    fmax = float(torch.finfo(runner.kv_dtype).max)
    out = {}
    for m in layers:
        k_amax, v_amax = amax.get(id(m), (0.0, 0.0))
        if k_amax > 0:
            m.k_scale = HEADROOM * k_amax / fmax
        if v_amax > 0:
            m.v_scale = HEADROOM * v_amax / fmax
        out[m.layer_id] = (m.k_scale, m.v_scale)
    if out:
        ks, vs = [s[0] for s in out.values()], [s[1] for s in out.values()]
        logger.info("fp8 KV scales calculated on %d calibration tokens for %d layers: k %.4g..%.4g, v %.4g..%.4g",
                    len(ids), len(out), min(ks), max(ks), min(vs), max(vs))
    return out
