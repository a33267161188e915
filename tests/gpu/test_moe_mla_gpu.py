"""On CUDA: the fused MoE kernel against the per-expert reference at Qwen3-30B-A3B's layer shape (bf16, inside a
CUDA graph too), Triton MLA decode against torch_native at DeepSeek-V2-Lite's latent shape, and tiny MoE / MLA
models (GLM-4.7-Flash's among them) whose CUDA-graph decode gives transformers' greedy tokens (float32) like the
eager path. Skipped without a
GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import hf_greedy, make_runner, make_tiny_model  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402


@pytest.mark.parametrize("tokens", [1, 7, 64, 600])
def test_fused_moe_bf16_at_qwen3_30b_shape(tokens: int) -> None:
    from radixserve.layers.moe.fused_moe import fused_moe
    from radixserve.layers.moe.moe_torch import moe_forward_torch
    from radixserve.layers.moe.router import RouterConfig, select_experts

    g = torch.Generator(device="cuda").manual_seed(0)
    e, h, i, k = 128, 2048, 768, 8
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, h, device="cuda", generator=g, dtype=torch.bfloat16)
    logits = torch.randn(tokens, e, device="cuda", generator=g)
    weights, ids = select_experts(logits, RouterConfig(e, k, renormalize=True))
    ref = moe_forward_torch(x.float(), w13.float(), w2.float(), weights, ids)
    out = fused_moe(x, w13, w2, weights, ids).float()
    err = (out - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, err
    if tokens <= 64:  # captured in a CUDA graph, replayed on new routing: the same as eager
        static_ids, static_w = ids.clone(), weights.clone()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            fused_moe(x, w13, w2, static_w, static_ids)  # compile outside the capture
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                graph_out = fused_moe(x, w13, w2, static_w, static_ids)
        torch.cuda.synchronize()
        new_w, new_ids = select_experts(torch.randn(tokens, e, device="cuda", generator=g),
                                        RouterConfig(e, k, renormalize=True))
        static_ids.copy_(new_ids)
        static_w.copy_(new_w)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(graph_out, fused_moe(x, w13, w2, new_w, new_ids))


@pytest.mark.parametrize("bs,seq", [(1, 700), (16, 300), (64, 90)])
def test_mla_decode_at_deepseek_v2_lite_shape(bs: int, seq: int) -> None:
    from radixserve.layers.attention.triton_ops.decode_attention import split_capacity
    from radixserve.layers.attention.triton_ops.mla_attention import mla_decode_fwd

    g = torch.Generator(device="cuda").manual_seed(1)
    h, c, r = 16, 512, 64
    kv = torch.randn(bs * seq + 1, 1, c + r, device="cuda", generator=g, dtype=torch.bfloat16)
    q = torch.randn(bs, h, c + r, device="cuda", generator=g, dtype=torch.bfloat16)
    req_to_token = torch.arange(1, bs * seq + 1, device="cuda", dtype=torch.int32).view(bs, seq)
    rows = torch.arange(bs, device="cuda")
    lens = torch.full((bs,), seq, device="cuda")
    splits = 8
    cap = split_capacity(splits)
    o = torch.empty(bs, h, c, device="cuda", dtype=torch.bfloat16)
    mid_o = torch.empty(bs, h, cap, c, device="cuda")
    mid_lse = torch.empty(bs, h, cap, device="cuda")
    scale = (192 ** -0.5)
    mla_decode_fwd(q, kv, o, req_to_token, rows, lens, mid_o, mid_lse, scale, c, splits)
    keys = kv[req_to_token.long()].squeeze(2).float()  # [bs, seq, c + r]
    scores = torch.einsum("bhd,bsd->bhs", q.float(), keys) * scale
    ref = torch.einsum("bhs,bsc->bhc", scores.softmax(-1), keys[..., :c])
    torch.testing.assert_close(o.float(), ref, atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("shape", ["qwen3-30b-a3b", "deepseek-v2-lite"])
@pytest.mark.parametrize("tokens", [1, 5, 16])
def test_small_batch_moe_bf16_at_real_shapes_and_in_a_graph(shape: str, tokens: int) -> None:
    """The two-launch small-batch path (router in one launch too) at Qwen3-30B-A3B's and DeepSeek-V2-Lite's layer
    shapes (the latter with its two shared experts folded in) against the float32 reference, then captured in a
    CUDA graph and replayed on new activations: the same as eager."""
    import torch.nn.functional as F

    from radixserve.layers.moe.moe_torch import moe_forward_torch
    from radixserve.layers.moe.router import RouterConfig, select_experts
    from radixserve.layers.moe.small_batch import small_batch_moe
    from radixserve.layers.moe.topk_kernel import fused_gate_topk

    e, h, i, k, shared = {"qwen3-30b-a3b": (128, 2048, 768, 8, 0), "deepseek-v2-lite": (64, 2048, 1408, 6, 2816)}[shape]
    g = torch.Generator(device="cuda").manual_seed(tokens)
    bf = torch.bfloat16
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=bf) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", generator=g, dtype=bf) * 0.02
    sw13 = torch.randn(2 * shared, h, device="cuda", generator=g, dtype=bf) * 0.02 if shared else None
    sw2 = torch.randn(h, shared, device="cuda", generator=g, dtype=bf) * 0.02 if shared else None
    gate = torch.randn(e, h, device="cuda", generator=g) * 0.05
    done = torch.zeros(1, dtype=torch.int32, device="cuda")
    x = torch.randn(tokens, h, device="cuda", generator=g, dtype=bf)
    cfg = RouterConfig(e, k, renormalize=shape == "qwen3-30b-a3b")

    def layer(inp: torch.Tensor) -> torch.Tensor:
        w, ids, _, _ = fused_gate_topk(inp, gate, done, k, False, cfg.renormalize, 1.0)
        return small_batch_moe(inp, w13, w2, w, ids, 0, sw13, sw2)

    def reference(inp: torch.Tensor) -> torch.Tensor:
        w, ids = select_experts(F.linear(inp.float(), gate), cfg)
        out = moe_forward_torch(inp.float(), w13.float(), w2.float(), w, ids)
        if shared:
            gu = F.linear(inp.float(), sw13.float())
            out = out + F.linear(F.silu(gu[:, :shared]) * gu[:, shared:], sw2.float())
        return out

    ref = reference(x)
    err = (layer(x).float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, err
    static_x = x.clone()
    stream = torch.cuda.Stream()
    with torch.cuda.stream(stream):
        layer(static_x)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, stream=stream):
            graph_out = layer(static_x)
    torch.cuda.synchronize()
    static_x.copy_(torch.randn(tokens, h, device="cuda", generator=g, dtype=bf))
    graph.replay()
    torch.cuda.synchronize()
    torch.testing.assert_close(graph_out, layer(static_x))
    assert int(done) == 0


@pytest.mark.parametrize("kind", ["qwen3_moe", "deepseek_v3", "deepseek_v2", "deepseek_v2_lora"])
def test_tiny_moe_and_mla_cuda_graph_and_eager_match_transformers(kind: str, tmp_path) -> None:
    """Batches of 3 and of 1 (one-row steps: the decode GEMV with the input norm, except on DeepSeek-V3)."""
    hf = make_tiny_model(kind, str(tmp_path), initializer_range=0.08)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3], [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13]]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    graph = make_runner(str(tmp_path), device="cuda", cuda_graph_max_bs=8)
    assert graph.cuda_graph_runner is not None
    assert StaticBatch(graph).generate(prompts, 12) == want
    for prompt, tokens in zip(prompts, want, strict=True):
        assert StaticBatch(graph).generate([prompt], 12) == [tokens]
    eager = make_runner(str(tmp_path), device="cuda", disable_cuda_graph=True)
    assert StaticBatch(eager).generate(prompts, 12) == want


def test_tiny_mla_decode_batch_over_16_in_a_graph_matches_transformers(tmp_path) -> None:
    """20 rows a decode step: MLA's preparation as a bmm and a program per token (`mla_prep.py`), in a CUDA graph."""
    hf = make_tiny_model("deepseek_v2", str(tmp_path), initializer_range=0.08)
    prompts = [[(7 * i + 3 * j) % 250 + 1 for j in range(3 + i)] for i in range(20)]
    want = [hf_greedy(hf, p, 6) for p in prompts]
    graph = make_runner(str(tmp_path), device="cuda", cuda_graph_max_bs=32, max_running_requests=32)
    assert graph.cuda_graph_runner is not None and graph.cuda_graph_runner.max_bs >= 20
    assert StaticBatch(graph).generate(prompts, 6) == want


@pytest.mark.parametrize("kind", ["flash", "mixed"])
def test_tiny_glm_4_7_flash_cuda_graph_and_eager_match_transformers(kind: str, tmp_path) -> None:
    """GLM-4.7-Flash (qk_nope_head_dim 48 != v_head_dim 64, the release's proportions): the expanded prefill, the
    fused preparation and latent decode on CUDA, in graphs and eager; 20 rows a step take the many-token preparation
    (a bmm and a program per token)."""
    from test_glm4_moe_lite import PROMPTS, glm_lite

    hf = glm_lite(str(tmp_path), kind)
    want = [hf_greedy(hf, p, 12) for p in PROMPTS]
    graph = make_runner(str(tmp_path), device="cuda", cuda_graph_max_bs=32, max_running_requests=32)
    assert graph.cuda_graph_runner is not None
    assert StaticBatch(graph).generate(PROMPTS, 12) == want
    eager = make_runner(str(tmp_path), device="cuda", disable_cuda_graph=True)
    assert StaticBatch(eager).generate(PROMPTS, 12) == want
    many = [[(7 * i + 3 * j) % 250 + 1 for j in range(3 + i)] for i in range(20)]
    assert StaticBatch(graph).generate(many, 6) == [hf_greedy(hf, p, 6) for p in many]


@pytest.mark.parametrize("block", [None, (128, 128)])
@pytest.mark.parametrize("tokens", [1, 7, 64, 600])
def test_fp8_experts_at_qwen3_30b_shape(tokens: int, block: tuple[int, int] | None) -> None:
    """fp8 experts (per output row, or 128 x 128 blocks as the Qwen3 FP8 release ships) through both paths
    (the small-batch kernels at 1 and 7 tokens, W8A16; the grouped GEMMs at 64 and 600, W8A8 with 128-column
    activation groups) against the float32 reference on the dequantised weights (quantising the activations as
    the grouped path does); captured in a CUDA graph and replayed on new routing, the same as eager."""
    from test_quant_fp8_moe import _quantize

    from radixserve.layers.moe.fused_moe import fused_moe
    from radixserve.layers.moe.methods import ExpertScales
    from radixserve.layers.moe.moe_torch import moe_forward_torch
    from radixserve.layers.moe.router import RouterConfig, select_experts
    from radixserve.layers.moe.small_batch import SMALL_BATCH_TOKENS, small_batch_moe
    from radixserve.layers.quantization.fp8 import dequantize_blocks

    g = torch.Generator(device="cuda").manual_seed(tokens)
    e, h, i, k = 128, 2048, 768, 8
    q13, s13 = _quantize(torch.randn(e, 2 * i, h, device="cuda", generator=g) * 0.02, block)
    q2, s2 = _quantize(torch.randn(e, h, i, device="cuda", generator=g) * 0.02, block)
    gn, gk13, gk2 = (1, h, i) if block is None else (128, 128, 128)
    scales = ExpertScales(s13, s2, gn, gk13, gk2)
    d13 = torch.stack([dequantize_blocks(q13[x], s13[x], gn, gk13) for x in range(e)])
    d2 = torch.stack([dequantize_blocks(q2[x], s2[x], gn, gk2) for x in range(e)])
    x = torch.randn(tokens, h, device="cuda", generator=g, dtype=torch.bfloat16)
    cfg = RouterConfig(e, k, renormalize=True)
    weights, ids = select_experts(torch.randn(tokens, e, device="cuda", generator=g), cfg)

    def run(w: torch.Tensor, i_: torch.Tensor) -> torch.Tensor:
        if tokens <= SMALL_BATCH_TOKENS:
            return small_batch_moe(x, q13, q2, w, i_, scales=scales)
        return fused_moe(x, q13, q2, w, i_, scales=scales)

    if tokens <= SMALL_BATCH_TOKENS:
        ref = moe_forward_torch(x.float(), d13, d2, weights, ids)
    else:
        ref = moe_forward_torch(x, q13, q2, weights, ids, scales=scales, act_group=128).float()
    err = (run(weights, ids).float() - ref).abs().max() / ref.abs().max()
    assert err < 2e-2, err
    if tokens <= 64:
        static_w, static_ids = weights.clone(), ids.clone()
        stream = torch.cuda.Stream()
        with torch.cuda.stream(stream):
            run(static_w, static_ids)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, stream=stream):
                graph_out = run(static_w, static_ids)
        torch.cuda.synchronize()
        new_w, new_ids = select_experts(torch.randn(tokens, e, device="cuda", generator=g), cfg)
        static_w.copy_(new_w)
        static_ids.copy_(new_ids)
        graph.replay()
        torch.cuda.synchronize()
        torch.testing.assert_close(graph_out, run(new_w, new_ids))


def test_tiny_fp8_moe_checkpoint_cuda_graph_and_eager_match_transformers(tmp_path, monkeypatch) -> None:
    """A block-wise fp8 Qwen3-MoE checkpoint (experts included) on the GPU, float32, W8A16 for the dense layers
    too: CUDA-graph and eager decoding give transformers' greedy tokens on the dequantised weights."""
    import transformers as tf
    from test_quant_fp8_moe import _write_fp8_moe_checkpoint

    from radixserve.layers.quantization import fp8 as fp8mod

    make_tiny_model("qwen3_moe", str(tmp_path), initializer_range=0.08)
    deq_dir = _write_fp8_moe_checkpoint(str(tmp_path), "block")
    monkeypatch.setattr(fp8mod, "SMALL_M", 1 << 30)
    hf = tf.AutoModelForCausalLM.from_pretrained(deq_dir, torch_dtype=torch.float32).eval()
    prompts = [[5, 17, 42, 99, 3, 250, 7], [1, 2, 3], [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13]]
    want = [hf_greedy(hf, p, 12) for p in prompts]
    graph = make_runner(str(tmp_path), device="cuda", cuda_graph_max_bs=8)
    assert graph.cuda_graph_runner is not None
    assert StaticBatch(graph).generate(prompts, 12) == want
    assert StaticBatch(graph).generate(prompts[:1], 12) == want[:1]
    eager = make_runner(str(tmp_path), device="cuda", disable_cuda_graph=True)
    assert StaticBatch(eager).generate(prompts, 12) == want
