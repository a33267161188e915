"""On CUDA: the double_sparsity backend through a real model. Short batches replay the Triton backend's CUDA graphs,
long ones decode sparsely (eagerly); keeping every token, both give the Triton backend's greedy tokens (float32).
The kernels' own tests (tests/test_double_sparsity.py) also run on the GPU when there is one. Skipped without CUDA."""

from __future__ import annotations

import json
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402
from radixserve.layers.attention.double_sparsity_backend import CHANNEL_FILE_FORMAT  # noqa: E402


def runner(path: str, **kw):  # noqa: ANN003, ANN201
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=8,
                      cuda_graph_max_bs=8, **kw)
    return ModelRunner(ModelConfig(path), args)


def test_keep_all_equals_triton_with_graphs_for_short_batches(tmp_path) -> None:  # noqa: ANN001
    path = str(tmp_path / "m")
    make_tiny_model("llama", path)
    ch = tmp_path / "ch.json"
    ch.write_text(json.dumps({"format": CHANNEL_FILE_FORMAT, "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
                              "channels": [[list(range(16))[::-1]] * 2] * 2}))
    ds = runner(path, attention_backend="double_sparsity", ds_channel_config_path=str(ch), ds_heavy_channel_num=4,
                ds_heavy_token_num=512, ds_sparse_decode_threshold=24)
    assert ds.cuda_graph_runner is not None and ds.attn_backend.cuda_graph_max_seq_len() == 24
    triton = runner(path, attention_backend="triton")
    short = [[5, 17, 42, 99, 3], [1, 2, 3]]  # every step <= 24 tokens: graphs
    long = [list(range(30, 70)), [7] * 33]  # past the threshold: sparse, eager
    for prompts in (short, long):
        assert StaticBatch(ds).generate(prompts, 12) == StaticBatch(triton).generate(prompts, 12)


def test_decodes_riding_with_a_chunk_decode_sparsely_on_cuda(tmp_path) -> None:  # noqa: ANN001
    """The CPU test of the same name, on CUDA, where the step token budget (256 by default) is what makes decodes
    ride along with a prompt's chunks: the sparse rows of a MIXED batch give a decode step's tokens (float32)."""
    from test_double_sparsity import decodes_beside_a_chunk

    cuda = {"device": "cuda", "cuda_graph_max_bs": 4}
    plain, *others = decodes_beside_a_chunk(tmp_path, [{**cuda, "step_token_budget": 0},
                                                       {**cuda, "step_token_budget": 8},
                                                       {**cuda, "step_token_budget": 0, "enable_mixed_chunk": True}])
    assert all(o == plain for o in others)
