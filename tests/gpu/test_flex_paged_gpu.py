"""On CUDA: the paged KV cache (--page-size 16) and the flex backend (compiled FlexAttention kernels, decode under
CUDA graphs) give the greedy tokens of the Triton backend at page size 1; torch_native decodes under CUDA graphs;
the scheduler with overlap, chunked prefill and the radix cache at page size 16 equals page size 1. Skipped without
a GPU."""

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


def runner(path: str, backend: str, page_size: int = 1, graphs: bool = True):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="float32", max_total_tokens=4096, max_running_requests=8,
                      cuda_graph_max_bs=8, attention_backend=backend, page_size=page_size,
                      disable_cuda_graph=not graphs)
    return ModelRunner(ModelConfig(path), args)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = str(tmp_path_factory.mktemp("tiny"))
    make_tiny_model("llama", path)
    return path


@pytest.fixture(scope="module")
def triton_tokens(tiny) -> list[list[int]]:
    return StaticBatch(runner(tiny, "triton")).generate(PROMPTS, 12)


def test_triton_paged_with_graphs_same_tokens(tiny, triton_tokens) -> None:
    r = runner(tiny, "triton", page_size=16)
    assert r.cuda_graph_runner is not None
    assert StaticBatch(r).generate(PROMPTS, 12) == triton_tokens


def test_scheduler_overlap_chunked_radix_page16_equals_page1(tiny) -> None:
    from test_scheduler import run, workload

    reqs = workload(n=8)
    kw = dict(device="cuda", enable_overlap_schedule=True, chunked_prefill_size=16, cuda_graph_max_bs=8)
    base = run(tiny, reqs, **kw)
    assert run(tiny, reqs, page_size=16, **kw) == base
    assert run(tiny, reqs, page_size=16, attention_backend="flex", **kw) == base


def test_torch_native_decodes_under_cuda_graphs(tiny, triton_tokens) -> None:
    r = runner(tiny, "torch_native")
    assert r.cuda_graph_runner is not None
    assert StaticBatch(r).generate(PROMPTS, 12) == triton_tokens


@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_with_graphs_same_tokens(tiny, triton_tokens, page_size) -> None:
    r = runner(tiny, "flex", page_size=page_size)
    assert r.cuda_graph_runner is not None
    assert StaticBatch(r).generate(PROMPTS, 12) == triton_tokens


@pytest.mark.parametrize("page_size,hq,hkv,dtype,tol", [(1, 8, 2, torch.float32, 2e-3),
                                                        (16, 32, 8, torch.bfloat16, 3e-2)])
def test_flex_compiled_kernels_match_torch_native(page_size, hq, hkv, dtype, tol) -> None:
    from test_flex_attention import run_case

    run_case(hq, hkv, page_size, prefix_lens=[0, 5, 16, 33], ext_lens=[7, 1, 20, 140], window=-1, seed=1,
             device="cuda", dtype=dtype, d=64 if dtype == torch.float32 else 128, tol=tol)


def test_flex_sliding_window_with_graphs(tmp_path) -> None:
    import transformers as tf

    torch.manual_seed(0)
    cfg = tf.MistralConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=256, max_position_embeddings=512, sliding_window=6)
    model = tf.AutoModelForCausalLM.from_config(cfg).float().eval()
    model.save_pretrained(str(tmp_path))
    native = StaticBatch(runner(str(tmp_path), "torch_native", graphs=False)).generate(PROMPTS, 16)
    assert StaticBatch(runner(str(tmp_path), "flex", page_size=16)).generate(PROMPTS, 16) == native


@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_graph_block_kernel_on_the_gpu(page_size) -> None:
    """The compiled block-list kernel of flex's decode graphs against the torch lists (the CPU test, on CUDA)."""
    from test_flex_attention import test_flex_graph_block_kernel_equals_torch_lists

    test_flex_graph_block_kernel_equals_torch_lists(page_size)
