"""The CPU kernels: the attention backend (paged C decode kernel, copy-free extend) against the torch_native
reference, through real pools with scattered slots and a ForwardBatch (unused pool slots hold NaN, so a read outside
a request's tokens shows up in the output); the small-batch linear against F.linear."""

from __future__ import annotations

import os
import shutil
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from radixserve.layers import cpu_ops
from radixserve.layers.attention.cpu_backend import CpuAttnBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

LAYER_ID = 1

needs_compiler = pytest.mark.skipif(shutil.which("gcc") is None and shutil.which("cc") is None,
                                    reason="no C compiler: the CPU kernel cannot be built here")


def make_runner(hkv: int, d: int, dtype: torch.dtype, pool_size: int = 4096, context: int = 2048
                ) -> SimpleNamespace:
    kv = TokenToKVPool(pool_size, dtype, hkv, d, num_layers=2, device="cpu")
    for buf in kv.k_buffer + kv.v_buffer:
        buf.fill_(float("nan"))
    return SimpleNamespace(device="cpu", req_to_token_pool=ReqToTokenPool(16, context, "cpu"), token_to_kv_pool=kv)


def make_layer(h: int, hkv: int, d: int, window: int = -1) -> SimpleNamespace:
    return SimpleNamespace(tp_q_head_num=h, tp_k_head_num=hkv, tp_v_head_num=hkv, head_dim=d, scaling=d ** -0.5,
                           layer_id=LAYER_ID, sliding_window_size=window)


def make_batch(runner: SimpleNamespace, h: int, hkv: int, d: int, prefix_lens: list[int], extend_lens: list[int],
               mode: ForwardMode, dtype: torch.dtype, q_dtype: torch.dtype, seed: int
               ) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    r2t, kv = runner.req_to_token_pool, runner.token_to_kv_pool
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    rows = r2t.alloc(len(totals))[::-1]  # not in order, so a wrong row shows
    slots = kv.alloc(sum(totals))
    slots = slots[torch.randperm(len(slots), generator=gen)]
    k_buf, v_buf = kv.get_kv_buffer(LAYER_ID)
    out_locs, start = [], 0
    for row, pre, total in zip(rows, prefix_lens, totals, strict=True):
        mine = slots[start:start + total]
        start += total
        r2t.write(row, 0, mine)
        k_buf[mine[:pre]] = torch.randn(pre, hkv, d, generator=gen).to(dtype)
        v_buf[mine[:pre]] = torch.randn(pre, hkv, d, generator=gen).to(dtype)
        out_locs.append(mine[pre:])
    n = sum(extend_lens)
    q = torch.randn(n, h * d, generator=gen).to(q_dtype)
    k = torch.randn(n, hkv * d, generator=gen).to(q_dtype)
    v = torch.randn(n, hkv * d, generator=gen).to(q_dtype)

    def t(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64)

    fb = ForwardBatch(forward_mode=mode, batch_size=len(totals), input_ids=torch.zeros(n, dtype=torch.int64),
                      req_pool_indices=t(rows), seq_lens=t(totals), out_cache_loc=torch.cat(out_locs),
                      seq_lens_sum=sum(totals), positions=None, req_to_token_pool=r2t, token_to_kv_pool=kv,
                      attn_backend=None, seq_lens_cpu=list(totals))  # type: ignore[arg-type]
    if mode.is_extend():
        fb.extend_seq_lens, fb.extend_prefix_lens = t(extend_lens), t(prefix_lens)
        fb.extend_start_loc = t([sum(extend_lens[:i]) for i in range(len(extend_lens))])
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(extend_lens), list(prefix_lens)
    return fb, q, k, v


def run_both(h: int, hkv: int, d: int, prefix_lens: list[int], extend_lens: list[int], mode: ForwardMode,
             dtype: torch.dtype = torch.float32, q_dtype: torch.dtype | None = None, seed: int = 0
             ) -> tuple[torch.Tensor, torch.Tensor, CpuAttnBackend]:
    q_dtype = q_dtype or dtype
    runner = make_runner(hkv, d, dtype)
    backend = CpuAttnBackend(runner)  # type: ignore[arg-type]
    layer = make_layer(h, hkv, d)
    fb, q, k, v = make_batch(runner, h, hkv, d, prefix_lens, extend_lens, mode, dtype, q_dtype, seed)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)  # type: ignore[arg-type]
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(LAYER_ID)
    assert torch.equal(k_buf[fb.out_cache_loc], k.view(-1, hkv, d).to(dtype))  # the new K/V were stored
    assert torch.equal(v_buf[fb.out_cache_loc], v.view(-1, hkv, d).to(dtype))
    ref_backend = TorchNativeAttnBackend(runner)  # type: ignore[arg-type]
    ref_backend.init_forward_metadata(fb)
    ref = ref_backend.forward(q, k, v, layer, fb, save_kv_cache=False)  # type: ignore[arg-type]
    assert out.shape == ref.shape and out.dtype == q.dtype and not out.isnan().any()
    return out, ref, backend


def tol(dtype: torch.dtype) -> dict:
    return {"rtol": 1e-2, "atol": 1e-2} if dtype != torch.float32 else {"rtol": 1e-5, "atol": 1e-5}


DECODE_CASES = [
    # (H, Hkv, D, seq_lens, pool dtype, q dtype)
    (9, 3, 64, [1, 2, 255, 256, 257, 700], torch.float32, torch.float32),  # SmolLM2's heads; chunk edges (256)
    (4, 4, 32, [1, 30, 131], torch.float32, torch.float32),  # MHA
    (8, 1, 128, [5, 600], torch.float32, torch.float32),  # GQA 8, D 128
    (4, 2, 96, [5, 77], torch.float32, torch.float32),  # a head_dim the kernel has no constant for
    (8, 2, 64, [1, 90, 300], torch.bfloat16, torch.bfloat16),  # bf16 pool and model
    (8, 2, 64, [3, 513], torch.bfloat16, torch.float32),  # bf16 pool under an fp32 model
]


@needs_compiler
@pytest.mark.parametrize("case", DECODE_CASES, ids=lambda c: f"H{c[0]}-Hkv{c[1]}-D{c[2]}-{str(c[4])[6:]}")
def test_decode_matches_torch_native(case: tuple) -> None:
    h, hkv, d, seq_lens, dtype, q_dtype = case
    out, ref, backend = run_both(h, hkv, d, [s - 1 for s in seq_lens], [1] * len(seq_lens), ForwardMode.DECODE,
                                 dtype, q_dtype)
    assert backend.kernel  # the kernel ran, not the fallback
    torch.testing.assert_close(out, ref, **tol(q_dtype if dtype == torch.float32 else dtype))


@needs_compiler
def test_decode_sliding_window() -> None:
    """A layer with a sliding window: the query sees only the last `window` keys (read in place)."""
    h, hkv, d, window, seq_lens = 4, 2, 32, 7, [3, 7, 8, 300]
    runner = make_runner(hkv, d, torch.float32)
    backend = CpuAttnBackend(runner)  # type: ignore[arg-type]
    layer = make_layer(h, hkv, d, window)
    fb, q, k, v = make_batch(runner, h, hkv, d, [s - 1 for s in seq_lens], [1] * len(seq_lens),
                             ForwardMode.DECODE, torch.float32, torch.float32, seed=4)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb).view(-1, h, d)  # type: ignore[arg-type]
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(LAYER_ID)
    for i, (row, n) in enumerate(zip(fb.req_pool_indices.tolist(), seq_lens, strict=True)):
        slots = runner.req_to_token_pool.req_to_token[row, max(0, n - window):n].long()
        ref = F.scaled_dot_product_attention(q.view(-1, h, d)[i][None, :, None], k_buf[slots].transpose(0, 1)[None],
                                             v_buf[slots].transpose(0, 1)[None], scale=layer.scaling,
                                             enable_gqa=True)[0, :, 0]
        torch.testing.assert_close(out[i], ref, **tol(torch.float32))


@needs_compiler
@pytest.mark.parametrize("h,hkv,d", [(9, 3, 64), (8, 1, 128), (4, 2, 96), (2, 1, 32)])
def test_decode_kernel_reads_every_fp8_code_with_scales(h: int, hkv: int, d: int) -> None:
    """A float8 e4m3 pool holding every finite code (subnormals, zeros of both signs, +-448) at scattered slots:
    the kernel's output equals float64 attention over the decoded values times k_scale / v_scale (AVX-512 path for
    D 64 / 128 / 32, the plain C path for D 96)."""
    gen = torch.Generator().manual_seed(7)
    codes = torch.tensor([c for c in range(256) if c not in (0x7F, 0xFF)], dtype=torch.uint8)
    seq_lens, slots_n = [1, 17, 300, 700], 1100
    k_pool = codes[torch.randint(0, len(codes), (slots_n, hkv, d), generator=gen)].view(torch.float8_e4m3fn)
    v_pool = codes[torch.randint(0, len(codes), (slots_n, hkv, d), generator=gen)].view(torch.float8_e4m3fn)
    table = torch.zeros(len(seq_lens), max(seq_lens), dtype=torch.int32)
    perm = torch.randperm(slots_n, generator=gen)
    start = 0
    for b, n in enumerate(seq_lens):
        table[b, :n] = perm[start:start + n].to(torch.int32)
        start += n
    q = torch.randn(len(seq_lens), h, d, generator=gen) * 0.05  # scores within exp's range with |K| up to 448 * 0.37
    rows = torch.arange(len(seq_lens), dtype=torch.int64)
    ends = torch.tensor(seq_lens, dtype=torch.int64)
    k_scale, v_scale, scale = 0.37, 1.9, d ** -0.5
    out = cpu_ops.paged_decode_attention(q, k_pool, v_pool, table, rows, torch.zeros_like(ends), ends, scale,
                                         k_scale=k_scale, v_scale=v_scale)
    for b, n in enumerate(seq_lens):
        sl = table[b, :n].long()
        kk = k_pool[sl].double() * k_scale  # [n, hkv, d]
        vv = v_pool[sl].double() * v_scale
        qq = q[b].double().view(hkv, h // hkv, d)
        p = torch.softmax(torch.einsum("gjd,ngd->gjn", qq, kk) * scale, dim=-1)
        ref = torch.einsum("gjn,ngd->gjd", p, vv).reshape(h, d)
        torch.testing.assert_close(out[b].double(), ref, rtol=2e-5, atol=2e-5 * vv.abs().max().item())


@needs_compiler
def test_fp8_pool_decode_matches_torch_native(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend's decode over an fp8 e4m3 pool with the layer's k_scale / v_scale: the kernel runs (no fallback)
    and gives the torch_native reference's output; the pool's NaN fill stays out of the tokens read."""
    h, hkv, d, seq_lens = 9, 3, 64, [1, 40, 257, 600]
    runner = make_runner(hkv, d, torch.float8_e4m3fn)
    backend = CpuAttnBackend(runner)  # type: ignore[arg-type]
    layer = make_layer(h, hkv, d)
    layer.k_scale, layer.v_scale = 0.02, 0.015  # the randn K/V land in e4m3's range and its subnormals
    fb, q, k, v = make_batch(runner, h, hkv, d, [s - 1 for s in seq_lens], [1] * len(seq_lens), ForwardMode.DECODE,
                             torch.float8_e4m3fn, torch.float32, seed=3)
    calls: list[int] = []
    real = cpu_ops.paged_decode_attention

    def counting(*args: object, **kw: object) -> torch.Tensor:
        calls.append(1)
        return real(*args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_ops, "paged_decode_attention", counting)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)  # type: ignore[arg-type]
    assert calls == [1] and not out.isnan().any()
    ref_backend = TorchNativeAttnBackend(runner)  # type: ignore[arg-type]
    ref_backend.init_forward_metadata(fb)
    ref = ref_backend.forward(q, k, v, layer, fb, save_kv_cache=False)  # type: ignore[arg-type]
    torch.testing.assert_close(out, ref, rtol=1e-5, atol=1e-5)


EXTEND_CASES = [
    # (H, Hkv, D, prefix_lens, extend_lens, dtype)
    (9, 3, 64, [0, 5, 33, 64], [7, 1, 30, 17], torch.float32),  # no prefix (no gather) / prefix / one token
    (8, 2, 32, [1, 0, 2, 19], [70, 3, 1, 40], torch.float32),
    (8, 1, 64, [31, 0], [9, 33], torch.bfloat16),
]


@needs_compiler
@pytest.mark.parametrize("case", EXTEND_CASES, ids=lambda c: f"H{c[0]}-Hkv{c[1]}-D{c[2]}-{str(c[5])[6:]}")
def test_extend_matches_torch_native(case: tuple) -> None:
    h, hkv, d, prefix_lens, extend_lens, dtype = case
    out, ref, _ = run_both(h, hkv, d, prefix_lens, extend_lens, ForwardMode.EXTEND, dtype)
    torch.testing.assert_close(out, ref, **tol(dtype))


@needs_compiler
def test_mixed_batch_sends_single_tokens_through_the_kernel(monkeypatch: pytest.MonkeyPatch) -> None:
    """A prefill chunk riding with decode requests: the one-token requests go through one kernel call."""
    calls: list[int] = []
    real = cpu_ops.paged_decode_attention

    def counting(q: torch.Tensor, *args: object, **kw: object) -> torch.Tensor:
        calls.append(q.shape[0])
        return real(q, *args, **kw)  # type: ignore[arg-type]

    monkeypatch.setattr(cpu_ops, "paged_decode_attention", counting)
    out, ref, _ = run_both(4, 2, 32, [10, 25, 3, 40], [1, 12, 1, 1], ForwardMode.MIXED)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    assert calls == [3]


def test_fallback_without_the_kernel() -> None:
    """No compiler (or a pool dtype the kernel does not read): the reference path, same results."""
    runner = make_runner(2, 32, torch.float32)
    backend = CpuAttnBackend(runner)  # type: ignore[arg-type]
    backend.kernel = False
    layer = make_layer(4, 2, 32)
    fb, q, k, v = make_batch(runner, 4, 2, 32, [4, 9], [1, 1], ForwardMode.DECODE, torch.float32, torch.float32, 1)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)  # type: ignore[arg-type]
    ref = TorchNativeAttnBackend(runner).forward(q, k, v, layer, fb, save_kv_cache=False)  # type: ignore[arg-type]
    torch.testing.assert_close(out, ref, rtol=0, atol=0)


@needs_compiler
def test_kernel_rejects_bad_input() -> None:
    q = torch.zeros(1, 4, 32)
    pool = torch.zeros(8, 2, 32)
    table = torch.zeros(2, 8, dtype=torch.int32)
    one = torch.ones(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="float32"):
        cpu_ops.paged_decode_attention(q.double(), pool, pool, table, one, one, one, 1.0)
    with pytest.raises(ValueError, match="shapes"):
        cpu_ops.paged_decode_attention(torch.zeros(1, 3, 32), pool, pool, table, one, one, one, 1.0)
    with pytest.raises(ValueError, match="int32"):
        cpu_ops.paged_decode_attention(q, pool, pool, table.long(), one, one, one, 1.0)
    with pytest.raises(ValueError, match="float8 pool only"):
        cpu_ops.paged_decode_attention(q, pool, pool, table, one, one, one, 1.0, k_scale=2.0)
    e5m2 = pool.to(torch.float8_e5m2)
    with pytest.raises(ValueError, match="float8_e4m3fn"):
        cpu_ops.paged_decode_attention(q, e5m2, e5m2, table, one, one, one, 1.0)


@needs_compiler
@pytest.mark.parametrize("rows", [1, 2, 3, 4, 5, 8])
def test_linear_matches_f_linear(rows: int) -> None:
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 96, generator=g), torch.randn(200, 96, generator=g), torch.randn(200, generator=g)
    for bias in (None, b):
        torch.testing.assert_close(cpu_ops.linear(x, w, bias), F.linear(x, w, bias), rtol=1e-5, atol=1e-5)
    strided = torch.randn(rows, 130, generator=g)[:, 7:103]  # rows 130 elements apart
    torch.testing.assert_close(cpu_ops.linear(strided, w), F.linear(strided, w), rtol=1e-5, atol=1e-5)


@needs_compiler
def test_linear_rows_do_not_depend_on_the_batch_or_threads() -> None:
    """A request's output is bit-identical alone, in a batch of four or eight (a verify's rows), and on one thread or
    all of them."""
    g = torch.Generator().manual_seed(0)
    x, w = torch.randn(8, 576, generator=g), torch.randn(1000, 576, generator=g)
    alone = cpu_ops.linear(x[:1], w)
    assert torch.equal(cpu_ops.linear(x[:4], w)[:1], alone)
    assert torch.equal(cpu_ops.linear(x, w)[:1], alone)
    assert torch.equal(cpu_ops.linear(x[5:6], w), cpu_ops.linear(x, w)[5:6])
    threads = torch.get_num_threads()
    try:
        torch.set_num_threads(1)
        assert torch.equal(cpu_ops.linear(x[:1], w), alone)
    finally:
        torch.set_num_threads(threads)


def test_linear_falls_back_where_the_kernel_does_not_apply() -> None:
    g = torch.Generator().manual_seed(1)
    w = torch.randn(50, 32, generator=g)
    for x in (torch.randn(9, 32, generator=g), torch.randn(2, 32, generator=g).double(),
              torch.randn(2, 3, 32, generator=g)):
        ref = F.linear(x, w.to(x.dtype))
        assert torch.equal(cpu_ops.linear(x, w.to(x.dtype)), ref)


@needs_compiler
@pytest.mark.skipif(not cpu_ops.has_fast_bf16(), reason="this CPU has no AVX512-BF16")
@pytest.mark.parametrize("rows", [1, 3, 8])
def test_bf16_weight_linear_matches_f_linear_on_rounded_inputs(rows: int) -> None:
    """bfloat16 weights: x is rounded to bfloat16 and the products summed in float32 (to float32 rounding of the
    exact product of the rounded operands); rows independent of the batch, results in x's dtype."""
    g = torch.Generator().manual_seed(rows)
    x, w, b = torch.randn(rows, 200, generator=g), torch.randn(70, 200, generator=g).bfloat16(), \
        torch.randn(70, generator=g)
    want = F.linear(x.bfloat16().double(), w.double(), b.double()).float()
    torch.testing.assert_close(cpu_ops.linear(x, w, b), want, rtol=1e-5, atol=1e-4)
    assert torch.equal(cpu_ops.linear(x[:1], w), cpu_ops.linear(x, w)[:1])
    out = cpu_ops.linear(x.bfloat16(), w)
    assert out.dtype == torch.bfloat16
    torch.testing.assert_close(out.float(), want - b, rtol=1e-2, atol=1e-2)


def test_forward_threads_default_to_every_core(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.model_executor.model_runner import cpu_forward_threads
    from radixserve.server_args import ServerArgs

    cores = len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count()
    monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    assert cpu_forward_threads(ServerArgs(device="cpu")) == cores  # not cores - 1
    assert cpu_forward_threads(ServerArgs(device="cpu", tp_size=2)) == max(1, cores // 2)  # ranks share the cores
    assert cpu_forward_threads(ServerArgs(device="cpu", cpu_num_threads=3)) == 3
    monkeypatch.setenv("OMP_NUM_THREADS", "1")
    assert cpu_forward_threads(ServerArgs(device="cpu")) is None  # the environment's choice stands
    assert cpu_forward_threads(ServerArgs(device="cpu", cpu_num_threads=2)) == 2
    with pytest.raises(ValueError, match="cpu-num-threads"):
        ServerArgs(device="cpu", cpu_num_threads=0)


@needs_compiler
@pytest.mark.parametrize("tokens", [1, 37])
def test_rotary_in_place_is_bit_identical_to_the_torch_ops(tokens: int) -> None:
    from radixserve.layers.rotary_embedding import RotaryEmbedding

    g = torch.Generator().manual_seed(tokens)
    rope = RotaryEmbedding(64, 2048, 10000.0)
    qkv = torch.randn(tokens, (9 + 2 * 3) * 64, generator=g)
    q, k, v = qkv.split([9 * 64, 3 * 64, 3 * 64], dim=-1)  # views with a row stride, as in the models
    pos = torch.randint(0, 2048, (tokens,), generator=g)
    cos, sin = rope.cos_cache[pos].unsqueeze(1), rope.sin_cache[pos].unsqueeze(1)

    def reference(x: torch.Tensor) -> torch.Tensor:  # the torch path of RotaryEmbedding.forward
        x1, x2 = x.reshape(tokens, -1, 64).chunk(2, dim=-1)
        return torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).reshape(tokens, -1)

    want_q, want_k, want_v = reference(q.clone()), reference(k.clone()), v.clone()
    out_q, out_k = rope(pos, q, k)
    assert out_q.data_ptr() == q.data_ptr()  # in place
    assert torch.equal(out_q, want_q) and torch.equal(out_k, want_k) and torch.equal(v, want_v)
    with pytest.raises(ValueError, match="position"):
        cpu_ops.rotary_neox_inplace(torch.tensor([2048] * tokens), q, k, rope.cos_cache, rope.sin_cache, 64)


@needs_compiler
def test_rms_norm_matches_the_torch_ops() -> None:
    from radixserve.layers.layernorm import RMSNorm

    g = torch.Generator().manual_seed(0)
    norm = RMSNorm(576, 1e-5)
    norm.weight.data = torch.rand(576, generator=g) + 0.5
    x = (torch.randn(33, 700, generator=g) * 3)[:, :576]  # rows 700 apart
    r = torch.randn(33, 576, generator=g)
    torch.testing.assert_close(norm(x), norm._norm(x), rtol=2e-6, atol=1e-6)  # the sum of squares in double
    out, residual = norm(x, r)
    assert torch.equal(residual, x + r)  # the next residual is exactly the sum
    torch.testing.assert_close(out, norm._norm(x + r), rtol=2e-6, atol=1e-6)
    assert cpu_ops.rms_norm(x.double(), None, norm.weight, 1e-5) is None  # not float32: the torch ops run


def test_cpu_dtype_auto_follows_the_cpu_and_the_override(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.model_executor import model_runner as mr

    assert mr.cpu_has_fast_bf16("flags\t: fpu avx2 avx512f avx512_bf16 avx512_vnni")
    assert mr.cpu_has_fast_bf16("flags\t: fpu amx_bf16 amx_tile")
    assert not mr.cpu_has_fast_bf16("flags\t: fpu avx2 avx512f avx512_vnni")
    monkeypatch.delenv(mr.CPU_AUTO_DTYPE_ENV, raising=False)
    for fast, want in ((True, torch.bfloat16), (False, torch.float32)):
        monkeypatch.setattr(mr, "cpu_has_fast_bf16", lambda flags=None, fast=fast: fast)
        assert mr.resolve_dtype("auto", "cpu") == want
        assert mr.resolve_dtype("float32", "cpu") == torch.float32  # an explicit dtype is kept
    monkeypatch.setattr(mr, "cpu_has_fast_bf16", lambda flags=None: True)
    monkeypatch.setenv(mr.CPU_AUTO_DTYPE_ENV, "float32")
    assert mr.resolve_dtype("auto", "cpu") == torch.float32
    assert mr.resolve_dtype("auto", "cuda") == torch.bfloat16  # the GPU's rule is untouched
    monkeypatch.setenv(mr.CPU_AUTO_DTYPE_ENV, "fp8")
    with pytest.raises(ValueError, match="RADIXSERVE_CPU_AUTO_DTYPE"):
        mr.resolve_dtype("auto", "cpu")


@needs_compiler
def test_bf16_rows_take_the_kernels_with_the_torch_ops_semantics() -> None:
    """bfloat16 CPU rows go through the bfloat16 kernels: rotary equals the torch ops (float32 math, one rounding);
    RMSNorm's residual sum is the bfloat16 sum and its norm the torch ops' (transformers' order of roundings: the
    normalised row rounded to bfloat16, then times the weight), bit for bit but for the last bit of a few elements
    (1 / sqrt against rsqrt)."""
    from radixserve.layers.layernorm import RMSNorm
    from radixserve.layers.rotary_embedding import RotaryEmbedding

    g = torch.Generator().manual_seed(5)
    rope = RotaryEmbedding(64, 128, 10000.0)
    pos = torch.tensor([0, 5, 17, 100])
    q, k = torch.randn(4, 3 * 64, generator=g).bfloat16(), torch.randn(4, 64, generator=g).bfloat16()
    q_ref, k_ref = q.clone(), k.clone()
    assert cpu_ops.rotary_neox_inplace(pos, q, k, rope.cos_cache, rope.sin_cache, 64)
    rope.is_neox_style = True
    cos, sin = rope.cos_cache[pos].unsqueeze(1), rope.sin_cache[pos].unsqueeze(1)
    for got, x in ((q, q_ref), (k, k_ref)):
        x3 = x.reshape(4, -1, 64).float()
        x1, x2 = x3.chunk(2, dim=-1)
        want = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).bfloat16().reshape(x.shape)
        assert torch.equal(got, want)
    norm = RMSNorm(192).to(torch.bfloat16)
    norm.weight.data = torch.randn(192, generator=g).bfloat16()
    x, res = torch.randn(4, 192, generator=g).bfloat16(), torch.randn(4, 192, generator=g).bfloat16()
    out, new_res = norm(x, res)
    assert out.dtype == torch.bfloat16 and torch.equal(new_res, x + res)
    want = norm._norm(x + res)
    assert (out == want).float().mean() >= 0.98
    torch.testing.assert_close(out.float(), want.float(), rtol=8e-3, atol=1e-6)  # one bfloat16 step at most
    alone = norm(x)
    assert (alone == norm._norm(x)).float().mean() >= 0.98
    torch.testing.assert_close(alone.float(), norm._norm(x).float(), rtol=8e-3, atol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_persistent_linear_reorders_the_weight_once_and_matches_f_linear(dtype: torch.dtype) -> None:
    """A model weight (`persistent=True`) above a few rows goes through the oneDNN-reordered copy kept on the
    parameter: the same products as F.linear, the copy made once, and made again for a different tensor. Where
    this CPU's oneDNN has no inner product for the dtype (bfloat16 without AVX-512 BW/VL/DQ or AVX-NE-CONVERT), the
    same products through F.linear and no copy kept."""
    if not torch.backends.mkldnn.is_available() or not cpu_ops.PACKED:
        pytest.skip("no oneDNN, or the reordered path is turned off")
    try:
        torch.ops.mkldnn._reorder_linear_weight(torch.zeros(16, 16, dtype=dtype), None)
        reorderable = True
    except RuntimeError:
        reorderable = False
    g = torch.Generator().manual_seed(3)
    w = torch.nn.Parameter(torch.randn(200, 96, generator=g).to(dtype), requires_grad=False)
    b = torch.randn(200, generator=g).to(dtype)
    tol = {"rtol": 1e-5, "atol": 1e-4} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 5e-2}
    for rows in (9, 33, 200):
        x = torch.randn(rows, 96, generator=g).to(dtype)
        for bias in (None, b):
            got = cpu_ops.linear(x, w, bias, persistent=True)
            assert got.dtype == dtype and got.shape == (rows, 200)
            torch.testing.assert_close(got.float(), F.linear(x, w, bias).float(), **tol)
    key, packed = getattr(w, cpu_ops._PACKED_ATTR)
    if not reorderable:  # the fallback: F.linear's products above, the refusal remembered for this weight
        assert packed is None and key[0] == w.data_ptr()
        return
    assert packed is not None and key[0] == w.data_ptr()
    cpu_ops.linear(torch.randn(12, 96, generator=g).to(dtype), w, persistent=True)
    assert getattr(w, cpu_ops._PACKED_ATTR)[1] is packed  # reused, not reordered again
    w2 = torch.nn.Parameter(torch.randn(200, 96, generator=g).to(dtype), requires_grad=False)
    x = torch.randn(12, 96, generator=g).to(dtype)
    torch.testing.assert_close(cpu_ops.linear(x, w2, persistent=True).float(), F.linear(x, w2).float(), **tol)
    # a non-persistent weight (made for one call) is never reordered, and one row stays on the kernel
    w3 = torch.randn(200, 96, generator=g).to(dtype)
    cpu_ops.linear(x, w3)
    cpu_ops.linear(x[:1], w, persistent=True)
    assert not hasattr(w3, cpu_ops._PACKED_ATTR)


@needs_compiler
def test_argmax_rows_equals_torch_argmax() -> None:
    """Greedy decoding's argmax: torch.argmax's answer exactly, ties (first index), NaN rows and strided rows too."""
    g = torch.Generator().manual_seed(11)
    for b, v in ((1, 7), (3, 16), (5, 100), (33, 49157)):
        x = torch.randn(b, v, generator=g)
        assert torch.equal(cpu_ops.argmax_rows(x), torch.argmax(x, dim=-1))
    x = torch.zeros(4, 300)
    x[0, [5, 17, 250]] = 3.0  # a tie: the first index
    x[1, 299] = 1.0  # the last element, in the scalar tail
    x[2, [40, 41]] = float("nan")  # a NaN: its first index, as torch answers
    x[3, :] = -1.0  # all equal: index 0
    assert torch.equal(cpu_ops.argmax_rows(x), torch.argmax(x, dim=-1))
    assert cpu_ops.argmax_rows(x).tolist() == [5, 299, 40, 0]
    wide = torch.randn(6, 520, generator=g)[:, 3:503]  # rows 520 apart
    assert torch.equal(cpu_ops.argmax_rows(wide), torch.argmax(wide, dim=-1))
    assert cpu_ops.argmax_rows(x.double()) is None and cpu_ops.argmax_rows(x.bfloat16()) is None
