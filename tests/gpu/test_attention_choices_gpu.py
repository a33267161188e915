"""On CUDA: --attention-backend torch_native decodes under CUDA graphs and gives the Triton backend's greedy tokens;
sliding-window models give the same tokens on both backends with CUDA graphs on. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402

PROMPTS = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 70))]


def runner(path: str, backend: str):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=8,
                      cuda_graph_max_bs=8, attention_backend=backend)
    return ModelRunner(ModelConfig(path), args)


def test_torch_native_on_cuda_runs_under_graphs(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path))
    native = runner(str(tmp_path), "torch_native")
    assert native.cuda_graph_runner is not None
    triton = runner(str(tmp_path), "triton")
    assert triton.cuda_graph_runner is not None
    assert StaticBatch(native).generate(PROMPTS, 12) == StaticBatch(triton).generate(PROMPTS, 12)


def test_sliding_window_same_tokens_on_both_backends_with_graphs(tmp_path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, sliding_window=6)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "q_proj" in name or "k_proj" in name:
                p.mul_(4.0)
    model.save_pretrained(str(tmp_path))
    native = StaticBatch(runner(str(tmp_path), "torch_native")).generate(PROMPTS, 16)
    assert StaticBatch(runner(str(tmp_path), "triton")).generate(PROMPTS, 16) == native
