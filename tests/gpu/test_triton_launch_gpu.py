"""The fast Triton launch path on a GPU: every kernel gives bit-identical results through it and through Triton's
own `kernel[grid]`, including calls that alternate between specialisations (aligned and misaligned tensors, sizes
of 1, multiples of 16 and others), and the fast path is really taken."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest
import torch

pytestmark = [
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
    pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") == "1", reason="needs compiled Triton kernels"),
]

if torch.cuda.is_available():
    from radixserve.layers.attention.triton_ops.decode_attention import (
        _decode_stage1_kernel,
        decode_attention_fwd,
        decode_partial_shapes,
    )
    from radixserve.layers.triton_ops import launch as launch_mod
    from radixserve.layers.triton_ops.activation import silu_and_mul
    from radixserve.layers.triton_ops.kv_store import store_kv
    from radixserve.layers.triton_ops.norm import _rmsnorm_kernel, fused_add_rmsnorm, rmsnorm
    from radixserve.layers.triton_ops.rotary import apply_rotary_inplace

DEV = "cuda"


def _both_ways(run: Callable[[], list[torch.Tensor]]) -> None:
    """run() three times with the fast path off (reference), then three times with it on: identical bits."""
    launch_mod.set_fast_launch(False)
    try:
        ref = run()
    finally:
        launch_mod.set_fast_launch(True)
    for _ in range(3):  # the first call of a key takes Triton's path, the others the cached one
        out = run()
        for a, b in zip(out, ref, strict=True):
            assert torch.equal(a, b)


@pytest.mark.parametrize("rows", [1, 16, 17])
@pytest.mark.parametrize("offset", [0, 1])
def test_norms_and_mlp_kernels_identical(rows: int, offset: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(rows)
    hidden = 4096
    base = torch.randn(rows, hidden + 8, device=DEV, dtype=torch.bfloat16, generator=g)
    x = base[:, offset:offset + hidden]  # offset 1: a 2-byte misaligned pointer
    res = torch.randn(rows, hidden, device=DEV, dtype=torch.bfloat16, generator=g)
    w = torch.rand(hidden, device=DEV, dtype=torch.bfloat16, generator=g) + 0.5
    gate_up = torch.randn(rows, 2 * 1000 + 8, device=DEV, dtype=torch.bfloat16, generator=g)[:, offset:offset + 2000]

    def run() -> list[torch.Tensor]:
        out, new_res = fused_add_rmsnorm(x, res, w, 1e-5)
        return [rmsnorm(x, w, 1e-5), out, new_res, silu_and_mul(gate_up)]

    _both_ways(run)
    assert launch_mod._launchers[id(_rmsnorm_kernel)].compiled  # the fast path kept what it launched


@pytest.mark.parametrize("tokens", [1, 16, 33])
def test_rotary_and_kv_store_identical(tokens: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(tokens)
    hq, hk, d = 32, 8, 128
    qkv0 = torch.randn(tokens, (hq + 2 * hk) * d, device=DEV, dtype=torch.bfloat16, generator=g)
    pos = torch.randint(0, 4000, (tokens,), device=DEV, generator=g)
    inv = 1.0 / (500000 ** (torch.arange(0, d, 2, device=DEV).float() / d))
    freqs = torch.outer(torch.arange(4096, device=DEV).float(), inv)
    cos, sin = freqs.cos(), freqs.sin()
    loc = torch.randperm(1000, device=DEV, generator=g)[:tokens]

    def run() -> list[torch.Tensor]:
        qkv = qkv0.clone()
        q, k, v = qkv.split([hq * d, hk * d, hk * d], dim=-1)
        apply_rotary_inplace(pos, q, k, cos, sin, d)
        k_buf = torch.zeros(1000, hk, d, device=DEV, dtype=torch.bfloat16)
        v_buf = torch.zeros_like(k_buf)
        store_kv(k_buf, v_buf, loc, k, v)
        return [qkv, k_buf, v_buf]

    _both_ways(run)


@pytest.mark.parametrize("bs", [1, 16, 37])
def test_decode_attention_identical(bs: int) -> None:
    g = torch.Generator(device=DEV).manual_seed(bs)
    hq, hk, d, slots = 32, 8, 128, 40_000
    k_buf = torch.randn(slots, hk, d, device=DEV, dtype=torch.bfloat16, generator=g)
    v_buf = torch.randn(slots, hk, d, device=DEV, dtype=torch.bfloat16, generator=g)
    seq_lens = torch.randint(1, 900, (bs,), device=DEV, generator=g)
    req_to_token = torch.randint(0, slots, (bs, 1024), device=DEV, generator=g, dtype=torch.int32)
    rpi = torch.arange(bs, device=DEV)
    q = torch.randn(bs, hq, d, device=DEV, dtype=torch.bfloat16, generator=g)
    o_shape, lse_shape = decode_partial_shapes(bs, hq, d, 16)

    def run() -> list[torch.Tensor]:
        o = torch.empty_like(q)
        mid_o = torch.empty(o_shape, device=DEV, dtype=torch.float32)
        mid_lse = torch.empty(lse_shape, device=DEV, dtype=torch.float32)
        decode_attention_fwd(q, k_buf, v_buf, o, req_to_token, rpi, seq_lens, mid_o, mid_lse, d ** -0.5,
                             num_kv_splits=16)
        return [o]

    _both_ways(run)
    assert launch_mod._launchers[id(_decode_stage1_kernel)].compiled
