"""torch.compile of the decode forward (model_executor/torch_compile.py), on the CPU: the whole model traces in one
graph (fullgraph=True: no graph break, attention as the opaque `radixserve::attention` op) and the compiled decode
gives the uncompiled logits and tokens. aot_eager runs the traced graph through AOTAutograd (fake tensors, the op's
fake implementation, functionalisation) without inductor's code generation; the GPU test compiles with inductor."""

from __future__ import annotations

import pytest
import torch
from model_utils import make_runner, make_tiny_model

from radixserve.bench_one_batch import StaticBatch
from radixserve.model_executor.torch_compile import compile_forward, forward_context

PROMPTS = [[5, 17, 99, 3, 41, 8], [7, 7, 120, 64], [200, 1, 2, 3, 4, 5, 6, 7, 8]]


def _use_compiled_decode(runner, backend: str) -> list[int]:
    """Route the runner's decode batches through the compiled forward; returns the batch sizes it ran."""
    compiled = compile_forward(runner.model.forward, backend=backend, fullgraph=True)
    eager = runner.forward
    seen: list[int] = []

    def forward(fb):  # noqa: ANN001, ANN202
        if not fb.forward_mode.is_decode():
            return eager(fb)
        seen.append(fb.batch_size)
        with torch.inference_mode(), forward_context(fb):
            return compiled(fb.input_ids, fb.positions, fb)

    runner.forward = forward
    return seen


def _first_decode_logits(runner, on_prefilled=None) -> torch.Tensor:  # noqa: ANN001
    """The logits of one decode step of PROMPTS after their prefill (`on_prefilled` runs in between)."""
    sb = StaticBatch(runner)
    batch, _ = sb.prefill(PROMPTS)
    if on_prefilled is not None:
        on_prefilled()
    sb.decode(batch)
    logits = sb.last_logits.next_token_logits.clone()
    sb.release(batch)
    return logits


def _assert_compiled_decode_equals_eager(runner, new_tokens: int, on_prefilled=None) -> None:  # noqa: ANN001
    """Route the runner's decode through the compiled forward (aot_eager, one graph) and compare with eager: the
    greedy tokens of PROMPTS and the logits of one decode step."""
    expect = StaticBatch(runner).generate(PROMPTS, new_tokens)
    want = _first_decode_logits(runner)
    seen = _use_compiled_decode(runner, "aot_eager")
    assert StaticBatch(runner).generate(PROMPTS, new_tokens) == expect
    got = _first_decode_logits(runner, on_prefilled)
    assert seen and set(seen) == {3}
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("backend", ["cpu", "torch_native"])
def test_compiled_decode_equals_eager(backend: str, tmp_path) -> None:
    torch._dynamo.reset()
    path = str(tmp_path / "m")
    make_tiny_model("qwen2", path)  # q/k/v bias and tied embeddings on top of the Llama blocks
    _assert_compiled_decode_equals_eager(make_runner(path, attention_backend=backend), 6)


def test_quantized_layers_run_their_own_product_inside_the_compiled_decode(tmp_path, monkeypatch) -> None:
    """With fp8 weights the compiled decode keeps each quantized linear as one opaque op (`quantized_linear`): the
    graph traces without a break, gives the eager tokens and logits, and every run calls the method's product for
    every quantized layer (a traced product would run the graph's copy of it instead, calling nothing)."""
    from radixserve.layers.linear import _LinearBase
    from radixserve.layers.quantization.fp8 import Fp8LinearMethod

    torch._dynamo.reset()
    path = str(tmp_path / "m")
    make_tiny_model("llama", path)
    runner = make_runner(path, quantization="fp8")
    layers = [m for m in runner.model.modules() if isinstance(m, _LinearBase) and not m._plain]
    assert layers and all(isinstance(m.quant_method, Fp8LinearMethod) for m in layers)
    calls = []
    apply = Fp8LinearMethod.apply

    def count_calls() -> None:  # once the graph is compiled: a traced product would not call it again
        monkeypatch.setattr(Fp8LinearMethod, "apply", lambda self, layer, x, bias: calls.append(layer) or
                            apply(self, layer, x, bias))

    _assert_compiled_decode_equals_eager(runner, 5, on_prefilled=count_calls)
    assert sorted(map(id, calls)) == sorted(map(id, layers))  # the calls of the last compiled decode step


@pytest.mark.parametrize("kind", ["mixtral", "deepseek_v2"])
def test_moe_models_compile_in_one_graph(kind: str, tmp_path) -> None:
    """MoE layers are one opaque op (`moe_experts`) in the compiled decode: Mixtral and DeepSeek-V2 (MLA, shared
    experts, grouped routing off) trace without a graph break and give the eager tokens and logits (traced, the
    experts' torch reference fails on its routing-sized tensors)."""
    torch._dynamo.reset()
    path = str(tmp_path / "m")
    make_tiny_model(kind, path)
    _assert_compiled_decode_equals_eager(make_runner(path), 5)


def test_attention_op_needs_a_forward_context() -> None:
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.model_executor.torch_compile import compiled_attention

    layer = RadixAttention(2, 8, 8 ** -0.5, 1, 0)
    q = torch.zeros(1, 16)
    with pytest.raises(RuntimeError, match="forward_context"):
        compiled_attention(q, q[:, :8], q[:, :8], layer, True)


def test_torch_compile_flag_refused_without_cuda_graphs(tmp_path) -> None:
    make_tiny_model("llama", str(tmp_path))
    with pytest.raises(ValueError, match="enable-torch-compile"):
        make_runner(str(tmp_path), enable_torch_compile=True)
    with pytest.raises(ValueError, match="torch-compile-max-bs"):
        make_runner(str(tmp_path), torch_compile_max_bs=0)


def test_prefill_graph_buckets_and_flag() -> None:
    from radixserve.model_executor.prefill_graph_runner import prefill_buckets
    from radixserve.server_args import ServerArgs

    assert prefill_buckets(512) == [16, 32, 48, 64, 80, 96, 112, 128, 160, 192, 224, 256, 320, 384, 448, 512]
    assert prefill_buckets(1024)[-6:] == [448, 512, 640, 768, 896, 1024]
    assert prefill_buckets(100) == [16, 32, 48, 64, 80, 96, 100]
    buckets = prefill_buckets(1024)  # 16 rows of padding at most up to 128 tokens, a quarter above
    pairs = list(zip(buckets, buckets[1:], strict=False))
    assert all(b - a == 16 for a, b in pairs if a < 128) and all(b / (a + 1) <= 1.25 for a, b in pairs if a >= 128)
    assert prefill_buckets(16) == [16]
    assert prefill_buckets(8) == [8]
    with pytest.raises(ValueError, match="prefill-cuda-graph-max-tokens"):
        ServerArgs(device="cpu", prefill_cuda_graph_max_tokens=-1)


def test_batch_one_stays_uncompiled_where_the_one_row_gemv_runs(tmp_path, monkeypatch) -> None:
    """compiled_batch_sizes: sizes up to the limit, less batch 1 when a linear layer's one-row product would take
    the one-row GEMV (a table entry for its weight's shape; here the lookup is stubbed, as the table only answers
    for CUDA weights)."""
    from radixserve.layers.triton_ops import gemv
    from radixserve.model_executor.torch_compile import compiled_batch_sizes, uses_one_row_gemv

    path = str(tmp_path / "m")
    make_tiny_model("llama", path)
    model = make_runner(path).model
    sizes = [1, 2, 4, 8, 16]
    assert not uses_one_row_gemv(model)  # CPU weights: no table entry, batch 1 is compiled like the rest
    assert compiled_batch_sizes(sizes, 8, model) == {1, 2, 4, 8}
    o_proj = model.model.layers[0].self_attn.o_proj.weight
    monkeypatch.setattr(gemv, "gemv_config", lambda w, silu_mul=False: (
        gemv.gemv_configs.GemvConfig("ew", 2, 64) if w is o_proj and not silu_mul else None))
    assert uses_one_row_gemv(model)
    assert compiled_batch_sizes(sizes, 8, model) == {2, 4, 8}
    assert compiled_batch_sizes(sizes, 1, model) == set()
