"""Triton attention on a GPU: larger bf16/fp16 shapes against a float32 torch_native reference, and decode through a
captured CUDA graph against eager."""

from __future__ import annotations

import os
import random
from types import SimpleNamespace

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton kernels"),
]

if torch.cuda.is_available():
    from test_triton_attention import scattered_batch

    from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
    from radixserve.layers.attention.triton_backend import TritonAttnBackend
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

DEVICE = "cuda"
LAYER_ID = 1


def make_runner(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype,
                pool_size: int = 200_000) -> SimpleNamespace:
    cfg = SimpleNamespace(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim)
    kv_pool = TokenToKVPool(pool_size, dtype, num_kv_heads, head_dim, num_layers=2, device=DEVICE)
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:
        buf.fill_(float("nan"))
    return SimpleNamespace(device=DEVICE, model_config=cfg, tp_size=1, dtype=dtype,
                           req_to_token_pool=ReqToTokenPool(256, 16384, DEVICE), token_to_kv_pool=kv_pool)


def make_layer(num_heads: int, num_kv_heads: int, head_dim: int) -> SimpleNamespace:
    return SimpleNamespace(tp_q_head_num=num_heads, tp_k_head_num=num_kv_heads, tp_v_head_num=num_kv_heads,
                           head_dim=head_dim, scaling=head_dim ** -0.5, layer_id=LAYER_ID, sliding_window_size=-1)


def make_batch(runner: SimpleNamespace, backend: object, prefix_lens: list[int], extend_lens: list[int],
               mode: ForwardMode) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    cfg, dtype = runner.model_config, runner.dtype
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(LAYER_ID)

    def fill(slots: torch.Tensor) -> None:  # drawn on the GPU: prefixes here run to thousands of tokens
        k_buf[slots] = torch.randn(len(slots), cfg.num_key_value_heads, cfg.head_dim, device=DEVICE, dtype=dtype)
        v_buf[slots] = torch.randn(len(slots), cfg.num_key_value_heads, cfg.head_dim, device=DEVICE, dtype=dtype)

    fb = scattered_batch(runner, backend, prefix_lens, extend_lens, mode, torch.Generator(), fill)
    n = sum(extend_lens)
    q = torch.randn(n, cfg.num_attention_heads * cfg.head_dim, device=DEVICE, dtype=dtype)
    k = torch.randn(n, cfg.num_key_value_heads * cfg.head_dim, device=DEVICE, dtype=dtype)
    v = torch.randn(n, cfg.num_key_value_heads * cfg.head_dim, device=DEVICE, dtype=dtype)
    return fb, q, k, v


def reference(runner: SimpleNamespace, layer: SimpleNamespace, fb: ForwardBatch, q: torch.Tensor, k: torch.Tensor,
              v: torch.Tensor) -> torch.Tensor:
    """torch_native in float32 over the (already written) low-precision pool."""
    ref = TorchNativeAttnBackend(runner)  # type: ignore[arg-type]
    ref.init_forward_metadata(fb)
    return ref.forward(q.float(), k, v, layer, fb, save_kv_cache=False)  # type: ignore[arg-type]


SHAPES = [  # (H, Hkv, D, dtype)
    (32, 8, 128, torch.bfloat16),  # Llama-3-8B
    (16, 16, 64, torch.float16),  # MHA
    (28, 4, 128, torch.bfloat16),  # Qwen2-7B (group 7)
    (8, 4, 256, torch.bfloat16),  # Gemma-like head_dim
    (12, 2, 96, torch.bfloat16),  # padded head_dim
]


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_extend_large(shape: tuple) -> None:
    h, hkv, d, dtype = shape
    torch.manual_seed(0)
    runner = make_runner(h, hkv, d, dtype)
    backend = TritonAttnBackend(runner)  # type: ignore[arg-type]
    layer = make_layer(h, hkv, d)
    fb, q, k, v = make_batch(runner, backend, [0, 500, 1000, 37, 4000], [1000, 300, 17, 2000, 1],
                             ForwardMode.EXTEND)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)  # type: ignore[arg-type]
    torch.testing.assert_close(out.float(), reference(runner, layer, fb, q, k, v), rtol=2e-2, atol=2e-2)


@pytest.mark.parametrize("shape", SHAPES, ids=lambda s: f"H{s[0]}-Hkv{s[1]}-D{s[2]}")
def test_decode_large(shape: tuple) -> None:
    h, hkv, d, dtype = shape
    rnd = random.Random(1)
    torch.manual_seed(1)
    runner = make_runner(h, hkv, d, dtype)
    backend = TritonAttnBackend(runner)  # type: ignore[arg-type]
    layer = make_layer(h, hkv, d)
    seq_lens = [1, 2, 64, 65, 8000] + [rnd.randint(1, 4000) for _ in range(59)]
    fb, q, k, v = make_batch(runner, backend, [s - 1 for s in seq_lens], [1] * len(seq_lens), ForwardMode.DECODE)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)  # type: ignore[arg-type]
    torch.testing.assert_close(out.float(), reference(runner, layer, fb, q, k, v), rtol=2e-2, atol=2e-2)
    # one sequence alone gets many splits
    fb1, q1, k1, v1 = make_batch(runner, backend, [12000], [1], ForwardMode.DECODE)
    backend.init_forward_metadata(fb1)
    out1 = backend.forward(q1, k1, v1, layer, fb1)  # type: ignore[arg-type]
    torch.testing.assert_close(out1.float(), reference(runner, layer, fb1, q1, k1, v1), rtol=2e-2, atol=2e-2)


def test_decode_cuda_graph_replay_matches_eager() -> None:
    h, hkv, d, dtype = 32, 8, 128, torch.bfloat16
    graph_bs, max_bs = 16, 32
    rnd = random.Random(2)
    torch.manual_seed(2)
    runner = make_runner(h, hkv, d, dtype)
    backend = TritonAttnBackend(runner)  # type: ignore[arg-type]
    layer = make_layer(h, hkv, d)
    backend.init_cuda_graph_state(max_bs)

    # static inputs owned by the "graph runner"
    q_s = torch.zeros(graph_bs, h * d, device=DEVICE, dtype=dtype)
    k_s = torch.zeros(graph_bs, hkv * d, device=DEVICE, dtype=dtype)
    v_s = torch.zeros_like(k_s)
    loc_s = torch.zeros(graph_bs, dtype=torch.int64, device=DEVICE)
    rpi_s = torch.zeros(graph_bs, dtype=torch.int64, device=DEVICE)
    sl_s = torch.full((graph_bs,), backend.get_cuda_graph_seq_len_fill_value(), dtype=torch.int64, device=DEVICE)

    def load(fb: ForwardBatch, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> None:
        n = fb.batch_size
        for dst, src, pad in ((q_s, q, 0), (k_s, k, 0), (v_s, v, 0), (loc_s, fb.out_cache_loc, 0),
                              (rpi_s, fb.req_pool_indices, 0),
                              (sl_s, fb.seq_lens, backend.get_cuda_graph_seq_len_fill_value())):
            dst[:n].copy_(src)
            dst[n:].fill_(pad)

    # capture on short sequences
    fb0, q0, k0, v0 = make_batch(runner, backend, [rnd.randint(0, 50) for _ in range(10)], [1] * 10,
                                 ForwardMode.DECODE)
    load(fb0, q0, k0, v0)
    fb_s = ForwardBatch(
        forward_mode=ForwardMode.DECODE, batch_size=graph_bs, input_ids=torch.zeros_like(loc_s),
        req_pool_indices=rpi_s, seq_lens=sl_s, out_cache_loc=loc_s, seq_lens_sum=0, positions=None,
        req_to_token_pool=runner.req_to_token_pool, token_to_kv_pool=runner.token_to_kv_pool,
        attn_backend=backend)  # type: ignore[arg-type]
    backend.init_forward_metadata_capture_cuda_graph(graph_bs, rpi_s, sl_s)
    stream = torch.cuda.Stream()
    stream.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(stream):
        for _ in range(2):  # compile outside the capture
            backend.forward_decode(q_s, k_s, v_s, layer, fb_s)  # type: ignore[arg-type]
    torch.cuda.current_stream().wait_stream(stream)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out_s = backend.forward_decode(q_s, k_s, v_s, layer, fb_s)  # type: ignore[arg-type]

    # replay on other batches: other sizes, much longer sequences (more splits than at capture)
    for n, hi in ((10, 50), (16, 6000), (3, 12000)):
        fb, q, k, v = make_batch(runner, backend, [rnd.randint(0, hi) for _ in range(n)], [1] * n,
                                 ForwardMode.DECODE)
        load(fb, q, k, v)
        backend.init_forward_metadata_replay_cuda_graph(graph_bs, rpi_s, sl_s, fb.seq_lens_sum)
        graph.replay()
        replayed = out_s[:n].clone()
        backend.init_forward_metadata(fb)
        eager = backend.forward(q, k, v, layer, fb)  # type: ignore[arg-type]
        # eager may pick another split cap (its batch is smaller), so equal up to rounding
        torch.testing.assert_close(replayed, eager, rtol=1e-2, atol=1e-2)
        torch.testing.assert_close(eager.float(), reference(runner, layer, fb, q, k, v), rtol=2e-2, atol=2e-2)
