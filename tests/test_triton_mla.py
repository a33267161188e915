"""Triton MLA decode/extend (over the latent pool) against the torch_native reference, through real pools and a
ForwardBatch; Triton's interpreter on the CPU (chosen by conftest.py), the GPU when there is one."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from test_triton_attention import scattered_batch, scattered_table  # noqa: E402

from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.mem_cache.memory_pool import ReqToTokenPool  # noqa: E402
from radixserve.mem_cache.mla_memory_pool import MLATokenToKVPool  # noqa: E402
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

_HAS_CUDA = torch.cuda.is_available()
DEVICE = "cuda" if _HAS_CUDA else "cpu"
LAYER_ID = 1
RANK, ROPE = 32, 8  # latent rank (C) and rotary dims (R): a key of 40 dims, a value of 32


class _Cfg(SimpleNamespace):
    is_mla = True

    def attention_shape(self, tp_size: int = 1) -> tuple[int, int, int, int]:
        return self.num_attention_heads, 1, RANK + ROPE, RANK


def make_runner(num_heads: int, dtype: torch.dtype) -> SimpleNamespace:
    pool = MLATokenToKVPool(1024, dtype, RANK, ROPE, num_layers=2, device=DEVICE)
    for buf in pool.kv_buffer:
        buf.fill_(float("nan"))  # a slot the kernels should not read poisons the output
    cfg = _Cfg(num_attention_heads=num_heads, num_key_value_heads=num_heads, head_dim=ROPE, kv_lora_rank=RANK)
    return SimpleNamespace(device=DEVICE, model_config=cfg, tp_size=1, dtype=dtype,
                           req_to_token_pool=ReqToTokenPool(8, 512, DEVICE), token_to_kv_pool=pool)


def make_batch(runner: SimpleNamespace, backend: object, prefix_lens: list[int], extend_lens: list[int],
               mode: ForwardMode, gen: torch.Generator) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor]:
    h, dtype = runner.model_config.num_attention_heads, runner.dtype
    kv_buf, _ = runner.token_to_kv_pool.get_kv_buffer(LAYER_ID)

    def fill(slots: torch.Tensor) -> None:
        kv_buf[slots] = torch.randn(len(slots), 1, RANK + ROPE, generator=gen).to(DEVICE, dtype)

    fb = scattered_batch(runner, backend, prefix_lens, extend_lens, mode, gen, fill)
    n = sum(extend_lens)
    q = torch.randn(n, h * (RANK + ROPE), generator=gen).to(DEVICE, dtype)
    k = torch.randn(n, RANK + ROPE, generator=gen).to(DEVICE, dtype)
    return fb, q, k


def layer(num_heads: int) -> SimpleNamespace:
    return SimpleNamespace(tp_q_head_num=num_heads, tp_k_head_num=1, tp_v_head_num=1, head_dim=RANK + ROPE,
                           v_head_dim=RANK, scaling=0.3, layer_id=LAYER_ID)


def run_both(num_heads: int, prefix_lens: list[int], extend_lens: list[int], mode: ForwardMode,
             dtype: torch.dtype = torch.float32, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    runner = make_runner(num_heads, dtype)
    backend = TritonAttnBackend(runner)
    backend.min_split_len = 16  # several splits per request even for short sequences
    backend.decode_one_launch = True  # merged in stage 1's launch (the default leaves MLA to stage 2)
    lay = layer(num_heads)
    fb, q, k = make_batch(runner, backend, prefix_lens, extend_lens, mode, gen)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, k[:, :RANK], lay, fb)
    kv_buf, _ = runner.token_to_kv_pool.get_kv_buffer(LAYER_ID)
    assert torch.equal(kv_buf[fb.out_cache_loc].view(-1, RANK + ROPE), k)  # the latent was stored once
    ref_backend = TorchNativeAttnBackend(runner)
    ref_backend.init_forward_metadata(fb)
    ref = ref_backend.forward(q, k, k[:, :RANK], lay, fb, save_kv_cache=False)
    assert out.shape == ref.shape == (q.shape[0], num_heads * RANK)
    return out, ref


@pytest.mark.parametrize("num_heads,prefix_lens,extend_lens", [
    (4, [0, 5, 40], [7, 1, 30]),  # no prefix, a 1-token extend, a prefix longer than a block
    (20, [17], [35]),  # more heads than one head block, several query blocks
])
def test_mla_extend_matches_torch_native(num_heads: int, prefix_lens: list[int], extend_lens: list[int]) -> None:
    out, ref = run_both(num_heads, prefix_lens, extend_lens, ForwardMode.EXTEND)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("num_heads,seq_lens", [(4, [1, 9, 70]), (20, [33, 130])])
def test_mla_decode_matches_torch_native(num_heads: int, seq_lens: list[int]) -> None:
    out, ref = run_both(num_heads, [s - 1 for s in seq_lens], [1] * len(seq_lens), ForwardMode.DECODE)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_mla_cuda_graph_metadata_path_matches_eager() -> None:
    """The capture/replay hooks (static buffers, a padded row, shared scratch sized for the latent) give the eager
    result."""
    gen = torch.Generator().manual_seed(3)
    runner = make_runner(8, torch.float32)
    backend = TritonAttnBackend(runner)
    backend.min_split_len = 16
    lay = layer(8)
    fb, q, k = make_batch(runner, backend, [0, 39, 76], [1] * 3, ForwardMode.DECODE, gen)
    backend.init_forward_metadata(fb)
    eager = backend.forward(q, k, k[:, :RANK], lay, fb)
    backend.init_cuda_graph_state(max_bs=8)
    pad = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    fill = torch.full((1,), backend.get_cuda_graph_seq_len_fill_value(), dtype=torch.int64, device=DEVICE)
    backend.init_forward_metadata_capture_cuda_graph(4, torch.cat([fb.req_pool_indices, pad]),
                                                     torch.cat([fb.seq_lens, fill]))
    qp = torch.cat([q, torch.zeros(1, q.shape[1], device=DEVICE)])
    out = backend.forward_decode(qp, k, k[:, :RANK], lay, fb, save_kv_cache=False)
    torch.testing.assert_close(out[:3], eager, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out).all()


def test_deepseek_v3_with_triton_kernels_matches_transformers(tmp_path) -> None:
    """The whole model on the Triton paths (MLA extend/decode, the fused MoE kernel, fused norms): greedy equals
    transformers'."""
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.triton_ops import set_fused_kernels

    hf = make_tiny_model("deepseek_v3", str(tmp_path), initializer_range=0.08)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13]]
    set_fused_kernels(None if _HAS_CUDA else True)
    try:
        runner = make_runner(str(tmp_path), attention_backend="triton", device=DEVICE, disable_cuda_graph=True)
        ours = StaticBatch(runner).generate(prompts, 8)
    finally:
        set_fused_kernels(None)
    for prompt, got in zip(prompts, ours, strict=True):
        assert got == hf_greedy(hf, prompt, 8)


@pytest.mark.parametrize("splits", [1, 3])
def test_mla_decode_kernel_one_split_and_several_match_dense(splits: int) -> None:
    """One split a request (stage 1 writes the output; no stage 2, the scratch not touched) and three splits give
    the dense attention over scattered latents, with an empty request (zeros) among them."""
    from radixserve.layers.attention.triton_ops.decode_attention import split_capacity
    from radixserve.layers.attention.triton_ops.mla_attention import mla_decode_fwd

    gen = torch.Generator().manual_seed(5)
    h, seq_lens, scale = 4, [1, 0, 37, 70], 0.3
    total = sum(seq_lens)
    kv = torch.randn(total + 1, 1, RANK + ROPE, generator=gen)
    r2t = scattered_table(seq_lens, gen, offset=1)  # slot 0 is the pool's padding slot
    q = torch.randn(len(seq_lens), h, RANK + ROPE, generator=gen)
    o = torch.full((len(seq_lens), h, RANK), float("nan"), device=DEVICE)
    cap = split_capacity(splits)
    mid_o = torch.full((len(seq_lens), h, cap, RANK), float("nan"), device=DEVICE)
    mid_lse = torch.empty(len(seq_lens), h, cap, device=DEVICE)
    mla_decode_fwd(q.to(DEVICE), kv.to(DEVICE), o, r2t.to(DEVICE), torch.arange(len(seq_lens), device=DEVICE),
                   torch.tensor(seq_lens, device=DEVICE), mid_o, mid_lse, scale, RANK, splits, min_split_len=16)
    if splits == 1:
        assert torch.isnan(mid_o).all()  # the direct path does not go through the partials
    assert_dense_mla(o, q, kv, r2t, seq_lens, scale)


def assert_dense_mla(o: torch.Tensor, q: torch.Tensor, kv: torch.Tensor, r2t: torch.Tensor, seq_lens: list[int],
                     scale: float) -> None:
    """o [bs, H, RANK] is each request's dense attention over its latents (zeros for an empty request)."""
    for i, n in enumerate(seq_lens):
        if n == 0:
            assert torch.equal(o[i].cpu(), torch.zeros(q.shape[1], RANK))
            continue
        keys = kv[r2t[i, :n].long(), 0]  # [n, C + R]
        w = torch.softmax(q[i] @ keys.T * scale, dim=-1)
        torch.testing.assert_close(o[i].cpu(), w @ keys[:, :RANK], rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("splits", [2, 3])
@pytest.mark.parametrize("h", [4, 20], ids=["one-head-block", "two-head-blocks"])
def test_mla_decode_one_launch_matches_dense(splits: int, h: int) -> None:
    """With counters, several splits merge in stage 1's launch (the last program of each request's head block
    merges; no stage 2): the dense attention, zeros for an empty request, one split written directly for a request
    shorter than min_split_len; two calls in a row with the same counters, which each call leaves zero."""
    from radixserve.layers.attention.triton_ops import mla_attention
    from radixserve.layers.attention.triton_ops.decode_attention import new_decode_counters, split_capacity

    gen = torch.Generator().manual_seed(7 + splits)
    seq_lens, scale = [1, 0, 12, 37, 70], 0.3
    bs, total = len(seq_lens), sum(seq_lens)
    kv = torch.randn(total + 1, 1, RANK + ROPE, generator=gen)
    r2t = scattered_table(seq_lens, gen, offset=1)
    cap = split_capacity(splits)
    mid_o = torch.empty(bs, h, cap, RANK, device=DEVICE)
    mid_lse = torch.empty(bs, h, cap, device=DEVICE)
    counters = new_decode_counters(bs, h, DEVICE)
    launched: list[object] = []
    real_launch = mla_attention.launch

    def counting_launch(fn: object, *args: object, **kw: object) -> None:
        launched.append(fn)
        real_launch(fn, *args, **kw)

    mla_attention.launch = counting_launch
    try:
        for _ in range(2):
            q = torch.randn(bs, h, RANK + ROPE, generator=gen)
            o = torch.full((bs, h, RANK), float("nan"), device=DEVICE)
            launched.clear()
            mla_attention.mla_decode_fwd(q.to(DEVICE), kv.to(DEVICE), o, r2t.to(DEVICE),
                                         torch.arange(bs, device=DEVICE), torch.tensor(seq_lens, device=DEVICE),
                                         mid_o, mid_lse, scale, RANK, splits, min_split_len=16, counters=counters)
            assert launched == [mla_attention._mla_decode_stage1_kernel]
            assert not counters.any()
            assert_dense_mla(o, q, kv, r2t, seq_lens, scale)
    finally:
        mla_attention.launch = real_launch
