"""FP8 KV cache: the pool's store/load round trip with per-tensor scales, the Triton store kernels (plain and fused
with rotary), and the Triton extend/decode kernels reading an fp8 pool, against torch references. On the CPU the
kernels run under TRITON_INTERPRET=1 (conftest)."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F
from test_quant_fp8 import assert_fp8_equal_but_interpreter_carry

from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend
from radixserve.layers.attention.triton_backend import TritonAttnBackend
from radixserve.layers.quantization.kv_cache import kv_scale_name, set_kv_scale
from radixserve.layers.triton_ops.kv_store import store_kv
from radixserve.layers.triton_ops.rotary import KVWrite, apply_rotary_inplace
from radixserve.mem_cache.memory_pool import (
    ReqToTokenPool,
    TokenToKVPool,
    gather_kv,
    load_kv_values,
    store_kv_values,
)
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode

DEV = "cuda" if torch.cuda.is_available() else "cpu"
FP8S = [torch.float8_e4m3fn, torch.float8_e5m2]
REL = {torch.float8_e4m3fn: 2.0 ** -4, torch.float8_e5m2: 2.0 ** -3}  # half an fp8 step, relative


@pytest.mark.parametrize("dtype", FP8S)
def test_pool_round_trip_with_scales(dtype: torch.dtype) -> None:
    pool = TokenToKVPool(64, dtype, 2, 16, num_layers=2, device=DEV)
    bf16 = TokenToKVPool(64, torch.bfloat16, 2, 16, num_layers=2, device=DEV)
    assert pool.bytes_per_token() * 2 == bf16.bytes_per_token()  # twice the tokens in the same memory
    g = torch.Generator().manual_seed(0)
    k = (torch.randn(5, 2, 16, generator=g) * 3).to(DEV)
    v = torch.randn(5, 2, 16, generator=g).to(DEV)
    k[0, 0, 0] = 1e6  # far outside the range even after scaling: saturates, never inf/NaN
    loc = torch.tensor([3, 9, 1, 60, 64], device=DEV)
    pool.set_kv_buffer(1, loc, k, v, k_scale=0.5, v_scale=2.0)
    kb, vb = pool.get_kv_buffer(1)
    kk = load_kv_values(gather_kv(kb, loc), torch.float32, 0.5)
    vv = load_kv_values(gather_kv(vb, loc), torch.float32, 2.0)
    assert bool(torch.isfinite(kk).all())
    assert float(kk[0, 0, 0]) == torch.finfo(dtype).max * 0.5
    rest = torch.ones_like(k, dtype=torch.bool)
    rest[0, 0, 0] = False
    assert bool(((kk - k).abs()[rest] <= k.abs()[rest] * REL[dtype] + 1e-2).all())  # + subnormal steps
    assert bool(((vv - v).abs() <= v.abs() * REL[dtype] + 1e-2).all())
    assert float(gather_kv(kb, torch.tensor([2], device=DEV)).float().abs().sum()) == 0  # untouched slots


@pytest.mark.parametrize("dtype", FP8S)
def test_store_kernels_write_scaled_fp8(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(1)
    t, hk, d = 6, 2, 16
    k = (torch.randn(t, hk * d, generator=g) * 4).to(DEV)
    v = (torch.randn(t, hk * d, generator=g) * 4).to(DEV)
    loc = torch.tensor([5, 2, 7, 1, 3, 8], device=DEV)
    kb = torch.zeros(10, hk, d, dtype=dtype, device=DEV)
    vb = torch.zeros_like(kb)
    store_kv(kb, vb, loc, k, v, 0.25, 3.0)
    assert_fp8_equal_but_interpreter_carry(kb[loc], store_kv_values(k.view(t, hk, d), dtype, 0.25))
    assert_fp8_equal_but_interpreter_carry(vb[loc], store_kv_values(v.view(t, hk, d), dtype, 3.0))
    # fused with rotary: the rotated k is what gets stored
    q = torch.randn(t, 4 * d, generator=g).to(DEV)
    pos = torch.arange(t, device=DEV)
    inv = 1.0 / (10000 ** (torch.arange(0, d, 2).float() / d))
    freqs = torch.outer(torch.arange(32).float(), inv)
    cos, sin = freqs.cos().to(DEV), freqs.sin().to(DEV)
    kb2, vb2 = torch.zeros_like(kb), torch.zeros_like(vb)
    k2 = k.clone()
    apply_rotary_inplace(pos, q, k2, cos, sin, d, KVWrite(kb2, vb2, loc, v, 0.25, 3.0))
    assert_fp8_equal_but_interpreter_carry(kb2[loc], store_kv_values(k2.view(t, hk, d), dtype, 0.25))
    assert_fp8_equal_but_interpreter_carry(vb2[loc], store_kv_values(v.view(t, hk, d), dtype, 3.0))


def _setup(dtype: torch.dtype, prefix_lens: list[int], extend_lens: list[int], mode: ForwardMode, seed: int = 0):
    h, hkv, d = 8, 2, 32
    g = torch.Generator().manual_seed(seed)
    cfg = SimpleNamespace(num_attention_heads=h, num_key_value_heads=hkv, head_dim=d)
    pool = TokenToKVPool(512, dtype, hkv, d, num_layers=1, device=DEV)
    r2t = ReqToTokenPool(8, 256, DEV)
    runner = SimpleNamespace(device=DEV, model_config=cfg, tp_size=1, dtype=torch.float32, req_to_token_pool=r2t,
                             token_to_kv_pool=pool)
    layer = SimpleNamespace(tp_q_head_num=h, tp_k_head_num=hkv, tp_v_head_num=hkv, head_dim=d, scaling=d ** -0.5,
                            layer_id=0, k_scale=0.7, v_scale=1.6)
    totals = [p + e for p, e in zip(prefix_lens, extend_lens, strict=True)]
    rows = r2t.alloc(len(totals))
    slots = pool.alloc(sum(totals))
    slots = slots[torch.randperm(len(slots), generator=g)]
    out_locs, start = [], 0
    for row, pre, total in zip(rows, prefix_lens, totals, strict=True):
        mine = slots[start:start + total]
        start += total
        r2t.write(row, 0, mine)
        if pre:
            pool.set_kv_buffer(0, mine[:pre].to(DEV), (torch.randn(pre, hkv, d, generator=g) * 2).to(DEV),
                               torch.randn(pre, hkv, d, generator=g).to(DEV), layer.k_scale, layer.v_scale)
        out_locs.append(mine[pre:])
    r2t.apply_writes(r2t.take_pending_writes())
    n = sum(extend_lens)
    q = torch.randn(n, h * d, generator=g).to(DEV)
    k = (torch.randn(n, hkv * d, generator=g) * 2).to(DEV)
    v = torch.randn(n, hkv * d, generator=g).to(DEV)

    def dev(x: list[int]) -> torch.Tensor:
        return torch.tensor(x, dtype=torch.int64, device=DEV)

    fb = ForwardBatch(forward_mode=mode, batch_size=len(totals), input_ids=torch.zeros(n, dtype=torch.int64,
                                                                                        device=DEV),
                      req_pool_indices=dev(rows), seq_lens=dev(totals), out_cache_loc=torch.cat(out_locs).to(DEV),
                      seq_lens_sum=sum(totals), positions=None, req_to_token_pool=r2t, token_to_kv_pool=pool,
                      attn_backend=None, seq_lens_cpu=list(totals))  # type: ignore[arg-type]
    if mode.is_extend():
        fb.extend_seq_lens, fb.extend_prefix_lens = dev(extend_lens), dev(prefix_lens)
        fb.extend_start_loc = dev([sum(extend_lens[:i]) for i in range(len(extend_lens))])
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(extend_lens), list(prefix_lens)
    return runner, layer, fb, q, k, v


@pytest.mark.parametrize("dtype", FP8S)
def test_triton_decode_reads_fp8_pool_like_torch_native(dtype: torch.dtype) -> None:
    runner, layer, fb, q, k, v = _setup(dtype, [0, 37, 90, 5], [1, 1, 1, 1], ForwardMode.DECODE)
    # the new tokens' K/V go in through the pool's own (torch) store, so both backends read the same bytes
    runner.token_to_kv_pool.set_kv_buffer(0, fb.out_cache_loc, k.view(4, 2, 32), v.view(4, 2, 32), layer.k_scale,
                                          layer.v_scale)
    tri = TritonAttnBackend(runner)
    tri.min_split_len = 16  # several splits
    tri.init_forward_metadata(fb)
    out = tri.forward(q, k, v, layer, fb, save_kv_cache=False)
    ref_backend = TorchNativeAttnBackend(runner)
    ref_backend.init_forward_metadata(fb)
    ref = ref_backend.forward(q, k, v, layer, fb, save_kv_cache=False)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)
    # and the scales matter: read with scale 1 the answer is different
    layer.k_scale = layer.v_scale = 1.0
    assert not torch.allclose(tri.forward(q, k, v, layer, fb, save_kv_cache=False), ref, atol=1e-2)


@pytest.mark.parametrize("dtype", FP8S)
def test_triton_extend_reads_fp8_prefix(dtype: torch.dtype) -> None:
    """Extend attends to the fp8 prefix (dequantised with the layer's scales) and to the new tokens' own K/V at
    full precision, as the kernel reads them from its inputs."""
    prefix, ext = [0, 40, 7], [5, 20, 33]
    runner, layer, fb, q, k, v = _setup(dtype, prefix, ext, ForwardMode.EXTEND)
    tri = TritonAttnBackend(runner)
    tri.init_forward_metadata(fb)
    out = tri.forward(q, k, v, layer, fb)
    pool = runner.token_to_kv_pool
    kb, vb = pool.get_kv_buffer(0)
    assert_fp8_equal_but_interpreter_carry(kb[fb.out_cache_loc],
                                           store_kv_values(k.view(-1, 2, 32), dtype, layer.k_scale))
    r2t = runner.req_to_token_pool.req_to_token
    start = 0
    for i, (pre, n) in enumerate(zip(prefix, ext, strict=True)):
        slots = r2t[int(fb.req_pool_indices[i]), :pre].long()
        kk = torch.cat([load_kv_values(gather_kv(kb, slots), torch.float32, layer.k_scale),
                        k[start:start + n].view(n, 2, 32)])
        vv = torch.cat([load_kv_values(gather_kv(vb, slots), torch.float32, layer.v_scale),
                        v[start:start + n].view(n, 2, 32)])
        qi = q[start:start + n].view(n, 8, 32).transpose(0, 1)
        kk = kk.transpose(0, 1).repeat_interleave(4, dim=0)
        vv = vv.transpose(0, 1).repeat_interleave(4, dim=0)
        mask = torch.ones(n, pre + n, dtype=torch.bool, device=DEV).tril(diagonal=pre)
        ref = F.scaled_dot_product_attention(qi, kk, vv, attn_mask=mask, scale=layer.scaling).transpose(0, 1)
        torch.testing.assert_close(out[start:start + n].view(n, 8, 32), ref, rtol=1e-4, atol=1e-4)
        start += n


def test_checkpoint_kv_scale_names() -> None:
    assert kv_scale_name("model.layers.3.self_attn.k_scale") == (3, "k")
    assert kv_scale_name("model.layers.0.self_attn.attn.v_scale") == (0, "v")
    assert kv_scale_name("model.layers.12.self_attn.k_proj.output_scale") == (12, "k")
    assert kv_scale_name("model.layers.1.self_attn.k_proj.weight_scale") is None
    attn = SimpleNamespace(k_scale=1.0)
    set_kv_scale(attn, "k", torch.tensor([0.25]))
    assert attn.k_scale == 0.25
    with pytest.raises(ValueError, match="positive"):
        set_kv_scale(attn, "k", torch.tensor(0.0))


def test_fp8_kv_model_runs_and_stays_close(tmp_path) -> None:
    """A tiny model with an fp8_e4m3 KV cache (torch_native on the CPU) decodes the same greedy tokens as with a
    float32 cache on a model whose next token is decided by a margin; the server flag is validated."""
    from model_utils import make_runner, peaky_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.server_args import ServerArgs

    peaky_tiny_model("llama", str(tmp_path))
    prompts = [[5, 17, 99, 3, 42, 7, 100, 8, 9, 10], [1, 2, 3, 4]]
    base = StaticBatch(make_runner(str(tmp_path))).generate(prompts, 8)
    runner = make_runner(str(tmp_path), kv_cache_dtype="fp8_e4m3")
    assert runner.token_to_kv_pool.dtype == torch.float8_e4m3fn
    fp8 = StaticBatch(runner).generate(prompts, 8)
    agree = sum(a == b for x, y in zip(base, fp8, strict=True) for a, b in zip(x, y, strict=True))
    assert agree >= 14, (base, fp8)
    with pytest.raises(ValueError, match="kv-cache-dtype"):
        ServerArgs(kv_cache_dtype="fp8", device="cpu")


def test_calculated_kv_scales(tmp_path, monkeypatch: pytest.MonkeyPatch) -> None:
    """`--calculate-kv-scales`: one calibration prefill at startup sets every layer's k/v scale to 2 x the largest
    |k| / |v| it saw over the fp8 maximum (checked against hooks on a float32-cache runner over the same tokens),
    leaves a layer whose checkpoint has scales alone, frees what it allocated, and needs an fp8 cache."""
    from model_utils import make_runner, peaky_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import kv_calibration as kc
    from radixserve.layers.radix_attention import RadixAttention
    from radixserve.server_args import ServerArgs

    text = kc.calibration_text()
    assert text.startswith("The Zen of Python") and "Beautiful is better than ugly." in text and len(text) > 500
    peaky_tiny_model("llama", str(tmp_path))

    class CharTokenizer:
        def encode(self, s: str) -> list[int]:
            return [(ord(c) * 7) % 2048 for c in s[:300]]

    monkeypatch.setattr("radixserve.managers.tokenizer_utils.get_tokenizer", lambda *a, **k: CharTokenizer())
    ids = CharTokenizer().encode(text)
    ref = make_runner(str(tmp_path))  # float32 cache: record what each layer's attention receives
    amax: dict[int, tuple[float, float]] = {}
    for m in ref.model.modules():
        if isinstance(m, RadixAttention):
            m.register_forward_pre_hook(lambda mod, a: amax.__setitem__(
                mod.layer_id, (float(a[1].abs().max()), float(a[2].abs().max()))))
    batch, _ = StaticBatch(ref).prefill([ids])

    runner = make_runner(str(tmp_path), kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True)
    attns = [m for m in runner.model.modules() if isinstance(m, RadixAttention)]
    assert len(attns) == len(amax) == 4
    for a in attns:
        k_ref, v_ref = (2.0 * x / 448.0 for x in amax[a.layer_id])
        assert a.k_scale == pytest.approx(k_ref, rel=0.1) and a.v_scale == pytest.approx(v_ref, rel=0.1)
    assert runner.token_to_kv_pool.available_size() == runner.max_total_num_tokens  # the calibration freed its KV
    assert runner.req_to_token_pool.available_size() == runner.req_to_token_pool.size

    attns[0].kv_scales_from_checkpoint = True  # as `set_kv_scale` marks a layer; later calibrations skip it
    attns[0].k_scale = attns[0].v_scale = 0.5
    set_by = kc.calculate_kv_scales(runner, ids[:50])
    assert attns[0].k_scale == 0.5 and attns[0].layer_id not in set_by and len(set_by) == 3

    prompts = [[5, 17, 99, 3, 42, 7, 100, 8, 9, 10]]
    assert len(StaticBatch(runner).generate(prompts, 4)[0]) == 4
    with pytest.raises(ValueError, match="calculate-kv-scales"):
        ServerArgs(calculate_kv_scales=True, device="cpu")
    # a context or pool smaller than the text: its start, within both; too small for any: a clear ValueError
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner

    kw = dict(model_path=str(tmp_path), device="cpu", dtype="float32", kv_cache_dtype="fp8_e4m3",
              calculate_kv_scales=True)
    small = ModelRunner(ModelConfig(str(tmp_path), context_length=64), ServerArgs(**kw, context_length=64))
    assert small.token_to_kv_pool.available_size() == small.max_total_num_tokens
    make_runner(str(tmp_path), kv_cache_dtype="fp8_e4m3", calculate_kv_scales=True, max_total_tokens=100)
    with pytest.raises(ValueError, match="calculate-kv-scales needs room"):
        ModelRunner(ModelConfig(str(tmp_path), context_length=16), ServerArgs(**kw, context_length=16))
