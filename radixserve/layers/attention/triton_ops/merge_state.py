"""Attention over two disjoint sets of keys, merged: each query head's outputs o_a, o_b (softmax-normalised over
its own set) and log-sum-exps s_a, s_b of the scores combine into the attention over the union,

    o = (o_a * exp(s_a - m) + o_b * exp(s_b - m)) / (exp(s_a - m) + exp(s_b - m)),  m = max(s_a, s_b).

The FlashInfer backend runs a long prefill as attention over the new tokens (ragged, causal) and attention over the
cached prefix (paged), and merges the two with this kernel. FlashInfer's log-sum-exps are base 2 (`base2=True`).
An empty set has s = -inf and weighs nothing; a query whose both sets are empty gets zeros.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _merge_kernel(OA, SA, OB, SB, Out, D: tl.constexpr, BLOCK_D: tl.constexpr, BASE2: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # one (token, head) a program
    d = tl.arange(0, BLOCK_D)
    m = d < D
    sa = tl.load(SA + row).to(tl.float32)
    sb = tl.load(SB + row).to(tl.float32)
    top = tl.maximum(sa, sb)
    top = tl.where(top == float("-inf"), 0.0, top)  # both empty: both weights 0
    if BASE2:
        wa = tl.exp2(sa - top)
        wb = tl.exp2(sb - top)
    else:
        wa = tl.exp(sa - top)
        wb = tl.exp(sb - top)
    scale = 1.0 / tl.maximum(wa + wb, 1.0)  # the sum is 0 (both empty) or at least 1 (the larger weighs 1)
    oa = tl.load(OA + row * D + d, mask=m, other=0.0).to(tl.float32)
    ob = tl.load(OB + row * D + d, mask=m, other=0.0).to(tl.float32)
    # a weight of 0 must not turn a non-finite output of an empty set into NaN
    oa = tl.where(wa > 0, oa * wa, 0.0)
    ob = tl.where(wb > 0, ob * wb, 0.0)
    tl.store(Out + row * D + d, ((oa + ob) * scale).to(Out.dtype.element_ty), mask=m)


def _check(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor, s_b: torch.Tensor) -> None:
    if o_a.dim() != 3 or o_a.shape != o_b.shape or s_a.shape != o_a.shape[:2] or s_b.shape != s_a.shape:
        raise ValueError(f"merge_attn_states: o [T, H, D] twice and s [T, H] twice, got {tuple(o_a.shape)}, "
                         f"{tuple(s_a.shape)}, {tuple(o_b.shape)}, {tuple(s_b.shape)}")


def merge_attn_states(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor, s_b: torch.Tensor,
                      base2: bool = True) -> torch.Tensor:
    """o [T, H, D] (any float dtype; the result has o_a's) and s [T, H] (float32) of the two key sets -> o [T, H, D]."""
    _check(o_a, s_a, o_b, s_b)
    out = torch.empty_like(o_a)
    t, h, d = o_a.shape
    if t * h == 0:
        return out
    o_a, o_b, s_a, s_b = (x.contiguous() for x in (o_a, o_b, s_a, s_b))
    launch(_merge_kernel, (t * h,), o_a, s_a, o_b, s_b, out, D=d, BLOCK_D=triton.next_power_of_2(d),
           BASE2=base2)
    return out


def merge_attn_states_ref(o_a: torch.Tensor, s_a: torch.Tensor, o_b: torch.Tensor, s_b: torch.Tensor,
                          base2: bool = True) -> torch.Tensor:
    """The same in torch operations (the kernel's test reference)."""
    _check(o_a, s_a, o_b, s_b)
    top = torch.maximum(s_a, s_b).float()
    top = torch.where(torch.isneginf(top), torch.zeros_like(top), top)
    exp = torch.exp2 if base2 else torch.exp
    wa, wb = exp(s_a.float() - top), exp(s_b.float() - top)
    scale = 1.0 / torch.clamp(wa + wb, min=1.0)
    oa = torch.where(wa[..., None] > 0, o_a.float() * wa[..., None], torch.zeros_like(o_a, dtype=torch.float32))
    ob = torch.where(wb[..., None] > 0, o_b.float() * wb[..., None], torch.zeros_like(o_b, dtype=torch.float32))
    return ((oa + ob) * scale[..., None]).to(o_a.dtype)
