"""The flex backend against torch_native through real (paged) pools and a ForwardBatch: extend with prefix lengths
0..N, decode, GQA ratios, sliding windows, page sizes 1 and 16; the block lists cover every key a query may see; the
scheduler gives the same greedy tokens with flex as with the reference backend. On the CPU flex_attention runs
eagerly (it applies the mask_mod over every slot); tests/gpu/test_flex_gpu.py runs the compiled kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.layers.attention.base_attn_backend import first_key, local_window
from radixserve.layers.attention.flex_attention_backend import FlexAttnBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

LAYER = 1


def make_runner(hq: int, hkv: int, d: int, page_size: int, pool_size: int = 512, device: str = "cpu",
                dtype: torch.dtype = torch.float32) -> SimpleNamespace:
    cfg = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, is_mla=False)
    kv = TokenToKVPool(pool_size, dtype, hkv, d, num_layers=2, device=device, page_size=page_size)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.fill_(1e3)  # garbage in every slot not written: a read of a slot the mask should hide shows
    return SimpleNamespace(device=device, model_config=cfg, tp_size=1, token_to_kv_pool=kv,
                           req_to_token_pool=ReqToTokenPool(8, 256, device))


def layer(hq: int, hkv: int, d: int, window: int = -1, chunk: int = -1) -> SimpleNamespace:
    return SimpleNamespace(tp_q_head_num=hq, tp_k_head_num=hkv, tp_v_head_num=hkv, head_dim=d, scaling=d ** -0.5,
                           layer_id=LAYER, sliding_window_size=window, attention_chunk_size=chunk)


def forward_batch(runner: SimpleNamespace, backend: object, rows: list[int], pre: list[int], ext: list[int],
                  out_loc: torch.Tensor, mode: ForwardMode) -> ForwardBatch:
    seq = [p + e for p, e in zip(pre, ext, strict=True)]
    dev = runner.device
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(pre, ext, strict=True)]).to(dev)
    fb = ForwardBatch(forward_mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(ext), dtype=torch.int64),
                      req_pool_indices=torch.tensor(rows, device=dev), seq_lens=torch.tensor(seq, device=dev),
                      out_cache_loc=out_loc.to(dev),
                      seq_lens_sum=sum(seq), positions=positions, req_to_token_pool=runner.req_to_token_pool,
                      token_to_kv_pool=runner.token_to_kv_pool, attn_backend=backend, seq_lens_cpu=seq)
    if mode.is_extend():
        fb.extend_seq_lens = torch.tensor(ext, device=dev)
        fb.extend_prefix_lens = torch.tensor(pre, device=dev)
        fb.extend_start_loc = torch.tensor([sum(ext[:i]) for i in range(len(ext))], device=dev)
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(ext), list(pre)
    backend.init_forward_metadata(fb)
    return fb


def run_case(hq: int, hkv: int, page_size: int, prefix_lens: list[int], ext_lens: list[int], window: int,
             seed: int, device: str = "cpu", dtype: torch.dtype = torch.float32, d: int = 16,
             tol: float = 2e-5, chunk: int = -1) -> None:
    gen = torch.Generator().manual_seed(seed)
    runner = make_runner(hq, hkv, d, page_size, device=device, dtype=dtype)

    def randn(*shape: int) -> torch.Tensor:
        return torch.randn(*shape, generator=gen).to(device, dtype)

    kv, r2t = runner.token_to_kv_pool, runner.req_to_token_pool
    flex, ref = FlexAttnBackend(runner), TorchNativeAttnBackend(runner)
    lay = layer(hq, hkv, d, window, chunk)
    window = local_window(lay)  # the masks' key: 0 full, W sliding, -C chunked
    rows = r2t.alloc(len(prefix_lens))
    # the prefixes: written by one extend (so the flex backend records their slots' positions), as a cache would
    zeros = [0] * len(rows)
    slots = kv.alloc_extend(zeros, prefix_lens, zeros)
    r2t.write_batch(torch.repeat_interleave(torch.tensor(rows), torch.tensor(prefix_lens)),
                    torch.cat([torch.arange(n) for n in prefix_lens]), slots)
    r2t.apply_writes(r2t.take_pending_writes())
    if sum(prefix_lens):
        fb = forward_batch(runner, flex, rows, zeros, prefix_lens, slots, ForwardMode.EXTEND)
        k = randn(sum(prefix_lens), hkv * d)
        v = randn(sum(prefix_lens), hkv * d)
        flex.forward(randn(sum(prefix_lens), hq * d), k, v, lay, fb)
    # the new tokens: continue each request's last page
    seq = [p + e for p, e in zip(prefix_lens, ext_lens, strict=True)]
    last = [int(r2t.req_to_token_cpu[r, p - 1]) if p else 0 for r, p in zip(rows, prefix_lens, strict=True)]
    new = kv.alloc_extend(prefix_lens, seq, last)
    r2t.write_batch(torch.repeat_interleave(torch.tensor(rows), torch.tensor(ext_lens)),
                    torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq, strict=True)]), new)
    r2t.apply_writes(r2t.take_pending_writes())
    q = randn(sum(ext_lens), hq * d)
    k = randn(sum(ext_lens), hkv * d)
    v = randn(sum(ext_lens), hkv * d)
    fb = forward_batch(runner, flex, rows, prefix_lens, ext_lens, new, ForwardMode.EXTEND)
    out = flex.forward(q, k, v, lay, fb)
    check_block_coverage(flex, fb, rows, prefix_lens, ext_lens, window)
    fb_ref = forward_batch(runner, ref, rows, prefix_lens, ext_lens, new, ForwardMode.EXTEND)
    expect = ref.forward(q, k, v, lay, fb_ref, save_kv_cache=False)
    torch.testing.assert_close(out, expect, atol=tol, rtol=tol)
    # one decode step for every request
    seq_d = [s + 1 for s in seq]
    last = torch.tensor([int(r2t.req_to_token_cpu[r, s - 1]) for r, s in zip(rows, seq, strict=True)])
    loc = kv.alloc_decode(torch.tensor(seq_d), last)
    r2t.write_batch(torch.tensor(rows), torch.tensor(seq), loc)
    r2t.apply_writes(r2t.take_pending_writes())
    q = randn(len(rows), hq * d)
    k = randn(len(rows), hkv * d)
    v = randn(len(rows), hkv * d)
    fb = forward_batch(runner, flex, rows, seq, [1] * len(rows), loc, ForwardMode.DECODE)
    out = flex.forward(q, k, v, lay, fb)
    fb_ref = forward_batch(runner, ref, rows, seq, [1] * len(rows), loc, ForwardMode.DECODE)
    torch.testing.assert_close(out, ref.forward(q, k, v, lay, fb_ref, save_kv_cache=False), atol=tol, rtol=tol)
    check_decode_coverage(flex, rows, seq_d, window)
    # the same step as a CUDA-graph replay would run it: the static metadata of the graphs, refreshed by the hook
    flex.init_cuda_graph_state(8)
    flex.init_forward_metadata_capture_cuda_graph(len(rows), fb.req_pool_indices, fb.seq_lens)
    flex.init_forward_metadata(fb)
    flex.init_forward_metadata_replay_cuda_graph(len(rows), fb.req_pool_indices, fb.seq_lens, sum(seq_d))
    flex._meta, flex._use_graph_meta = flex._graph_meta(len(rows)), True
    out = flex.forward(q, k, v, lay, fb)
    torch.testing.assert_close(out, ref.forward(q, k, v, lay, fb_ref, save_kv_cache=False), atol=tol, rtol=tol)
    check_decode_coverage(flex, rows, seq_d, window)


def visible(row: int, pos: int, window: int, table: torch.Tensor) -> set[int]:
    first = max(0, first_key(pos, window))
    return set(table[row, first:pos + 1].tolist())


def check_block_coverage(flex: FlexAttnBackend, fb: ForwardBatch, rows, pre, ext, window) -> None:
    """Every slot a query may see lies in a KV block its query block lists (the GPU kernel reads only those)."""
    num, idx, _ = flex._meta["masks"][window]
    qb, kb, table = flex.q_block, flex.kv_block_extend, flex.req_to_token
    q = 0
    for r, p, e in zip(rows, pre, ext, strict=True):
        for j in range(e):
            listed = set(idx[0, 0, q // qb, :int(num[0, 0, q // qb])].tolist())
            assert {s // kb for s in visible(r, p + j, window, table)} <= listed
            q += 1


def check_decode_coverage(flex: FlexAttnBackend, rows, seq, window) -> None:
    num, idx, _ = flex._meta["masks"][window]
    kb, table = flex.kv_block_decode, flex.req_to_token
    for b, (r, s) in enumerate(zip(rows, seq, strict=True)):
        listed = idx[b, 0, 0, :int(num[b, 0, 0])].tolist()
        assert len(listed) == len(set(listed))  # a block listed twice would be counted twice
        assert {x // kb for x in visible(r, s - 1, window, table)} <= set(listed)
    assert int(num[len(rows):].sum()) == 0  # padding rows list nothing


@pytest.mark.parametrize("page_size,hq,hkv", [(1, 4, 4), (16, 4, 1), (1, 8, 2), (16, 8, 2)])
def test_flex_matches_torch_native(page_size: int, hq: int, hkv: int) -> None:
    run_case(hq, hkv, page_size, prefix_lens=[0, 5, 16, 33], ext_lens=[7, 1, 20, 40], window=-1, seed=hq + hkv)


@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_sliding_window(page_size: int) -> None:
    run_case(4, 2, page_size, prefix_lens=[0, 30, 17], ext_lens=[45, 3, 25], window=8, seed=3)


@pytest.mark.parametrize("page_size", [1, 16])
def test_flex_chunked_attention(page_size: int) -> None:
    """Llama 4's chunks: prefixes and new tokens crossing chunk boundaries, in extend and decode."""
    run_case(4, 2, page_size, prefix_lens=[0, 30, 17], ext_lens=[45, 3, 25], window=-1, seed=4, chunk=16)


def test_flex_long_extend_spans_several_query_blocks() -> None:
    run_case(2, 1, 16, prefix_lens=[3, 0], ext_lens=[150, 130], window=-1, seed=5)


def test_flex_knows_the_config_windows_before_any_request() -> None:
    """CUDA-graph capture runs decode before any extend: the windows must come from the config, not from traffic."""
    runner = make_runner(2, 1, 16, 1)
    runner.model_config.sliding_windows = [-1, 6]
    assert FlexAttnBackend(runner).windows == {0, 6}  # (0: full attention)


def test_flex_refuses_fp8_and_mla() -> None:
    runner = make_runner(2, 1, 16, 1)
    runner.token_to_kv_pool.dtype = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8"):
        FlexAttnBackend(runner)
    runner = make_runner(2, 1, 16, 1)
    runner.model_config.is_mla = True
    with pytest.raises(ValueError, match="MLA"):
        FlexAttnBackend(runner)


@pytest.mark.parametrize("window,chunk", [(-1, -1), (5, -1), (-1, 8)])
def test_torch_native_static_decode_equals_eager(window: int, chunk: int) -> None:
    """The decode torch_native captures in CUDA graphs (fixed width, masks, no host reads) equals its eager decode."""
    runner = make_runner(4, 2, 16, 1)
    kv, r2t = runner.token_to_kv_pool, runner.req_to_token_pool
    gen = torch.Generator().manual_seed(0)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.copy_(torch.randn(buf.shape, generator=gen))
    native = TorchNativeAttnBackend(runner)
    native.init_cuda_graph_state(4)
    rows = r2t.alloc(3)
    lens = [9, 1, 30]
    for r, n in zip(rows, lens, strict=True):
        r2t.write(r, 0, kv.alloc(n))
    lay = layer(4, 2, 16, window, chunk)
    q = torch.randn(3, 64, generator=gen)
    fb = forward_batch(runner, native, rows, [n - 1 for n in lens], [1, 1, 1], torch.zeros(3, dtype=torch.int64),
                       ForwardMode.DECODE)
    eager = native.forward(q, q[:, :32], q[:, :32], lay, fb, save_kv_cache=False)
    native.init_forward_metadata_capture_cuda_graph(3, fb.req_pool_indices, fb.seq_lens)
    static = native.forward(q, q[:, :32], q[:, :32], lay, fb, save_kv_cache=False)
    torch.testing.assert_close(static, eager, atol=1e-5, rtol=1e-5)
    assert native.cuda_graph_max_seq_len() == min(4096, r2t.req_to_token.shape[1])


def test_graph_runner_sends_sequences_past_the_backend_bound_to_eager() -> None:
    from radixserve.model_executor.cuda_graph_runner import CudaGraphRunner

    runner = make_runner(2, 1, 16, 1)
    stub = SimpleNamespace(backend=TorchNativeAttnBackend(runner), dp_attention=False, max_bs=8)
    stub.can_run_decode = lambda n, lens: CudaGraphRunner.can_run_decode(stub, n, lens)
    bound = stub.backend.cuda_graph_max_seq_len()

    def batch(lens: list[int]) -> SimpleNamespace:
        return SimpleNamespace(forward_mode=ForwardMode.DECODE, batch_size=len(lens), seq_lens_cpu=lens)

    assert CudaGraphRunner.can_run(stub, batch([5, bound]))
    assert not CudaGraphRunner.can_run(stub, batch([5, bound + 1]))
    assert not CudaGraphRunner.can_run(stub, batch([5] * 9))
    stub.backend = FlexAttnBackend(runner)  # no bound
    assert CudaGraphRunner.can_run(stub, batch([5, 10 ** 6]))


def test_prefill_graphs_only_for_backends_whose_extend_is_capturable() -> None:
    """flex builds its extend block masks on the host and torch_native loops over requests there: a captured
    one-request prefill would replay the metadata of the capture, so neither takes prefill graphs."""
    from radixserve.model_executor.prefill_graph_runner import prefill_graphs_supported

    runner = make_runner(2, 1, 16, 1)
    stub = SimpleNamespace(is_cuda=True, tp_size=1, lora_manager=None, model_config=SimpleNamespace(is_mla=False),
                           server_args=SimpleNamespace(is_embedding=False, enable_dp_attention=False))
    for backend in (FlexAttnBackend(runner), TorchNativeAttnBackend(runner)):
        stub.attn_backend = backend
        assert backend.supports_cuda_graph and not prefill_graphs_supported(stub)
    stub.attn_backend = SimpleNamespace(supports_cuda_graph=True, supports_prefill_cuda_graph=True)
    assert prefill_graphs_supported(stub)


@pytest.mark.parametrize("page_size", [1, 8, 16, 32])
def test_flex_graph_block_kernel_equals_torch_lists(page_size: int) -> None:
    """The Triton kernel a CUDA graph runs to build the decode block lists (TRITON_INTERPRET=1 on the CPU) gives the
    torch reference's lists, positions and slot records, for interleaved pages, windows and padding rows."""
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # tests/gpu/ runs this file's kernel test on the GPU too
    if not FlexAttnBackend(make_runner(2, 1, 16, page_size, device=dev))._fill_in_graph:
        pytest.skip("no CUDA and triton was imported without TRITON_INTERPRET=1")
    gen = torch.Generator().manual_seed(page_size)
    runner = make_runner(2, 1, 16, page_size, pool_size=1024, device=dev)
    runner.model_config.sliding_windows = [-1, 5, 40]
    kv, r2t = runner.token_to_kv_pool, runner.req_to_token_pool
    rows = r2t.alloc(5)
    lens = [70, 1, 33, 130, 17]  # a length-1 row is padding
    last = [0] * len(rows)
    for step in range(max(lens)):  # grow the requests together, so their pages interleave in the pool
        grow = [i for i, n in enumerate(lens) if n > step and (step % page_size == 0 or page_size == 1)]
        for i in grow:
            n = min(page_size, lens[i] - step)
            slots = kv.alloc_extend([step], [step + n], [last[i]])
            r2t.write(rows[i], step, slots)
            last[i] = int(slots[-1])
    r2t.apply_writes(r2t.take_pending_writes())
    if page_size == 1:  # shuffle slot order inside rows, as frees and reuse leave it
        table = r2t.req_to_token
        for r, n in zip(rows, lens, strict=True):
            table[r, :n] = table[r, :n][torch.randperm(n, generator=gen).to(dev)]
    seq = torch.tensor(lens, device=dev)
    req = torch.tensor(rows, device=dev)
    ref, ker = FlexAttnBackend(runner), FlexAttnBackend(runner)
    for b in (ref, ker):
        b.windows.add(-24)  # a layer with chunks of 24 (Llama 4)
        b.init_cuda_graph_state(8)
    meta_ref, meta_ker = ref._graph_meta(len(rows)), ker._graph_meta(len(rows))
    assert meta_ker["rows"] == 8
    for _ in range(2):  # twice: the bitmap must be clean after the first fill
        ref._fill_decode_meta(meta_ref, req, seq, max(lens))
        ker._fill_decode_meta_kernel(meta_ker, req, seq)
        torch.testing.assert_close(ker.slot_pos, ref.slot_pos)
        torch.testing.assert_close(meta_ker["pos"], meta_ref["pos"])
        torch.testing.assert_close(meta_ker["row"], meta_ref["row"])
        for window in (0, 5, 40, -24):
            num_r, idx_r, _ = meta_ref["masks"][window]
            num_k, idx_k, _ = meta_ker["masks"][window]
            torch.testing.assert_close(num_k, num_r)
            for b in range(len(rows)):
                n = int(num_r[b])
                assert idx_k[b, 0, 0, :n].tolist() == idx_r[b, 0, 0, :n].tolist()
            assert int(num_k[1]) == 0 and int(num_k[len(rows):].sum()) == 0
        if "bitmap" in meta_ker:
            assert int(meta_ker["bitmap"].abs().sum()) == 0
