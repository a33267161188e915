"""Offline calibration for the double_sparsity attention backend: which channels of each KV head carry q . k.

    python -m radixserve.calibrate_double_sparsity --model-path MODEL --out channels.json
    python -m radixserve.launch_server --model-path MODEL --attention-backend double_sparsity \\
        --ds-channel-config-path channels.json

Runs the model (dense attention, prefill only) over sample text — `--text-file`, or by default this package's own
source files — in sequences of `--seq-len` tokens, and accumulates per layer, KV head and channel c:

- `qk` (default): the mean over tokens and the head's query heads of |q_c * k_c| (queries and keys after RoPE),
  how much channel c adds to attention scores;
- `k`: the mean |k_c|.

The file lists, per layer and KV head, every channel from the largest statistic down; the backend keeps the first
`--ds-heavy-channel-num` of them. Any ServerArgs flag (device, dtype, --load-format dummy, ...) applies to the run.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
from typing import Any

import torch

from radixserve.layers.attention.double_sparsity_backend import CHANNEL_FILE_FORMAT
from radixserve.server_args import ServerArgs

logger = logging.getLogger(__name__)
METRICS = ("qk", "k")


def sample_ids(tok: Any, text: str, num_tokens: int) -> list[int]:
    """The first num_tokens token ids of text. A token is rarely under 2 characters: only as much text as the run
    can use is encoded. The ids are cut into sequences of --seq-len later, so the tokenizer's warning about ids
    longer than the model's context ("will result in indexing errors") does not apply: it is silenced."""
    return tok.encode(text[:32 * num_tokens], verbose=False)[:num_tokens]


def default_text() -> str:
    """This package's Python sources, concatenated (always at hand, a few hundred thousand tokens)."""
    root = os.path.dirname(os.path.abspath(__file__))
    parts = []
    for dirpath, dirnames, filenames in os.walk(root):
        dirnames.sort()
        for name in sorted(filenames):
            if name.endswith(".py"):
                with open(os.path.join(dirpath, name), encoding="utf-8") as f:
                    parts.append(f.read())
    return "\n\n".join(parts)


class ChannelStats:
    """Per layer: running sums of |q_c k_c| (over query heads of a KV head) and |k_c|, and the token count."""

    def __init__(self, num_layers: int) -> None:
        self.qk: list[torch.Tensor | None] = [None] * num_layers
        self.k: list[torch.Tensor | None] = [None] * num_layers
        self.tokens = [0] * num_layers

    def add(self, layer_id: int, q: torch.Tensor, k: torch.Tensor, num_kv_heads: int, head_dim: int) -> None:
        k3 = k.detach().float().reshape(-1, num_kv_heads, head_dim)
        q4 = q.detach().float().reshape(k3.shape[0], num_kv_heads, -1, head_dim)
        qk = (q4 * k3.unsqueeze(2)).abs().mean(dim=2).sum(dim=0).cpu()  # [Hkv, D]
        ka = k3.abs().sum(dim=0).cpu()
        self.qk[layer_id] = qk if self.qk[layer_id] is None else self.qk[layer_id] + qk
        self.k[layer_id] = ka if self.k[layer_id] is None else self.k[layer_id] + ka
        self.tokens[layer_id] += k3.shape[0]

    def ranking(self, metric: str) -> list[list[list[int]]]:
        sums = self.qk if metric == "qk" else self.k
        if any(s is None for s in sums):
            raise RuntimeError("some layers saw no tokens: did the model run?")
        return [s.argsort(dim=-1, descending=True, stable=True).tolist() for s in sums]  # type: ignore[union-attr]


def calibrate(runner: Any, sequences: list[list[int]]) -> ChannelStats:
    """Prefill each sequence through the runner, collecting the attention layers' q and k."""
    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.radix_attention import RadixAttention

    cfg = runner.model_config
    stats = ChannelStats(cfg.num_hidden_layers)

    def hook(module: RadixAttention, args: tuple) -> None:
        forward_batch = args[3]
        if forward_batch.forward_mode.is_extend():
            stats.add(module.layer_id, args[0], args[1], module.tp_k_head_num, module.head_dim)

    handles = [m.register_forward_pre_hook(hook) for m in runner.model.modules() if isinstance(m, RadixAttention)]
    if not handles:
        raise ValueError("the model has no RadixAttention layers to calibrate")
    try:
        static = StaticBatch(runner)
        for seq in sequences:
            batch, _ = static.prefill([seq])
            static.release(batch)
    finally:
        for h in handles:
            h.remove()
    return stats


def write_channel_file(path: str, stats: ChannelStats, metric: str, model_config: Any, meta: dict) -> dict:
    data = {"format": CHANNEL_FILE_FORMAT, "metric": metric, "num_layers": model_config.num_hidden_layers,
            "num_kv_heads": model_config.num_key_value_heads, "head_dim": model_config.head_dim, **meta,
            "channels": stats.ranking(metric)}
    with open(path, "w", encoding="utf-8") as f:
        json.dump(data, f)
    return data


def main(argv: list[str] | None = None) -> dict:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--out", required=True, help="channel file to write (JSON)")
    parser.add_argument("--text-file", help="sample text (default: this package's Python sources)")
    parser.add_argument("--num-tokens", type=int, default=8192, help="tokens of sample text to run (default: 8192)")
    parser.add_argument("--seq-len", type=int, default=1024, help="tokens per prefilled sequence (default: 1024)")
    parser.add_argument("--metric", choices=METRICS, default="qk", help="channel ranking (default: qk)")
    args = parser.parse_args(argv)
    if args.num_tokens < 1 or args.seq_len < 1:
        raise ValueError("--num-tokens and --seq-len must be positive")
    server_args = ServerArgs.from_cli_args(args)
    if server_args.tp_size != 1:
        raise ValueError("calibration runs on one device (--tp-size 1); the file covers every KV head")
    server_args.attention_backend = None  # dense: the device's default backend
    server_args.disable_cuda_graph = True
    server_args.validate()
    logging.basicConfig(level=server_args.log_level.upper())
    from radixserve.entrypoints.engine import resolve_model
    from radixserve.model_executor.model_runner import ModelRunner

    model_config = resolve_model(server_args)
    if getattr(model_config, "is_mla", False):
        raise ValueError("MLA models (a latent KV cache) have no per-head keys to calibrate")
    seq_len = min(args.seq_len, model_config.context_len)
    if server_args.max_total_tokens is None:
        server_args.max_total_tokens = seq_len + 64
    runner = ModelRunner(model_config, server_args)
    if server_args.skip_tokenizer_init:  # e.g. --load-format dummy without a tokenizer: random ids
        gen = torch.Generator().manual_seed(server_args.random_seed)
        ids = torch.randint(0, model_config.vocab_size, (args.num_tokens,), generator=gen).tolist()
    else:
        from radixserve.managers.tokenizer_utils import get_tokenizer

        if args.text_file:
            with open(args.text_file, encoding="utf-8") as f:
                text = f.read()
        else:
            text = default_text()
        tok = get_tokenizer(server_args.tokenizer_path, server_args.trust_remote_code)
        ids = sample_ids(tok, text, args.num_tokens)
    sequences = [ids[i:i + seq_len] for i in range(0, len(ids), seq_len)]
    sequences = [s for s in sequences if len(s) > 1]
    if not sequences:
        raise ValueError("the sample text has too few tokens")
    stats = calibrate(runner, sequences)
    meta = {"model": os.path.basename(str(server_args.model_path).rstrip("/")), "tokens": sum(map(len, sequences))}
    data = write_channel_file(args.out, stats, args.metric, model_config, meta)
    print(f"wrote {args.out}: {data['num_layers']} layers x {data['num_kv_heads']} KV heads x {data['head_dim']} "
          f"channels ranked by mean |{'q*k' if args.metric == 'qk' else 'k'}| over {meta['tokens']} tokens")
    return data


if __name__ == "__main__":
    main()
