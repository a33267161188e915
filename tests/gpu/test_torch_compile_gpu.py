"""On CUDA: --enable-torch-compile. The decode graphs of the compiled sizes give the uncompiled graphs' logits within
bf16 rounding and the same greedy tokens where the top two logits are apart; sizes above --torch-compile-max-bs
are captured as before. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402


def gpu_runner(path: str, **kw):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=1 << 14,
                      max_running_requests=16, cuda_graph_max_bs=16, **kw)
    return ModelRunner(ModelConfig(path), args)


def decode_logits(runner, prompts: list[list[int]], steps: int) -> list[torch.Tensor]:
    sb = StaticBatch(runner)
    batch, _ = sb.prefill(prompts)
    out = []
    for _ in range(steps):
        sb.decode(batch)
        out.append(sb.last_logits.next_token_logits.float().clone())
    sb.release(batch)
    return out


def test_compiled_graphs_equal_uncompiled(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path), num_hidden_layers=3)
    plain = gpu_runner(str(tmp_path))
    compiled = gpu_runner(str(tmp_path), enable_torch_compile=True, torch_compile_max_bs=2)
    assert compiled.cuda_graph_runner.compile_bs == {1, 2}
    g = torch.Generator().manual_seed(0)
    for bs in (1, 2, 3, 9):  # 3 and 9 replay the uncompiled graphs of 4 and 16
        prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist()
                   for n in torch.randint(5, 40, (bs,), generator=g)]
        want = decode_logits(plain, prompts, 4)
        got = decode_logits(compiled, prompts, 4)
        for w, o in zip(want, got, strict=True):
            scale = w.abs().max().item()
            torch.testing.assert_close(o, w, rtol=0, atol=0.02 * scale)
            top2 = w.topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 0.05 * scale
            assert torch.equal(o.argmax(-1)[clear], w.argmax(-1)[clear])


def assert_decode_logits_close(plain, compiled, seed: int) -> None:  # noqa: ANN001
    """Three decode steps of random prompts at batch 1 and 3 (the graph of 4), plain against compiled runner: the
    logits within bf16 rounding."""
    g = torch.Generator().manual_seed(seed)
    for bs in (1, 3):
        prompts = [torch.randint(3, 250, (int(n),), generator=g).tolist()
                   for n in torch.randint(5, 40, (bs,), generator=g)]
        for w, o in zip(decode_logits(plain, prompts, 3), decode_logits(compiled, prompts, 3), strict=True):
            torch.testing.assert_close(o, w, rtol=0, atol=0.02 * w.abs().max().item())


def test_compiled_graphs_with_fp8_weights_equal_uncompiled(tmp_path) -> None:
    """fp8 layers inside the compiled graphs run their own kernels (the `quantized_linear` op): the same logits within
    bf16 rounding as the uncompiled fp8 graphs."""
    make_tiny_model("llama", str(tmp_path), num_hidden_layers=3)
    plain = gpu_runner(str(tmp_path), quantization="fp8")
    compiled = gpu_runner(str(tmp_path), quantization="fp8", enable_torch_compile=True, torch_compile_max_bs=4)
    assert_decode_logits_close(plain, compiled, seed=1)


def test_compiled_graphs_with_an_int8_lm_head_equal_uncompiled(tmp_path) -> None:
    """--quantize-lm-head: the int8 head's product is one opaque op inside the compiled graphs (`lm_head_int8`), the
    same logits within bf16 rounding as the uncompiled graphs, which write into the shared logits rows."""
    make_tiny_model("llama", str(tmp_path), num_hidden_layers=3)
    kw = dict(quantization="fp8", quantize_lm_head=True)
    plain = gpu_runner(str(tmp_path), **kw)
    compiled = gpu_runner(str(tmp_path), enable_torch_compile=True, torch_compile_max_bs=4, **kw)
    assert compiled.model.lm_head.weight.dtype == torch.int8
    assert_decode_logits_close(plain, compiled, seed=2)


def test_compiled_graphs_of_a_moe_model_equal_uncompiled(tmp_path) -> None:
    """DeepSeek-V2 (MLA, shared experts): the experts op runs the fused kernels inside the compiled graphs, with the
    shared experts left to the model's MLP (never folded into the experts' launch there): the uncompiled graphs'
    logits within bf16 rounding."""
    make_tiny_model("deepseek_v2", str(tmp_path))
    plain = gpu_runner(str(tmp_path))
    compiled = gpu_runner(str(tmp_path), enable_torch_compile=True, torch_compile_max_bs=4)
    assert_decode_logits_close(plain, compiled, seed=2)


def test_torch_compile_needs_cuda_graphs(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path))
    with pytest.raises(ValueError, match="enable-torch-compile"):
        gpu_runner(str(tmp_path), enable_torch_compile=True, disable_cuda_graph=True)
