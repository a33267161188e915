"""GPU memory a ModelRunner's start-up stages take: the weights and KV pool, then each graph runner (decode, one-request
prefill, piecewise extend), read from torch's allocator before and after each is built.

    python benchmarks/startup_memory.py --model-path radixserve/configs/shapes/llama-3.1-8b --load-format dummy \\
        --context-length 4096 --cuda-graph-max-bs 512

Takes the server's flags. Prints a table (allocated / reserved / free GiB at each stage, and what each stage added)
and writes JSON (`--result-file`). CUDA only."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path
from typing import Any

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.server_args import ServerArgs  # noqa: E402

RUNNERS = (("cuda_graph_runner", "CudaGraphRunner"), ("prefill_graph_runner", "PrefillGraphRunner"),
           ("piecewise_graph_runner", "PiecewiseGraphRunner"))


def _sample(stage: str) -> dict[str, Any]:
    free, _ = torch.cuda.mem_get_info()
    return {"stage": stage, "allocated_gib": torch.cuda.memory_allocated() / 2**30,
            "reserved_gib": torch.cuda.memory_reserved() / 2**30, "free_gib": free / 2**30}


def _watch(samples: list[dict[str, Any]]) -> None:
    """Sample before and after each graph runner's constructor."""
    import importlib

    for module, name in RUNNERS:
        cls = getattr(importlib.import_module(f"radixserve.model_executor.{module}"), name)
        init = cls.__init__

        def watched(self: Any, *args: Any, _init: Any = init, _name: str = name, **kwargs: Any) -> None:
            samples.append(_sample(f"before {_name}"))
            try:
                _init(self, *args, **kwargs)
            finally:
                samples.append(_sample(f"after {_name}"))
        cls.__init__ = watched


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ServerArgs.add_cli_args(parser)
    parser.add_argument("--result-file", default="startup_memory.json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        raise SystemExit("startup_memory needs CUDA")
    server_args = ServerArgs.from_cli_args(args)
    from radixserve.entrypoints.engine import resolve_model
    from radixserve.model_executor.model_runner import ModelRunner

    samples: list[dict[str, Any]] = []
    _watch(samples)
    error = None
    try:
        runner = ModelRunner(resolve_model(server_args), server_args)
        samples.append(_sample("ready"))
        info = {"pool_tokens": runner.max_total_num_tokens, "cuda_graph_max_bs": runner.cuda_graph_max_bs,
                "max_running_requests": runner.max_running_requests}
    except torch.OutOfMemoryError as e:
        samples.append(_sample("out of memory"))
        error, info = str(e).splitlines()[0], {}
    print(f"{'stage':<32} {'allocated':>9} {'reserved':>9} {'free':>7} {'added':>7}  (GiB)")
    last = None
    for s in samples:
        added = "" if last is None or s["stage"].startswith("before") else f"{s['allocated_gib'] - last:7.2f}"
        print(f"{s['stage']:<32} {s['allocated_gib']:>9.2f} {s['reserved_gib']:>9.2f} {s['free_gib']:>7.2f} {added:>7}")
        last = s["allocated_gib"]
    print(info or f"failed: {error}")
    Path(args.result_file).write_text(json.dumps({"samples": samples, **info, "error": error}, indent=1))


if __name__ == "__main__":
    main()
