"""The flex backend against torch_native through real (paged) pools and a ForwardBatch: extend with prefix lengths
0..N, decode, GQA ratios, sliding windows, page sizes 1 and 16; the block lists cover every key a query may see; the
scheduler gives the same greedy tokens with flex as with the reference backend. On the CPU flex_attention runs
eagerly (it applies the mask_mod over every slot); tests/gpu/test_flex_gpu.py runs the compiled kernels."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.layers.attention.flex_attention_backend import FlexAttnBackend
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

LAYER = 1


def make_runner(hq: int, hkv: int, d: int, page_size: int, pool_size: int = 512) -> SimpleNamespace:
    cfg = SimpleNamespace(num_attention_heads=hq, num_key_value_heads=hkv, head_dim=d, is_mla=False)
    kv = TokenToKVPool(pool_size, torch.float32, hkv, d, num_layers=2, device="cpu", page_size=page_size)
    for buf in kv.k_buffer + kv.v_buffer:
        buf.fill_(1e3)  # garbage in every slot not written: a read of a slot the mask should hide shows
    return SimpleNamespace(device="cpu", model_config=cfg, tp_size=1, token_to_kv_pool=kv,
                           req_to_token_pool=ReqToTokenPool(8, 256, "cpu"))


def layer(hq: int, hkv: int, d: int, window: int = -1) -> SimpleNamespace:
    return SimpleNamespace(tp_q_head_num=hq, tp_k_head_num=hkv, tp_v_head_num=hkv, head_dim=d, scaling=d ** -0.5,
                           layer_id=LAYER, sliding_window_size=window)


def forward_batch(runner: SimpleNamespace, backend: object, rows: list[int], pre: list[int], ext: list[int],
                  out_loc: torch.Tensor, mode: ForwardMode) -> ForwardBatch:
    seq = [p + e for p, e in zip(pre, ext, strict=True)]
    positions = torch.cat([torch.arange(p, p + e) for p, e in zip(pre, ext, strict=True)])
    fb = ForwardBatch(forward_mode=mode, batch_size=len(rows), input_ids=torch.zeros(sum(ext), dtype=torch.int64),
                      req_pool_indices=torch.tensor(rows), seq_lens=torch.tensor(seq), out_cache_loc=out_loc,
                      seq_lens_sum=sum(seq), positions=positions, req_to_token_pool=runner.req_to_token_pool,
                      token_to_kv_pool=runner.token_to_kv_pool, attn_backend=backend, seq_lens_cpu=seq)
    if mode.is_extend():
        fb.extend_seq_lens = torch.tensor(ext)
        fb.extend_prefix_lens = torch.tensor(pre)
        fb.extend_start_loc = torch.tensor([sum(ext[:i]) for i in range(len(ext))])
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(ext), list(pre)
    backend.init_forward_metadata(fb)
    return fb


def run_case(hq: int, hkv: int, page_size: int, prefix_lens: list[int], ext_lens: list[int], window: int,
             seed: int) -> None:
    d = 16
    gen = torch.Generator().manual_seed(seed)
    runner = make_runner(hq, hkv, d, page_size)
    kv, r2t = runner.token_to_kv_pool, runner.req_to_token_pool
    flex, ref = FlexAttnBackend(runner), TorchNativeAttnBackend(runner)
    lay = layer(hq, hkv, d, window)
    rows = r2t.alloc(len(prefix_lens))
    # the prefixes: written by one extend (so the flex backend records their slots' positions), as a cache would
    zeros = [0] * len(rows)
    slots = kv.alloc_extend(zeros, prefix_lens, zeros)
    r2t.write_batch(torch.repeat_interleave(torch.tensor(rows), torch.tensor(prefix_lens)),
                    torch.cat([torch.arange(n) for n in prefix_lens]), slots)
    if sum(prefix_lens):
        fb = forward_batch(runner, flex, rows, zeros, prefix_lens, slots, ForwardMode.EXTEND)
        k = torch.randn(sum(prefix_lens), hkv * d, generator=gen)
        v = torch.randn(sum(prefix_lens), hkv * d, generator=gen)
        flex.forward(torch.randn(sum(prefix_lens), hq * d, generator=gen), k, v, lay, fb)
    # the new tokens: continue each request's last page
    seq = [p + e for p, e in zip(prefix_lens, ext_lens, strict=True)]
    last = [int(r2t.req_to_token[r, p - 1]) if p else 0 for r, p in zip(rows, prefix_lens, strict=True)]
    new = kv.alloc_extend(prefix_lens, seq, last)
    r2t.write_batch(torch.repeat_interleave(torch.tensor(rows), torch.tensor(ext_lens)),
                    torch.cat([torch.arange(p, s) for p, s in zip(prefix_lens, seq, strict=True)]), new)
    q = torch.randn(sum(ext_lens), hq * d, generator=gen)
    k = torch.randn(sum(ext_lens), hkv * d, generator=gen)
    v = torch.randn(sum(ext_lens), hkv * d, generator=gen)
    fb = forward_batch(runner, flex, rows, prefix_lens, ext_lens, new, ForwardMode.EXTEND)
    out = flex.forward(q, k, v, lay, fb)
    check_block_coverage(flex, fb, rows, prefix_lens, ext_lens, window)
    fb_ref = forward_batch(runner, ref, rows, prefix_lens, ext_lens, new, ForwardMode.EXTEND)
    expect = ref.forward(q, k, v, lay, fb_ref, save_kv_cache=False)
    torch.testing.assert_close(out, expect, atol=2e-5, rtol=2e-5)
    # one decode step for every request
    seq_d = [s + 1 for s in seq]
    last = torch.tensor([int(r2t.req_to_token[r, s - 1]) for r, s in zip(rows, seq, strict=True)])
    loc = kv.alloc_decode(torch.tensor(seq_d), last)
    r2t.write_batch(torch.tensor(rows), torch.tensor(seq), loc)
    q = torch.randn(len(rows), hq * d, generator=gen)
    k = torch.randn(len(rows), hkv * d, generator=gen)
    v = torch.randn(len(rows), hkv * d, generator=gen)
    fb = forward_batch(runner, flex, rows, seq, [1] * len(rows), loc, ForwardMode.DECODE)
    out = flex.forward(q, k, v, lay, fb)
    fb_ref = forward_batch(runner, ref, rows, seq, [1] * len(rows), loc, ForwardMode.DECODE)
    torch.testing.assert_close(out, ref.forward(q, k, v, lay, fb_ref, save_kv_cache=False), atol=2e-5, rtol=2e-5)
    check_decode_coverage(flex, rows, seq_d, window)


def visible(row: int, pos: int, window: int, table: torch.Tensor) -> set[int]:
    first = max(0, pos - window + 1) if window > 0 else 0
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


def test_flex_long_extend_spans_several_query_blocks() -> None:
    run_case(2, 1, 16, prefix_lens=[3, 0], ext_lens=[150, 130], window=-1, seed=5)


def test_flex_refuses_fp8_and_mla() -> None:
    runner = make_runner(2, 1, 16, 1)
    runner.token_to_kv_pool.dtype = torch.float8_e4m3fn
    with pytest.raises(ValueError, match="fp8"):
        FlexAttnBackend(runner)
    runner = make_runner(2, 1, 16, 1)
    runner.model_config.is_mla = True
    with pytest.raises(ValueError, match="MLA"):
        FlexAttnBackend(runner)
