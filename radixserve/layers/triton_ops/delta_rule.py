"""One decode step of the gated delta rule (`layers/linear_attention.py`) in one launch, the state updated in place.

In torch the step is ~10 elementwise passes over each request's [Hv, Dk, Dv] float32 state (gather, decay, two
products with k, the update, the product with q, the write back): at batch 64 and Qwen3.5-9B's 24 linear layers that
is ~30 GB a step. Here each program owns one request, one value head and BLOCK_V of its Dv columns: it L2-normalises
the head's q and k (the columns of the state are independent, so each program reads them whole), reads its [Dk,
BLOCK_V] slice of the state once, applies decay, delta update and readout in registers, and writes the slice back.
The arithmetic is the torch step's (float32; q scaled by Dk^-1/2 after its normalisation)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _delta_rule_decode_kernel(State, Rows, X, G, Beta, Out, stride_sr, stride_sh, stride_x, scale, num_v_heads,
                              GROUP: tl.constexpr, KEY_HEADS: tl.constexpr, DK: tl.constexpr, DV: tl.constexpr,
                              BLOCK_K: tl.constexpr, BLOCK_V: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_k = tl.arange(0, BLOCK_K)
    offs_v = tl.program_id(2) * BLOCK_V + tl.arange(0, BLOCK_V)
    mask_k = offs_k < DK
    mask_v = offs_v < DV
    row = tl.load(Rows + b).to(tl.int64)
    x = X + b * stride_x
    kh = h // GROUP  # the key head of this value head
    q = tl.load(x + kh * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    k = tl.load(x + KEY_HEADS * DK + kh * DK + offs_k, mask=mask_k, other=0.0).to(tl.float32)
    v = tl.load(x + 2 * KEY_HEADS * DK + h * DV + offs_v, mask=mask_v, other=0.0).to(tl.float32)
    q = q / tl.sqrt(tl.sum(q * q, axis=0) + 1e-6) * scale
    k = k / tl.sqrt(tl.sum(k * k, axis=0) + 1e-6)
    g = tl.load(G + b * num_v_heads + h)
    beta = tl.load(Beta + b * num_v_heads + h)
    s_ptrs = State + row * stride_sr + h * stride_sh + offs_k[:, None] * DV + offs_v[None, :]
    mask = mask_k[:, None] & mask_v[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0) * tl.exp(g)
    remembered = tl.sum(s * k[:, None], axis=0)
    delta = (v - remembered) * beta
    s = s + k[:, None] * delta[None, :]
    o = tl.sum(s * q[:, None], axis=0)
    tl.store(s_ptrs, s, mask=mask)
    tl.store(Out + (b * num_v_heads + h) * DV + offs_v, o.to(Out.dtype.element_ty), mask=mask_v)


def delta_rule_decode(state: torch.Tensor, rows: torch.Tensor, qkv: torch.Tensor, g: torch.Tensor,
                      beta: torch.Tensor, key_heads: int, dk: int, dv: int) -> torch.Tensor:
    """state [slots, Hv, Dk, Dv] float32 (rows `rows` [B] updated in place), qkv [B, 2 Hk Dk + Hv Dv] (the
    convolved q, k, v before normalisation), g / beta [B, Hv] float32 -> o [B, Hv, Dv] in qkv's dtype."""
    bs, hv = g.shape
    if state.dtype != torch.float32 or state.dim() != 4 or state.shape[1:] != (hv, dk, dv) \
            or state.stride(3) != 1 or state.stride(2) != dv:
        raise ValueError(f"delta_rule_decode: state {tuple(state.shape)} {state.dtype} is not float32 [slots, {hv}, "
                         f"{dk}, {dv}] with contiguous heads")
    if qkv.shape != (bs, 2 * key_heads * dk + hv * dv) or qkv.stride(1) != 1 or hv % key_heads \
            or beta.shape != g.shape or rows.shape != (bs,):
        raise ValueError(f"delta_rule_decode: qkv {tuple(qkv.shape)}, g {tuple(g.shape)}, beta {tuple(beta.shape)}, "
                         f"rows {tuple(rows.shape)} do not fit {key_heads} key heads of {dk} and {hv} value heads "
                         f"of {dv}")
    out = torch.empty((bs, hv, dv), dtype=qkv.dtype, device=qkv.device)
    if bs == 0:
        return out
    block_v = min(32, triton.next_power_of_2(dv))
    opts = dict(num_warps=4) if qkv.is_cuda else {}
    launch(_delta_rule_decode_kernel, (bs, hv, triton.cdiv(dv, block_v)), state, rows, qkv, g.contiguous(),
           beta.contiguous(), out, state.stride(0), state.stride(1), qkv.stride(0), dk ** -0.5, hv,
           GROUP=hv // key_heads, KEY_HEADS=key_heads, DK=dk, DV=dv, BLOCK_K=triton.next_power_of_2(dk),
           BLOCK_V=block_v, **opts, **pdl.launch_opts(qkv))
    return out
