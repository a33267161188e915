"""The gated delta rule's chunk loop in one Triton launch (`triton_ops/delta_chunks.py`, under TRITON_INTERPRET=1
on the CPU) against the torch loop of `linear_attention.delta_rule_sequences`, and GatedDeltaNet's extends with the
kernels on against them off."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.linear_attention import delta_rule_chunked, delta_rule_step, l2_normalize
from radixserve.layers.triton_ops import set_fused_kernels


def _fused(on: bool, fn, *args, **kwargs):  # noqa: ANN001, ANN002, ANN003, ANN202
    set_fused_kernels(on)
    try:
        return fn(*args, **kwargs)
    finally:
        set_fused_kernels(None)


@pytest.mark.parametrize("shape", [(3, 150, 16, 8, 64), (2, 40, 24, 40, 16), (4, 64, 32, 32, 32)],
                         ids=["partial-chunk", "masked-k-v", "one-chunk"])
def test_chunk_loop_equals_the_torch_loop(shape: tuple) -> None:
    heads, length, dk, dv, chunk = shape
    gen = torch.Generator().manual_seed(0)
    q = l2_normalize(torch.randn(heads, length, dk, generator=gen)) * dk ** -0.5
    k = l2_normalize(torch.randn(heads, length, dk, generator=gen))
    v = torch.randn(heads, length, dv, generator=gen)
    g, beta = -torch.rand(heads, length, generator=gen), torch.rand(heads, length, generator=gen)
    s0 = torch.randn(heads, dk, dv, generator=gen) * 0.1
    want, want_state = _fused(False, delta_rule_chunked, s0, q, k, v, g, beta, chunk)
    start = s0.clone()
    got, state = _fused(True, delta_rule_chunked, start, q, k, v, g, beta, chunk)
    torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(state, want_state, atol=1e-5, rtol=1e-5)
    torch.testing.assert_close(start, s0)  # the caller's state is not written
    if shape[0] == 3:  # and both are the recurrence
        st, steps = s0[None], []
        for t in range(length):
            o, st = delta_rule_step(st, q[:, t][None], k[:, t][None], v[:, t][None], g[:, t][None], beta[:, t][None])
            steps.append(o[0])
        torch.testing.assert_close(got, torch.stack(steps, dim=1), atol=1e-5, rtol=1e-5)


def test_extends_with_the_kernel_equal_them_without() -> None:
    """GatedDeltaNet's padded and request-by-request extends (fresh and continuing requests, a one-token one)."""
    from test_qwen3_next import random_delta_net

    lens, prefixes, rows = [7, 1, 70], [0, 5, 2], [1, 3, 0]
    results = []
    for fused in (False, True):
        net = random_delta_net()
        net.states.ssm.normal_(generator=torch.Generator().manual_seed(1))
        net.states.conv.normal_(generator=torch.Generator().manual_seed(2))
        gen = torch.Generator().manual_seed(3)
        mixed = torch.randn(sum(lens), net.channels, generator=gen)
        g, beta = -torch.rand(sum(lens), net.hv, generator=gen), torch.rand(sum(lens), net.hv, generator=gen)
        padded = _fused(fused, net._extend_padded, mixed, g, beta, torch.tensor(rows), lens, prefixes)
        each = _fused(fused, net._extend_each, mixed, g, beta, rows, lens, prefixes)
        results.append((padded, each, net.states.ssm.clone()))
    for want, got in zip(*results, strict=True):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)


def test_chunk_loop_rejects_what_it_cannot_run() -> None:
    from radixserve.layers.triton_ops.delta_chunks import delta_chunks

    h, n, c, dk, dv = 2, 3, 16, 8, 8
    parts = [torch.randn(h, n, c, dv), torch.randn(h, n, c, dk), torch.randn(h, n, c, dk), torch.randn(h, n, c, c),
             torch.randn(h, n, c, dk), torch.rand(h, n)]
    with pytest.raises(ValueError, match="state"):
        delta_chunks(torch.randn(h, dv, dk).transpose(1, 2), *parts)
    with pytest.raises(ValueError, match="scores"):
        delta_chunks(torch.randn(h, dk, dv), *parts[:3], torch.randn(h, n, c, c + 1), *parts[4:])
    with pytest.raises(ValueError, match="float32"):
        delta_chunks(torch.randn(h, dk, dv), parts[0].double(), *parts[1:])
