"""x's quantisation for the Q4_K one-row GEMV (dp4c) fused into the launch before the product (`gguf_prologue`):
the residual add + RMSNorm before q/k/v and gate/up, SiLU·mul before down. Under TRITON_INTERPRET=1 on the CPU:
the fused quantisers give the unfused kernels' words and factors exactly, the layers' hooks the unfused products,
and a Q4_K model decoding with them the tokens it decodes without them."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.quantization import gguf_formats as G
from radixserve.layers.quantization.gemv_configs import GemvConfig
from radixserve.layers.quantization.gguf_chunk_kernels import q8_1_blocks
from radixserve.layers.quantization.gguf_prologue import q8_1_blocks_gated, q8_1_blocks_normed
from radixserve.layers.triton_ops import set_fused_kernels
from radixserve.layers.triton_ops.activation import silu_and_mul
from radixserve.layers.triton_ops.norm import fused_add_rmsnorm, rmsnorm

DP4C = GemvConfig("dp4c", 128, 2048, 1)  # many rows a program (64 a half-head run): few programs


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("with_residual", [True, False])
def test_normed_quantisation_equals_the_norm_then_q8_1_blocks(dtype: torch.dtype, with_residual: bool) -> None:
    g = torch.Generator().manual_seed(1)
    m, k = 3, 1536  # 48 blocks: three programs, the last one full
    x = (torch.randn(m, k, generator=g) * 3).to(dtype)
    x[1, :32] *= 1e-4  # a block of tiny values
    res = torch.randn(m, k, generator=g).to(dtype) if with_residual else None
    w = (1 + 0.2 * torch.randn(k, generator=g)).to(dtype)
    words, f, new_res = q8_1_blocks_normed(x, res, w, 1e-5)
    if with_residual:
        normed, ref_res = fused_add_rmsnorm(x, res, w, 1e-5)
        assert torch.equal(new_res, ref_res)
    else:
        normed = rmsnorm(x, w, 1e-5)
        assert new_res is None
    ref_words, ref_f = q8_1_blocks(normed)
    assert torch.equal(words, ref_words)
    assert torch.equal(f, ref_f)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_gated_quantisation_equals_silu_mul_then_q8_1_blocks(dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(2, 2 * 1088, generator=g) * 4).to(dtype)  # 34 blocks: the last program's tile part empty
    words, f = q8_1_blocks_gated(x)
    ref_words, ref_f = q8_1_blocks(silu_and_mul(x))
    assert torch.equal(words, ref_words)
    assert torch.equal(f, ref_f)


def test_prologue_quantisers_reject_what_they_cannot_take() -> None:
    with pytest.raises(ValueError, match="multiple of 64"):
        q8_1_blocks_gated(torch.randn(1, 2 * 96))
    with pytest.raises(ValueError, match="even width"):
        q8_1_blocks_gated(torch.randn(1, 129))
    with pytest.raises(ValueError, match="norm weight"):
        q8_1_blocks_normed(torch.randn(1, 128), None, torch.ones(64), 1e-6)
    with pytest.raises(ValueError, match="residual"):
        q8_1_blocks_normed(torch.randn(1, 128), torch.randn(2, 128), torch.ones(128), 1e-6)


def _dp4c_everywhere(monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.layers.quantization import gemv_configs

    real = gemv_configs.get
    def get(fam: str, m: int, n: int, k: int, cuda: bool = True) -> GemvConfig:
        if fam == "q4_k":  # a short prompt's rows too through a few large programs
            return DP4C if m == 1 else GemvConfig("ew", 256, 2048)
        return real(fam, m, n, k, cuda)

    monkeypatch.setattr(gemv_configs, "get", get)


def _q4_k_layer(cls: type, k: int, n: int, seed: int):
    from radixserve.layers.quantization.gguf import GGUFLinearMethod

    torch.manual_seed(seed)
    layer = cls(k, n, bias=True)
    layer.set_quant_method(GGUFLinearMethod(G.Q4_K, online=True))
    with torch.no_grad():
        layer.weight.copy_(torch.randn(n, k) * 0.05)
        layer.bias.copy_(torch.randn(n))
    layer.quant_method.process_weights_after_loading(layer)
    return layer


def test_linear_hooks_equal_the_unfused_products(monkeypatch: pytest.MonkeyPatch) -> None:
    """`normed_product` (a column-parallel Q4_K layer after RMSNorm, with and without a residual) and
    `gated_product` (a row-parallel one after SiLU·mul) equal the norm / activation followed by the layer; where
    dp4c does not serve the product (two rows, K without a 2,048-column step, Q8_0) they return None."""
    from radixserve.layers.layernorm import RMSNorm
    from radixserve.layers.linear import ColumnParallelLinear, RowParallelLinear

    _dp4c_everywhere(monkeypatch)
    set_fused_kernels(True)
    try:
        g = torch.Generator().manual_seed(3)
        col = _q4_k_layer(ColumnParallelLinear, 2048, 96, 4)
        norm = RMSNorm(2048, 1e-6)
        norm.weight.data.normal_(1.0, 0.2, generator=g)
        x, res = torch.randn(1, 2048, generator=g), torch.randn(1, 2048, generator=g)
        out, new_res, rotated = col.normed_product(x, res, norm)
        assert not rotated
        ref_in, ref_res = norm(x, res)
        assert torch.equal(new_res, ref_res)
        torch.testing.assert_close(out, col(ref_in), rtol=0, atol=0)
        out, same, _ = col.normed_product(x, None, norm)
        assert same is x
        torch.testing.assert_close(out, col(norm(x)), rtol=0, atol=0)
        assert col.normed_product(torch.randn(2, 2048), None, norm) is None

        row = _q4_k_layer(RowParallelLinear, 2048, 80, 5)
        gu = torch.randn(1, 4096, generator=g)
        torch.testing.assert_close(row.gated_product(gu), row(silu_and_mul(gu)), rtol=0, atol=0)
        assert row.gated_product(torch.randn(3, 4096)) is None
        assert _q4_k_layer(RowParallelLinear, 1024, 8, 6).gated_product(torch.randn(1, 2048)) is None
    finally:
        set_fused_kernels(None)
    q8 = ColumnParallelLinear(2048, 8)
    from radixserve.layers.quantization.gguf import GGUFLinearMethod

    q8.set_quant_method(GGUFLinearMethod(G.Q8_0, online=True))
    q8.quant_method.process_weights_after_loading(q8)
    assert q8.normed_product(torch.randn(1, 2048), None, RMSNorm(2048)) is None


def test_q4_k_model_decodes_the_same_tokens_with_the_fused_quantisers(tmp_path, monkeypatch) -> None:
    """A 2,048-wide Q4_K Llama decoding one prompt through the fused kernels on the CPU (dp4c forced for every
    one-row product): every decode step folds the input norm into q/k/v (with the rotation and the KV store in its
    epilogue), the post-attention norm into gate/up and SiLU·mul into down, and gives the tokens of the same model
    with the hooks off."""
    from model_utils import make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.layers.quantization import gguf_chunk_rope, gguf_prologue
    from radixserve.layers.quantization.gguf import GGUFLinearMethod

    make_tiny_model("llama", str(tmp_path), hidden_size=2048, intermediate_size=2048, num_attention_heads=16,
                    num_key_value_heads=4, num_hidden_layers=1, vocab_size=512)
    _dp4c_everywhere(monkeypatch)
    calls: list[str] = []
    for mod, name in ((gguf_prologue, "q8_1_blocks_normed"), (gguf_prologue, "q8_1_blocks_gated"),
                      (gguf_chunk_rope, "dp4c_qkv_rope")):
        real = getattr(mod, name)
        monkeypatch.setattr(mod, name, lambda *a, _r=real, _n=name: calls.append(_n) or _r(*a))
    prompt = [5, 17, 42, 99]  # up to 4 rows: the GEMV's ("ew" above)
    set_fused_kernels(True)
    try:
        fused = StaticBatch(make_runner(str(tmp_path), quantization="q4_k")).generate([prompt], 4)[0]
        assert calls.count("q8_1_blocks_normed") == 2 * 3 and calls.count("q8_1_blocks_gated") == 3
        assert calls.count("dp4c_qkv_rope") == 3  # q/k/v rotated and k/v stored in the product's epilogue
        monkeypatch.setattr(GGUFLinearMethod, "apply_normed", lambda *a: None)
        monkeypatch.setattr(GGUFLinearMethod, "apply_gated", lambda *a: None)
        plain = StaticBatch(make_runner(str(tmp_path), quantization="q4_k")).generate([prompt], 4)[0]
    finally:
        set_fused_kernels(None)
    assert len(calls) == 12
    assert fused == plain


@pytest.mark.parametrize("block_n,head_dim,with_kv", [(2, 16, True), (16, 64, True), (4, 32, False)])
def test_q4_k_qkv_rope_equals_dp4c_then_the_rotation(block_n: int, head_dim: int, with_kv: bool) -> None:
    """`dp4c_qkv_rope` (q/k/v through dp4c, R = block_n / 2 rows of each half-head run a program, q and k rotated
    and k / v stored in the epilogue) against dp4c's product rotated by the reference formula and stored by hand;
    other KV slots untouched."""
    from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs, dp4c_qkv_rope
    from radixserve.layers.quantization.gguf_kernels import dp4c_gemv
    from radixserve.layers.triton_ops.gemv_rope import KVDest

    g = torch.Generator().manual_seed(block_n + head_dim)
    hq, hk, k = 4, 2, 2048
    n, half = (hq + 2 * hk) * head_dim, head_dim // 2
    fields = G.quantize(G.Q4_K, torch.randn(n, k, generator=g) * 0.05)
    bias = torch.randn(n, generator=g)
    xw, f = q8_1_blocks(torch.randn(1, k, generator=g))
    cfg = GemvConfig("dp4c", block_n, 2048, 1)
    pos = torch.tensor([37])
    freqs = torch.arange(64).float()[:, None] * (1e4 ** (-torch.arange(half).float() / half))[None, :]
    cos, sin = freqs.cos(), freqs.sin()
    kv = KVDest(torch.zeros(8, hk, head_dim), torch.zeros(8, hk, head_dim), torch.tensor([5])) if with_kv else None
    rope = RopeArgs(hq, hk, head_dim, pos, cos, sin, kv)
    got = dp4c_qkv_rope(xw, f, fields, n, bias, cfg, rope, torch.empty(1, n))
    plain = dp4c_gemv(xw, f, fields, n, bias, cfg, torch.empty(1, n)).view(hq + 2 * hk, head_dim)
    x1, x2 = plain[:, :half], plain[:, half:]
    c, s_ = cos[37], sin[37]
    ref = torch.cat([x1 * c - x2 * s_, x2 * c + x1 * s_], dim=-1)
    ref[hq + hk:] = plain[hq + hk:]  # v is not rotated
    torch.testing.assert_close(got.view(hq + 2 * hk, head_dim), ref, rtol=1e-5, atol=1e-5)
    if with_kv:
        torch.testing.assert_close(kv.k_buf[5], ref[hq:hq + hk], rtol=1e-5, atol=1e-5)
        torch.testing.assert_close(kv.v_buf[5], ref[hq + hk:], rtol=0, atol=0)
        assert not kv.k_buf[torch.arange(8) != 5].any() and not kv.v_buf[torch.arange(8) != 5].any()
