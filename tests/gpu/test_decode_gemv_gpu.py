"""On CUDA: the batch-1 decode graphs with the one-row Triton GEMV (a table entry for every linear shape of the
model, SiLU·mul in gate_up's epilogue, the rotary embedding and the KV store in q/k/v's) give the cuBLAS graphs'
logits within bf16 rounding, and the greedy ids the graphs take with the Triton row argmax are the argmax of their
logits. Batch 2 keeps cuBLAS. A batch of 20 through the 17..256-row product (`triton_ops/gemm_mid`) likewise.
Skipped without a GPU."""

from __future__ import annotations

import contextlib
import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402
from radixserve.layers.quantization import gemv_configs  # noqa: E402


def gpu_runner(path: str, max_bs: int = 8):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=1 << 14,
                      max_running_requests=max_bs, cuda_graph_max_bs=max_bs)
    return ModelRunner(ModelConfig(path), args)


@contextlib.contextmanager
def gemv_table(tmp_path, monkeypatch, table: dict):  # noqa: ANN001, ANN201
    """The GEMV table with `table`'s entries added (RADIXSERVE_GEMV_CONFIGS) while the block runs."""
    picks = tmp_path / "picks.json"
    picks.write_text(json.dumps({"configs": table}))
    monkeypatch.setenv("RADIXSERVE_GEMV_CONFIGS", str(picks))
    gemv_configs.reload()
    try:
        yield
    finally:
        monkeypatch.delenv("RADIXSERVE_GEMV_CONFIGS")
        gemv_configs.reload()


def decode(runner, prompts: list[list[int]], steps: int) -> tuple[list[torch.Tensor], list[list[int]]]:
    sb = StaticBatch(runner)
    batch, _ = sb.prefill(prompts)
    logits, ids = [], []
    for _ in range(steps):
        ids.append(sb.decode(batch))
        logits.append(sb.last_logits.next_token_logits.float().clone())
    sb.release(batch)
    return logits, ids


def test_gemv_graphs_equal_cublas_graphs(tmp_path, monkeypatch) -> None:
    from radixserve.layers.linear import MergedColumnParallelLinear, QKVParallelLinear, _LinearBase
    from radixserve.models.llama import LlamaAttention

    model = tmp_path / "m"
    make_tiny_model("llama", str(model), num_hidden_layers=3)
    plain = gpu_runner(str(model))
    table = {}
    for mod in plain.model.modules():
        if isinstance(mod, _LinearBase):
            n, k = mod.weight.shape
            table[gemv_configs.key("row16", 1, n, k)] = gemv_configs.GemvConfig("ew", 2, 64).to_dict()
            if isinstance(mod, QKVParallelLinear):
                table[gemv_configs.key("row16_rope", 1, n, k)] = gemv_configs.GemvConfig("ew", 2, 64).to_dict()
            if isinstance(mod, MergedColumnParallelLinear):
                table[gemv_configs.key("row16_silu", 1, n, k)] = gemv_configs.GemvConfig("ew", 2, 64).to_dict()
    lm_head = plain.model.lm_head.weight  # the LM head's one-row product too (logits_processor)
    table[gemv_configs.key("row16", 1, *lm_head.shape)] = gemv_configs.GemvConfig("ew", 2, 64).to_dict()
    with gemv_table(tmp_path, monkeypatch, table):
        fast = gpu_runner(str(model))
        layers = [m for m in fast.model.modules() if isinstance(m, _LinearBase)]
        assert layers and all(m.__dict__.get("_gemv_cfg", {}).get(False) is not None or
                              isinstance(m, (MergedColumnParallelLinear, QKVParallelLinear)) for m in layers)
        # q/k/v at one row: the same GEMV with the rotary embedding and the KV store in its epilogue
        attn = [m for m in fast.model.modules() if isinstance(m, LlamaAttention)]
        assert attn and all(m.__dict__.get("_rope_cfg") is not None for m in attn)
        assert any(m.__dict__.get("_gemv_cfg", {}).get(True) is not None for m in layers)  # gate_up with SiLU·mul
        g = torch.Generator().manual_seed(0)
        for bs in (1, 2):
            prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist()
                       for n in torch.randint(5, 40, (bs,), generator=g)]
            want, _ = decode(plain, prompts, 4)
            got, ids = decode(fast, prompts, 4)
            for w, o, step_ids in zip(want, got, ids, strict=True):
                scale = w.abs().max().item()
                torch.testing.assert_close(o, w, rtol=0, atol=0.02 * scale)
                assert step_ids == o.argmax(-1).tolist()  # the graph's Triton argmax of its own logits


def test_mid_gemm_graphs_equal_cublas_graphs(tmp_path, monkeypatch) -> None:
    """A batch of 20 decoding through the 17..256-row Triton product (`triton_ops/gemm_mid`: every linear from the
    table, gate_up with SiLU·mul in its epilogue, split over K with the tickets) gives cuBLAS's logits within bf16
    rounding, in CUDA graphs replayed step after step."""
    from radixserve.layers.linear import MergedColumnParallelLinear, _LinearBase

    model = tmp_path / "m"
    make_tiny_model("llama", str(model), num_hidden_layers=3)

    plain = gpu_runner(str(model), max_bs=24)
    tile = gemv_configs.GemvConfig("tn", 16, 32, 4, 3, block_m=16, split_k=2).to_dict()
    table = {}
    for mod in plain.model.modules():
        if isinstance(mod, _LinearBase):
            n, k = mod.weight.shape
            table[f"mid16/32/{n}/{k}"] = tile
            if isinstance(mod, MergedColumnParallelLinear):
                table[f"mid16_silu/32/{n}/{k}"] = tile
    with gemv_table(tmp_path, monkeypatch, table):
        fast = gpu_runner(str(model), max_bs=24)
        g = torch.Generator().manual_seed(1)
        prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist()
                   for n in torch.randint(5, 40, (20,), generator=g)]
        want, _ = decode(plain, prompts, 4)
        got, _ = decode(fast, prompts, 4)
        layers = [m for m in fast.model.modules() if isinstance(m, _LinearBase)]
        # (the graph's rows: 20 or the captured size above it)
        def took(m: _LinearBase, silu: bool) -> bool:
            return any(c is not None for (_, s), c in m.__dict__.get("_mid_cfg", {}).items() if s == silu)

        assert all(took(m, False) for m in layers if not isinstance(m, MergedColumnParallelLinear))
        assert any(took(m, True) for m in layers)
        for w, o in zip(want, got, strict=True):
            torch.testing.assert_close(o, w, rtol=0, atol=0.02 * w.abs().max().item())
