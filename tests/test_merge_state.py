"""Merging attention over two key sets (triton_ops/merge_state.py) equals attention over their union: softmax over
random scores split at random, log-sum-exps in base 2 (FlashInfer's) and base e, an empty set on either side (its
output NaN, as a kernel may leave it, must not leak), both sets empty, head dims 128 and 96 (a masked tail), bf16
and float32. On the CPU the kernel runs under TRITON_INTERPRET=1 (tests/conftest.py)."""

from __future__ import annotations

import math

import pytest
import torch

from radixserve.layers.attention.triton_ops.merge_state import merge_attn_states, merge_attn_states_ref

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def part(scores: torch.Tensor, values: torch.Tensor, keep: torch.Tensor, base2: bool) -> tuple[torch.Tensor, ...]:
    """Attention of every (token, head) over the keys `keep` marks: output [T, H, D] and log-sum-exp [T, H]."""
    masked = scores.masked_fill(~keep, float("-inf"))
    lse = torch.logsumexp(masked, -1)
    o = torch.einsum("thk,khd->thd", torch.softmax(masked, -1), values)
    o = torch.where(torch.isneginf(lse)[..., None], torch.full_like(o, float("nan")), o)
    return o, lse / math.log(2) if base2 else lse


@pytest.mark.parametrize("base2", [True, False])
@pytest.mark.parametrize("dtype,d", [(torch.float32, 128), (torch.bfloat16, 96)])
def test_merge_equals_attention_over_the_union(base2: bool, dtype: torch.dtype, d: int) -> None:
    gen = torch.Generator().manual_seed(7 + d)
    t, h, keys = 6, 3, 40
    scores = torch.randn(t, h, keys, generator=gen) * 3
    values = torch.randn(keys, h, d, generator=gen)
    in_a = torch.rand(t, h, keys, generator=gen) < 0.4
    in_a[0, 0] = False  # set a empty here
    in_a[1, 2] = True  # set b empty here
    everything = torch.ones_like(in_a)
    everything[2, 1] = False  # no key at all for this (token, head): both sets empty
    in_b = ~in_a & everything
    in_a &= everything
    oa, sa = part(scores, values, in_a, base2)
    ob, sb = part(scores, values, in_b, base2)
    full = torch.einsum("thk,khd->thd", torch.softmax(scores, -1), values)
    full[2, 1] = 0
    args = [x.to(DEV) for x in (oa.to(dtype), sa, ob.to(dtype), sb)]
    got = merge_attn_states(*args, base2=base2)
    ref = merge_attn_states_ref(*args, base2=base2)
    assert got.dtype == dtype and got.shape == (t, h, d)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float().cpu(), full, atol=tol, rtol=tol)
    torch.testing.assert_close(ref.float().cpu(), full, atol=tol, rtol=tol)
    assert torch.isfinite(got).all()


def test_shapes_are_checked() -> None:
    o, s = torch.zeros(2, 3, 8), torch.zeros(2, 3)
    with pytest.raises(ValueError, match="merge_attn_states"):
        merge_attn_states(o, s, o[:1], s[:1])
    with pytest.raises(ValueError, match="merge_attn_states"):
        merge_attn_states(o, s[:, :2], o, s)
    assert merge_attn_states(o[:0], s[:0], o[:0], s[:0]).shape == (0, 3, 8)
