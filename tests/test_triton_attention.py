"""Triton attention backend vs the torch_native reference, through real pools and a ForwardBatch.

Without CUDA the kernels run in Triton's interpreter (conftest.py chooses it before triton is first imported); with
CUDA they run on the GPU.
"""

from __future__ import annotations

from collections.abc import Callable
from types import SimpleNamespace

import pytest
import torch

triton = pytest.importorskip("triton")

from radixserve.layers.attention import create_attention_backend  # noqa: E402
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_ops import decode_attention, extend_attention  # noqa: E402
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LAYER_ID = 1  # not 0, so a wrong layer index shows


def make_runner(num_heads: int, num_kv_heads: int, head_dim: int, dtype: torch.dtype, pool_size: int = 2048,
                rows: int = 16, context: int = 1024) -> SimpleNamespace:
    cfg = SimpleNamespace(num_attention_heads=num_heads, num_key_value_heads=num_kv_heads, head_dim=head_dim)
    kv_pool = TokenToKVPool(pool_size, dtype, num_kv_heads, head_dim, num_layers=2, device=DEVICE)
    for buf in kv_pool.k_buffer + kv_pool.v_buffer:
        buf.fill_(float("nan"))  # any read of a slot the kernels should not touch poisons the output
    return SimpleNamespace(device=DEVICE, model_config=cfg, tp_size=1, dtype=dtype,
                           req_to_token_pool=ReqToTokenPool(rows, context, DEVICE), token_to_kv_pool=kv_pool)


def make_layer(num_heads: int, num_kv_heads: int, head_dim: int, logit_cap: float = 0.0) -> SimpleNamespace:
    return SimpleNamespace(tp_q_head_num=num_heads, tp_k_head_num=num_kv_heads, tp_v_head_num=num_kv_heads,
                           head_dim=head_dim, scaling=head_dim ** -0.5, layer_id=LAYER_ID, sliding_window_size=-1,
                           logit_cap=logit_cap)


def scattered_batch(runner: SimpleNamespace, backend: object, prefix_lens: list[int], extend_lens: list[int],
                    mode: ForwardMode, gen: torch.Generator, fill_prefix: Callable[[torch.Tensor], None]
                    ) -> ForwardBatch:
    """A ForwardBatch of requests whose slots are scattered over the pool; `fill_prefix(slots)` writes each
    request's cached prefix (slots on DEVICE) into the pool before the batch is built."""
    r2t, pool = runner.req_to_token_pool, runner.token_to_kv_pool
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    rows = r2t.alloc(len(totals))
    slots = pool.alloc(sum(totals))
    if rows is None or slots is None:
        raise RuntimeError("test pools too small")
    slots = slots[torch.randperm(len(slots), generator=gen)]
    out_locs, start = [], 0
    for row, pre, total in zip(rows, prefix_lens, totals, strict=True):
        mine = slots[start:start + total]
        start += total
        r2t.write(row, 0, mine)
        fill_prefix(mine[:pre].to(DEVICE))
        out_locs.append(mine[pre:])
    r2t.apply_writes(r2t.take_pending_writes())  # on a GPU, request-table writes wait for the next forward
    num_tokens = sum(extend_lens)

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=DEVICE)

    fb = ForwardBatch(
        forward_mode=mode, batch_size=len(totals), input_ids=torch.zeros(num_tokens, dtype=torch.int64,
                                                                         device=DEVICE),
        req_pool_indices=dev(rows), seq_lens=dev(totals), out_cache_loc=torch.cat(out_locs).to(DEVICE),
        seq_lens_sum=sum(totals), positions=None, req_to_token_pool=r2t, token_to_kv_pool=pool,
        attn_backend=backend, seq_lens_cpu=list(totals))  # type: ignore[arg-type]
    if mode.is_extend():
        starts = [sum(extend_lens[:i]) for i in range(len(extend_lens))]
        fb.extend_seq_lens, fb.extend_prefix_lens, fb.extend_start_loc = dev(extend_lens), dev(prefix_lens), \
            dev(starts)
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(extend_lens), list(prefix_lens)
    return fb


def make_batch(runner: SimpleNamespace, backend: object, prefix_lens: list[int], extend_lens: list[int],
               mode: ForwardMode, gen: torch.Generator) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor,
                                                                 torch.Tensor]:
    """Requests whose prefix KV sits in the pool at scattered slots; returns the batch and the new q, k, v."""
    cfg, dtype = runner.model_config, runner.dtype
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(LAYER_ID)

    def fill(slots: torch.Tensor) -> None:
        shape = (len(slots), cfg.num_key_value_heads, cfg.head_dim)
        k_buf[slots] = torch.randn(shape, generator=gen).to(DEVICE, dtype)
        v_buf[slots] = torch.randn(shape, generator=gen).to(DEVICE, dtype)

    fb = scattered_batch(runner, backend, prefix_lens, extend_lens, mode, gen, fill)
    num_tokens = sum(extend_lens)
    q = torch.randn(num_tokens, cfg.num_attention_heads * cfg.head_dim, generator=gen).to(DEVICE, dtype)
    k = torch.randn(num_tokens, cfg.num_key_value_heads * cfg.head_dim, generator=gen).to(DEVICE, dtype)
    v = torch.randn(num_tokens, cfg.num_key_value_heads * cfg.head_dim, generator=gen).to(DEVICE, dtype)
    return fb, q, k, v


def run_both(num_heads: int, num_kv_heads: int, head_dim: int, prefix_lens: list[int], extend_lens: list[int],
             mode: ForwardMode, dtype: torch.dtype = torch.float32, tune: dict | None = None,
             seed: int = 0, backends: list | None = None, logit_cap: float = 0.0) -> tuple[torch.Tensor, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    runner = make_runner(num_heads, num_kv_heads, head_dim, dtype)
    backend = TritonAttnBackend(runner)
    if backends is not None:
        backends.append(backend)
    for name, value in (tune or {}).items():
        setattr(backend, name, value)
    layer = make_layer(num_heads, num_kv_heads, head_dim, logit_cap)
    fb, q, k, v = make_batch(runner, backend, prefix_lens, extend_lens, mode, gen)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)
    k_buf, v_buf = runner.token_to_kv_pool.get_kv_buffer(LAYER_ID)
    torch.testing.assert_close(k_buf[fb.out_cache_loc], k.view(-1, num_kv_heads, head_dim), rtol=0, atol=0)
    torch.testing.assert_close(v_buf[fb.out_cache_loc], v.view(-1, num_kv_heads, head_dim), rtol=0, atol=0)
    ref_backend = TorchNativeAttnBackend(runner)
    ref_backend.init_forward_metadata(fb)
    ref = ref_backend.forward(q, k, v, layer, fb)
    assert out.shape == ref.shape and out.dtype == q.dtype
    return out, ref


def tol(dtype: torch.dtype) -> dict:
    return {"rtol": 2e-2, "atol": 2e-2} if dtype != torch.float32 else {"rtol": 1e-4, "atol": 1e-4}


# ---------------------------------------------------------------- extend
EXTEND_CASES = [
    # (H, Hkv, D, prefix_lens, extend_lens, dtype)
    (4, 4, 64, [0, 5, 33, 64], [7, 1, 30, 17], torch.float32),  # MHA, no prefix / prefix, a 1-token extend
    (8, 2, 32, [1, 0, 2, 19], [70, 3, 1, 40], torch.float32),  # GQA 4, several query blocks per request
    (8, 1, 64, [31, 0], [9, 33], torch.bfloat16),  # GQA 8, bf16
    (2, 1, 96, [13], [21], torch.float32),  # head_dim that is not a power of two
]


@pytest.mark.parametrize("case", EXTEND_CASES, ids=lambda c: f"H{c[0]}-Hkv{c[1]}-D{c[2]}-{str(c[5])[6:]}")
def test_extend_matches_torch_native(case: tuple) -> None:
    h, hkv, d, prefix_lens, extend_lens, dtype = case
    out, ref = run_both(h, hkv, d, prefix_lens, extend_lens, ForwardMode.EXTEND, dtype)
    torch.testing.assert_close(out, ref, **tol(dtype))


def test_mixed_mode_runs_as_extend() -> None:
    out, ref = run_both(4, 2, 32, [10, 25, 3], [1, 12, 1], ForwardMode.MIXED)
    torch.testing.assert_close(out, ref, **tol(torch.float32))


@pytest.mark.parametrize("prefix_lens,extend_lens,tail", [
    # a chunk, a one-token extend between longer ones (stays in the extend kernel), four decodes riding along
    ([0, 40, 7, 90, 1, 33, 64], [20, 1, 9, 1, 1, 1, 1], 4),
    ([5, 17, 100], [1, 1, 1], 3),  # only one-token extends: the decode kernel alone
    ([12, 0], [1, 30], 0),  # a one-token extend that is not at the tail
])
def test_mixed_batch_decodes_its_one_token_tail(prefix_lens: list[int], extend_lens: list[int], tail: int) -> None:
    backends: list = []
    out, ref = run_both(8, 2, 32, prefix_lens, extend_lens, ForwardMode.MIXED, tune=SMALL_SPLITS,
                        backends=backends)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    meta = backends[0].forward_metadata
    assert meta.tail_decodes == tail
    assert meta.max_extend_len == max(extend_lens[:len(extend_lens) - tail], default=0)


@pytest.mark.parametrize("mode,prefix_lens,extend_lens", [
    (ForwardMode.MIXED, [0, 40, 7, 90, 33], [20, 9, 1, 1, 1]),  # two prompts, three decodes riding along
    (ForwardMode.EXTEND, [3, 0], [17, 40]),
])
@pytest.mark.parametrize("one_split", [False, True], ids=["splits", "one-split"])
def test_later_layers_replay_the_first_layers_launches(mode: ForwardMode, prefix_lens: list[int],
                                                      extend_lens: list[int], one_split: bool) -> None:
    """The layers of one batch after the first replay its recorded launches with their own q/k/v, output and KV
    buffers (TritonForwardMetadata.plans); each must still equal the reference for its own layer, and a layer with
    another attention parameter (here a sliding window) records a plan of its own. With one split a request the
    riding decodes' stage 1 writes the output itself, which the replay must point at each layer's own output."""
    h, hkv, d = 8, 2, 32
    gen = torch.Generator().manual_seed(11)
    runner = make_runner(h, hkv, d, torch.float32)
    backend = TritonAttnBackend(runner)
    for name, value in SMALL_SPLITS.items():
        setattr(backend, name, value)
    if one_split:
        backend.num_sms, backend.programs_per_sm = 1, 1
    pool = runner.token_to_kv_pool

    def fill(slots: torch.Tensor) -> None:
        for layer_id in (0, 1):
            k_buf, v_buf = pool.get_kv_buffer(layer_id)
            k_buf[slots] = torch.randn((len(slots), hkv, d), generator=gen).to(DEVICE)
            v_buf[slots] = torch.randn((len(slots), hkv, d), generator=gen).to(DEVICE)

    fb = scattered_batch(runner, backend, prefix_lens, extend_lens, mode, gen, fill)
    ref_backend = TorchNativeAttnBackend(runner)
    backend.init_forward_metadata(fb)
    ref_backend.init_forward_metadata(fb)
    n = sum(extend_lens)
    layers = [make_layer(h, hkv, d) for _ in range(3)]
    layers[0].layer_id, layers[1].layer_id, layers[2].layer_id = 0, 1, 0
    layers[2].sliding_window_size = 8
    for layer in layers:
        q = torch.randn(n, h * d, generator=gen).to(DEVICE)
        k = torch.randn(n, hkv * d, generator=gen).to(DEVICE)
        v = torch.randn(n, hkv * d, generator=gen).to(DEVICE)
        out = backend.forward(q, k, v, layer, fb)
        torch.testing.assert_close(out, ref_backend.forward(q, k, v, layer, fb), **tol(torch.float32))
    assert len(backend.forward_metadata.plans) == 2  # the first two layers share one, the windowed has its own
    if mode == ForwardMode.MIXED:  # its decodes' split count
        assert (backend.forward_metadata.num_kv_splits == 1) == one_split


def test_extend_skips_empty_requests() -> None:
    out, ref = run_both(4, 2, 32, [6, 4, 9], [5, 0, 2], ForwardMode.EXTEND)
    torch.testing.assert_close(out, ref, **tol(torch.float32))


# ---------------------------------------------------------------- decode
# many small splits, merged in stage 1's launch whatever the shape (the default does so only where it paid)
SMALL_SPLITS = {"min_split_len": 16, "decode_block_n": 16, "decode_one_launch": True}
DECODE_CASES = [
    # (H, Hkv, D, seq_lens, dtype, tunables)
    (4, 4, 64, [1, 2, 17, 64, 100, 257], torch.float32, SMALL_SPLITS),  # MHA through a padded tl.dot
    (4, 4, 32, [1, 30, 131], torch.float32, {**SMALL_SPLITS, "decode_use_dot": False}),  # MHA, elementwise
    (8, 2, 32, [1, 33, 48, 129, 7], torch.float32, SMALL_SPLITS),  # GQA 4 through tl.dot
    (8, 1, 64, [1, 90, 300], torch.bfloat16, SMALL_SPLITS),  # GQA 8, bf16
    (4, 2, 96, [5, 77], torch.float32, SMALL_SPLITS),  # padded head_dim
    (128, 1, 16, [3, 40], torch.float32, SMALL_SPLITS),  # group of 128: two head blocks per KV head
    (8, 2, 64, [1, 63, 64, 65, 200], torch.float32, {}),  # the default tunables
    (8, 2, 32, [1, 33, 129, 7], torch.float32, {**SMALL_SPLITS, "decode_one_launch": False}),  # stage 2 merges
]


def _decode_id(c: tuple) -> str:
    path = "elementwise" if c[5].get("decode_use_dot") is False else "dot"
    launches = "-two-launches" if c[5].get("decode_one_launch") is False else ""
    return f"H{c[0]}-Hkv{c[1]}-D{c[2]}-{str(c[4])[6:]}-{path}{launches}"


@pytest.mark.parametrize("case", DECODE_CASES, ids=_decode_id)
def test_decode_matches_torch_native(case: tuple) -> None:
    h, hkv, d, seq_lens, dtype, tune = case
    out, ref = run_both(h, hkv, d, [s - 1 for s in seq_lens], [1] * len(seq_lens), ForwardMode.DECODE, dtype,
                        tune)
    torch.testing.assert_close(out, ref, **tol(dtype))


@pytest.mark.parametrize("mode,prefix_lens,extend_lens,tune", [
    (ForwardMode.EXTEND, [0, 5, 33, 64], [7, 1, 30, 17], {}),
    (ForwardMode.DECODE, [0, 32, 47, 128, 6], [1] * 5, SMALL_SPLITS),
    (ForwardMode.DECODE, [0, 29, 130], [1] * 3, {**SMALL_SPLITS, "decode_use_dot": False}),
    (ForwardMode.DECODE, [0, 32, 128, 6], [1] * 4, {**SMALL_SPLITS, "decode_one_launch": False}),
], ids=["extend", "decode-dot", "decode-elementwise", "decode-two-launches"])
def test_soft_capped_scores_match_torch_native(mode: ForwardMode, prefix_lens: list[int], extend_lens: list[int],
                                               tune: dict) -> None:
    """Gemma 2's attn_logit_softcapping: the kernels' cap (in log2 e units) equals the reference's cap * tanh(s /
    cap), which differs from the uncapped attention here."""
    hkv = 1 if tune.get("decode_use_dot") is False else 2
    h = hkv * (1 if tune.get("decode_use_dot") is False else 4)
    out, ref = run_both(h, hkv, 32, prefix_lens, extend_lens, mode, torch.float32, tune, logit_cap=1.0)
    torch.testing.assert_close(out, ref, **tol(torch.float32))
    _, uncapped = run_both(h, hkv, 32, prefix_lens, extend_lens, mode, torch.float32, tune)
    assert not torch.allclose(ref, uncapped, atol=1e-2)


def test_decode_split_cap_of_one() -> None:
    """A large batch on a small GPU caps every request at one split: stage 2 then copies."""
    h, hkv, d, seq_lens = 4, 2, 32, [1, 50, 130]
    gen = torch.Generator().manual_seed(3)
    runner = make_runner(h, hkv, d, torch.float32)
    backend = TritonAttnBackend(runner)
    backend.num_sms, backend.programs_per_sm = 1, 1
    backend.min_split_len = 16
    layer = make_layer(h, hkv, d)
    fb, q, k, v = make_batch(runner, backend, [s - 1 for s in seq_lens], [1] * 3, ForwardMode.DECODE, gen)
    backend.init_forward_metadata(fb)
    assert backend.forward_metadata is not None and backend.forward_metadata.num_kv_splits == 1
    out = backend.forward(q, k, v, layer, fb)
    ref_backend = TorchNativeAttnBackend(runner)
    ref_backend.init_forward_metadata(fb)
    torch.testing.assert_close(out, ref_backend.forward(q, k, v, layer, fb), **tol(torch.float32))


def test_cuda_graph_metadata_path_matches_eager() -> None:
    """capture/replay metadata (without a real graph on the CPU): static buffers, padded rows, new seq_lens."""
    h, hkv, d = 8, 2, 32
    gen = torch.Generator().manual_seed(5)
    runner = make_runner(h, hkv, d, torch.float32)
    backend = TritonAttnBackend(runner)
    backend.min_split_len, backend.decode_block_n, backend.decode_one_launch = 16, 16, True
    layer = make_layer(h, hkv, d)
    seq_lens = [1, 40, 77]
    fb, q, k, v = make_batch(runner, backend, [s - 1 for s in seq_lens], [1] * 3, ForwardMode.DECODE, gen)
    backend.init_forward_metadata(fb)
    eager = backend.forward(q, k, v, layer, fb)

    graph_bs = 4  # one padded row
    backend.init_cuda_graph_state(max_bs=8)
    pad = torch.zeros(1, dtype=torch.int64, device=DEVICE)
    fill = torch.full((1,), backend.get_cuda_graph_seq_len_fill_value(), dtype=torch.int64, device=DEVICE)
    rpi = torch.cat([fb.req_pool_indices, pad])
    sl = torch.cat([fb.seq_lens, fill])
    backend.init_forward_metadata_capture_cuda_graph(graph_bs, rpi, sl)
    meta = backend.forward_metadata
    assert meta is not None and meta.num_kv_splits > 1
    assert meta.counters is not None and meta.counters.shape == (8, h)  # the graphs' own, for any captured bs
    qp = torch.cat([q, torch.zeros(1, q.shape[1], device=DEVICE)])
    out = backend.forward_decode(qp, k, v, layer, fb, save_kv_cache=False)
    torch.testing.assert_close(out[:3], eager, rtol=1e-5, atol=1e-5)
    assert not meta.counters.any()  # left zero for the next replay

    # the next step: one more token per request, passed without padding (the backend pads)
    fb2, q2, k2, v2 = make_batch(runner, backend, [5, 60, 100], [1] * 3, ForwardMode.DECODE, gen)
    backend.init_forward_metadata(fb2)
    eager2 = backend.forward(q2, k2, v2, layer, fb2)
    backend.init_forward_metadata_capture_cuda_graph(graph_bs, rpi, sl)  # the graph was "captured" on these
    backend.init_forward_metadata_replay_cuda_graph(graph_bs, fb2.req_pool_indices, fb2.seq_lens,
                                                    int(fb2.seq_lens.sum()))
    q2p = torch.cat([q2, torch.zeros(1, q2.shape[1], device=DEVICE)])
    out2 = backend.forward_decode(q2p, k2, v2, layer, fb2, save_kv_cache=False)
    torch.testing.assert_close(out2[:3], eager2, rtol=1e-5, atol=1e-5)
    assert torch.isfinite(out2).all()  # the padded row reads slot req_to_token[0, 0] and stays finite


# ---------------------------------------------------------------- interface
def test_backend_merges_in_one_launch_where_it_paid() -> None:
    """By default the backend passes counters (one launch) for GQA groups of 2-8 with at least 32 splits a request,
    in eager and CUDA-graph decodes alike; not for plain multi-head attention, fewer splits, or when switched off."""
    assert decode_attention.one_launch_pays(4, 64) and decode_attention.one_launch_pays(8, 32)
    assert not decode_attention.one_launch_pays(1, 64) and not decode_attention.one_launch_pays(16, 64)
    assert not decode_attention.one_launch_pays(4, 17)
    gen = torch.Generator().manual_seed(2)
    for (h, hkv), num_sms, switch, expected in (((8, 2), 132, None, True), ((8, 2), 8, None, False),
                                                 ((4, 4), 132, None, False), ((8, 2), 132, False, False),
                                                 ((4, 4), 8, True, True)):
        runner = make_runner(h, hkv, 32, torch.float32)
        backend = TritonAttnBackend(runner)
        backend.num_sms = num_sms  # 132: 64 splits a request at batch 2; 8: 4-8 splits
        if switch is not None:
            backend.decode_one_launch = switch
        fb, _, _, _ = make_batch(runner, backend, [30, 50], [1, 1], ForwardMode.DECODE, gen)
        backend.init_forward_metadata(fb)
        assert (backend.forward_metadata.counters is not None) == expected
        backend.init_cuda_graph_state(max_bs=4)
        backend.init_forward_metadata_capture_cuda_graph(2, fb.req_pool_indices, fb.seq_lens)
        assert (backend.forward_metadata.counters is not None) == expected


def test_registry_builds_the_backend() -> None:
    runner = make_runner(4, 2, 32, torch.float32)
    assert isinstance(create_attention_backend("triton", runner), TritonAttnBackend)


def test_bad_input_raises_value_error() -> None:
    runner = make_runner(4, 2, 32, torch.float32)
    with pytest.raises(ValueError, match="positive"):
        TritonAttnBackend(runner, max_kv_splits=0)
    q = torch.zeros(2, 4, 32, device=DEVICE)
    kb = torch.zeros(10, 3, 32, device=DEVICE)  # 4 heads over 3 KV heads
    mid_o, mid_lse = torch.zeros(2, 4, 8, 32, device=DEVICE), torch.zeros(2, 4, 8, device=DEVICE)
    idx = torch.zeros(2, dtype=torch.int64, device=DEVICE)
    with pytest.raises(ValueError, match="multiple"):
        decode_attention.decode_attention_fwd(q, kb, kb, q.clone(), runner.req_to_token_pool.req_to_token, idx,
                                              idx + 1, mid_o, mid_lse, 1.0)
    with pytest.raises(ValueError, match="S >= 9 splits"):  # more splits than the partial buffers hold
        decode_attention.decode_attention_fwd(q, kb[:, :2], kb[:, :2], q.clone(),
                                              runner.req_to_token_pool.req_to_token, idx, idx + 1, mid_o, mid_lse,
                                              1.0, num_kv_splits=9)
    with pytest.raises(ValueError, match="elementwise"):
        decode_attention.decode_attention_fwd(q, kb[:, :2], kb[:, :2], q.clone(),
                                              runner.req_to_token_pool.req_to_token, idx, idx + 1, mid_o, mid_lse,
                                              1.0, use_dot=False)
    good = decode_attention.new_decode_counters(2, 4, DEVICE)
    for bad in (good.long(), good[:1], good[:, :3], decode_attention.new_decode_counters(4, 2, DEVICE).t(),
                good.view(-1)):
        with pytest.raises(ValueError, match="counters"):
            decode_attention.decode_attention_fwd(q, kb[:, :2], kb[:, :2], q.clone(),
                                                  runner.req_to_token_pool.req_to_token, idx, idx + 1, mid_o,
                                                  mid_lse, 1.0, counters=bad)
    with pytest.raises(ValueError, match="match"):
        extend_attention.extend_attention_fwd(q, kb[:2], kb[:3], q.clone(), kb, kb,
                                              runner.req_to_token_pool.req_to_token, idx, idx, idx, idx, 1, 1.0)
    backend = TritonAttnBackend(runner)
    with pytest.raises(RuntimeError, match="init_cuda_graph_state"):
        backend.init_forward_metadata_replay_cuda_graph(1, idx, idx, 0)


def scattered_table(seq_lens: list[int], gen: torch.Generator, offset: int = 0) -> torch.Tensor:
    """req_to_token rows (int32) for requests of these lengths, their slots a random permutation of offset ..
    offset + sum(seq_lens) - 1: each request's KV scattered over the pool."""
    perm = (offset + torch.randperm(sum(seq_lens), generator=gen)).to(torch.int32)
    r2t = torch.zeros(len(seq_lens), max(seq_lens + [1]), dtype=torch.int32)
    start = 0
    for i, n in enumerate(seq_lens):
        r2t[i, :n] = perm[start:start + n]
        start += n
    return r2t


def run_decode(q: torch.Tensor, k_buf: torch.Tensor, v_buf: torch.Tensor, r2t: torch.Tensor, seq_lens: list[int],
               splits: int, block_n: int, **kwargs: object) -> torch.Tensor:
    """`decode_attention_fwd` over requests 0..n-1 of r2t (the output starts as NaN, so a row it does not write
    fails the comparison), with its own scratch; the output back on the CPU."""
    bs, h, d = q.shape
    shape_o, shape_lse = decode_attention.decode_partial_shapes(bs, h, d, splits)
    o = torch.full((bs, h, d), float("nan"), device=DEVICE, dtype=q.dtype)
    decode_attention.decode_attention_fwd(
        q.to(DEVICE), k_buf.to(DEVICE), v_buf.to(DEVICE), o, r2t.to(DEVICE), torch.arange(bs, device=DEVICE),
        torch.tensor(seq_lens, device=DEVICE), torch.empty(shape_o, device=DEVICE),
        torch.empty(shape_lse, device=DEVICE), d ** -0.5, min_split_len=block_n, block_n=block_n,
        num_kv_splits=splits, **kwargs)
    return o.cpu()


def dense_decode(q: torch.Tensor, keys: torch.Tensor, vals: torch.Tensor) -> torch.Tensor:
    """One request's attention in float32: q [h, d] over keys / values [n, kv heads, d] (GQA by repetition)."""
    h, d = q.shape
    keys, vals = (t.float().repeat_interleave(h // t.shape[1], dim=1) for t in (keys, vals))
    w = torch.softmax(torch.einsum("hd,nhd->hn", q.float(), keys) * d ** -0.5, dim=-1)
    return torch.einsum("hn,nhd->hd", w, vals)


@pytest.mark.parametrize("kv_dtype,q_dtype", [(torch.float32, torch.float32), (torch.float8_e4m3fn, torch.float32),
                                             (torch.float8_e4m3fn, torch.bfloat16)],
                         ids=["fp32", "fp8_e4m3", "fp8_e4m3-bf16q"])
def test_decode_grid_orders_and_one_split_match_reference(kv_dtype: torch.dtype, q_dtype: torch.dtype) -> None:
    """Stage 1 with the requests or the heads as its grid's first axis, over four splits or one (stage 1 then
    writes the output itself), gives the same attention as a dense reference, with GQA 4 and a scaled fp8 pool (a
    bfloat16 query takes fp16 products on a GPU); an empty request's output is zeros either way."""
    h, hkv, d, seq_lens = 8, 2, 32, [1, 17, 70, 129, 0]
    k_scale, v_scale = (0.5, 2.0) if kv_dtype != torch.float32 else (1.0, 1.0)
    gen = torch.Generator().manual_seed(11)
    total = sum(seq_lens)
    k_true = torch.randn(total, hkv, d, generator=gen)
    v_true = torch.randn(total, hkv, d, generator=gen)
    k_buf = (k_true / k_scale).to(kv_dtype).to(DEVICE)
    v_buf = (v_true / v_scale).to(kv_dtype).to(DEVICE)
    r2t = scattered_table(seq_lens, gen)  # the last request is empty
    q = torch.randn(len(seq_lens), h, d, generator=gen).to(q_dtype)
    outs = [run_decode(q, k_buf, v_buf, r2t, seq_lens, splits, 16, k_scale=k_scale, v_scale=v_scale,
                       heads_first=heads_first).float()
            for heads_first, splits in ((False, 4), (True, 4), (True, 1), (False, 1))]  # one split: no stage 2
    kd = k_buf.cpu().float() * k_scale
    vd = v_buf.cpu().float() * v_scale
    for i, n in enumerate(seq_lens[:-1]):
        slots = r2t[i, :n].long()
        ref = dense_decode(q[i], kd[slots], vd[slots])
        tol = {"rtol": 2e-4, "atol": 2e-4} if q_dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
        for out in outs:
            torch.testing.assert_close(out[i], ref, **tol)
    for out in outs:
        assert torch.equal(out[-1], torch.zeros(h, d))  # the empty request's output is zeros


def test_decode_one_split_under_a_sliding_window() -> None:
    """With one split a request (stage 1 writing the output) a sliding window still attends over the last W
    positions only, as with several splits."""
    h, hkv, d, seq_lens, window = 4, 2, 32, [5, 20, 47, 90], 24
    gen = torch.Generator().manual_seed(5)
    total = sum(seq_lens)
    k_buf = torch.randn(total, hkv, d, generator=gen)
    v_buf = torch.randn(total, hkv, d, generator=gen)
    r2t = scattered_table(seq_lens, gen)
    q = torch.randn(len(seq_lens), h, d, generator=gen)
    for splits in (1, 4):
        o = run_decode(q, k_buf, v_buf, r2t, seq_lens, splits, 16, sliding_window=window)
        for i, n in enumerate(seq_lens):
            slots = r2t[i, max(0, n - window):n].long()
            torch.testing.assert_close(o[i], dense_decode(q[i], k_buf[slots], v_buf[slots]), rtol=2e-4, atol=2e-4)


@pytest.mark.parametrize("kv_dtype", [torch.float8_e4m3fn, torch.float8_e5m2], ids=["e4m3", "e5m2"])
@pytest.mark.parametrize("splits", [1, 3])
@pytest.mark.parametrize("q_dtype", [torch.float32, torch.bfloat16], ids=["fp32q", "bf16q"])
@pytest.mark.parametrize("v_pairs", [True, False], ids=["v_pairs", "v_bytes"])
def test_decode_fp8_pool_matches_reference(kv_dtype: torch.dtype, splits: int, q_dtype: torch.dtype,
                                           v_pairs: bool) -> None:
    """Over an fp8 pool, V read as 32-bit words and widened in (even, odd) token pairs (the default), and V's tile
    widened whole (`fp8_v_pairs=False`), each give the attention of the dense reference, with odd lengths (an even
    token without its odd partner), GQA 4, one split or several, scales. On a GPU a bfloat16 query takes the fp16
    products and the PTX widening; the interpreter and float32 queries widen byte by byte."""
    h, hkv, d, seq_lens, k_scale, v_scale = 8, 2, 64, [1, 2, 33, 70, 95], 0.5, 2.0
    gen = torch.Generator().manual_seed(21)
    total = sum(seq_lens)
    k_buf = (torch.randn(total, hkv, d, generator=gen) / k_scale).to(kv_dtype).to(DEVICE)
    v_buf = (torch.randn(total, hkv, d, generator=gen) / v_scale).to(kv_dtype).to(DEVICE)
    assert decode_attention.v_pairs_fit(v_buf, 32)
    r2t = scattered_table(seq_lens, gen)
    q = torch.randn(len(seq_lens), h, d, generator=gen).to(q_dtype)
    o = run_decode(q, k_buf, v_buf, r2t, seq_lens, splits, 32, k_scale=k_scale, v_scale=v_scale,
                   fp8_v_pairs=v_pairs)
    kd, vd = k_buf.cpu().float() * k_scale, v_buf.cpu().float() * v_scale
    for i, n in enumerate(seq_lens):
        slots = r2t[i, :n].long()
        tol = 2e-4 if q_dtype == torch.float32 else 2e-2
        torch.testing.assert_close(o[i].float(), dense_decode(q[i], kd[slots], vd[slots]), rtol=tol, atol=tol)


# ---------------------------------------------------------------- one launch (the last program merges)
def one_launch_case(seq_lens: list[int], window: int, kv_dtype: torch.dtype, q_dtype: torch.dtype, h: int,
                    hkv: int, d: int, splits: int, block_n: int, **kwargs: object) -> None:
    """Two calls in a row with the same counters, each with its own query and the other grid order: one launch (no
    stage 2), the dense reference's attention (zeros for an empty request), the counters all zero after each."""
    k_scale, v_scale = (0.5, 2.0) if kv_dtype != torch.float32 else (1.0, 1.0)
    gen = torch.Generator().manual_seed(splits * 10 + h)
    total = sum(seq_lens)
    k_buf = (torch.randn(total, hkv, d, generator=gen) / k_scale).to(kv_dtype)
    v_buf = (torch.randn(total, hkv, d, generator=gen) / v_scale).to(kv_dtype)
    kd, vd = k_buf.float() * k_scale, v_buf.float() * v_scale
    r2t = scattered_table(seq_lens, gen)
    counters = decode_attention.new_decode_counters(len(seq_lens) + 3, h, DEVICE)  # more rows than the batch
    launched: list[object] = []

    def counting_launch(fn: object, *args: object, **kw: object) -> None:
        launched.append(fn)
        real_launch(fn, *args, **kw)

    real_launch = decode_attention.launch
    decode_attention.launch = counting_launch
    try:
        for heads_first in (False, True):
            q = torch.randn(len(seq_lens), h, d, generator=gen).to(q_dtype)
            launched.clear()
            o = run_decode(q, k_buf, v_buf, r2t, seq_lens, splits, block_n, k_scale=k_scale, v_scale=v_scale,
                           sliding_window=window, heads_first=heads_first, counters=counters, **kwargs)
            assert launched == [decode_attention._decode_stage1_kernel]
            assert not counters.any()
            tol = 2e-4 if q_dtype == torch.float32 else 2e-2
            for i, n in enumerate(seq_lens):
                slots = r2t[i, max(0, n - window) if window > 0 else 0:n].long()
                ref = dense_decode(q[i], kd[slots], vd[slots]) if n else torch.zeros(h, d)
                torch.testing.assert_close(o[i].float(), ref, rtol=tol, atol=tol)
    finally:
        decode_attention.launch = real_launch


@pytest.mark.parametrize("splits", [2, 3, 4])
@pytest.mark.parametrize("h,hkv", [(2, 2), (8, 2)], ids=["group1", "group4"])
def test_decode_one_launch_matches_reference(splits: int, h: int, hkv: int) -> None:
    """Requests of 0 tokens, fewer than min_split_len (one split, written directly), and of 2, 3 and more splits:
    the last program of each request's head block merges its non-empty splits."""
    one_launch_case([0, 5, 17, 40, 70, 129], -1, torch.float32, torch.float32, h, hkv, 32, splits, 16)


def test_decode_one_launch_under_a_sliding_window() -> None:
    """Under a window the splits cover the last W positions (decode_splits' boundaries, not the full-attention
    ones): the merging program counts and reads the same splits stage 1 wrote."""
    one_launch_case([0, 5, 20, 47, 90, 131], 40, torch.float32, torch.float32, 8, 2, 32, 3, 16)


@pytest.mark.parametrize("v_pairs", [True, False], ids=["v_pairs", "v_bytes"])
def test_decode_one_launch_over_an_fp8_pool(v_pairs: bool) -> None:
    """A scaled fp8 pool (v's scale folded into each partial), V read as token pairs or widened whole."""
    one_launch_case([0, 2, 33, 70, 95], -1, torch.float8_e4m3fn, torch.float32, 8, 2, 64, 3, 32,
                    fp8_v_pairs=v_pairs)


def test_decode_one_launch_one_split_a_merge_step() -> None:
    """32 query heads of 128 dims on one KV head fill the merge's tile with one split, so it takes the 2-D path."""
    from radixserve.layers.attention.triton_ops.common import merge_split_block

    assert merge_split_block(32, 128) == 1
    one_launch_case([0, 40, 70], -1, torch.float32, torch.float32, 32, 1, 128, 3, 16)
