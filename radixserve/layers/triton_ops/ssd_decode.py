"""One decode step of the Mamba2 scan (`layers/mamba2.py`) in one launch, the state updated in place.

In torch the step is ~6 elementwise passes over each request's [H, P, N] float32 state (gather, decay, the update,
the product with C, the sum, the write back): Nemotron-Nano-9B-v2's 27 Mamba2 layers hold ~140 MB of it a request.
Here each program owns one request, one head and BLOCK_P of its P rows: it reads its [BLOCK_P, N] slice of the state
once, decays it, adds dt x B^T, reads it out through C, adds the D skip and writes the slice back. The convolution
before it stays in torch (its window is shared by every head of a group). The arithmetic is the torch step's
(float32, `mamba2.ssd_step`)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue


@triton.jit
def _ssd_decode_kernel(State, Rows, X, Dt, A, D, Out, stride_sr, stride_sh, stride_x, num_heads, inner,
                       HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, BLOCK_P: tl.constexpr,
                       BLOCK_N: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    b = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    mask_p = offs_p < P
    mask_n = offs_n < N
    row = tl.load(Rows + b).to(tl.int64)
    x_row = X + b * stride_x
    g = h // HEADS_PER_GROUP
    x = tl.load(x_row + h * P + offs_p, mask=mask_p, other=0.0)
    bv = tl.load(x_row + inner + g * N + offs_n, mask=mask_n, other=0.0)
    groups = num_heads // HEADS_PER_GROUP
    cv = tl.load(x_row + inner + groups * N + g * N + offs_n, mask=mask_n, other=0.0)
    dt = tl.load(Dt + b * num_heads + h)
    decay = tl.exp(dt * tl.load(A + h))
    s_ptrs = State + row * stride_sr + h * stride_sh + offs_p[:, None] * N + offs_n[None, :]
    mask = mask_p[:, None] & mask_n[None, :]
    s = tl.load(s_ptrs, mask=mask, other=0.0)
    s = s * decay + (x * dt)[:, None] * bv[None, :]
    y = tl.sum(s * cv[None, :], axis=1) + x * tl.load(D + h)
    tl.store(s_ptrs, s, mask=mask)
    tl.store(Out + b * inner + h * P + offs_p, y, mask=mask_p)


def ssd_decode(state: torch.Tensor, rows: torch.Tensor, xbc: torch.Tensor, dt: torch.Tensor, a: torch.Tensor,
               d: torch.Tensor, groups: int) -> torch.Tensor:
    """state [slots, H, P, N] float32 (rows `rows` [B] updated in place), xbc [B, H P + 2 G N] float32 (the
    convolved x, B, C after SiLU), dt [B, H] float32 (after softplus), a [H] (= -exp(A_log)) and d [H] float32 ->
    y [B, H P] float32 (with the D skip)."""
    bs, heads = dt.shape
    if state.dtype != torch.float32 or state.dim() != 4 or state.shape[1] != heads or state.stride(3) != 1 \
            or state.stride(2) != state.shape[3]:
        raise ValueError(f"ssd_decode: state {tuple(state.shape)} {state.dtype} is not float32 [slots, {heads}, P, N] "
                         "with contiguous heads")
    p, n = state.shape[2:]
    if groups <= 0 or heads % groups or xbc.shape != (bs, heads * p + 2 * groups * n) or xbc.stride(1) != 1 \
            or xbc.dtype != torch.float32 or rows.shape != (bs,) or a.shape != (heads,) or d.shape != (heads,):
        raise ValueError(f"ssd_decode: xbc {tuple(xbc.shape)} {xbc.dtype}, dt {tuple(dt.shape)}, rows "
                         f"{tuple(rows.shape)}, a {tuple(a.shape)}, d {tuple(d.shape)} do not fit {heads} heads of "
                         f"{p} x {n} in {groups} groups")
    out = torch.empty((bs, heads * p), dtype=torch.float32, device=xbc.device)
    if bs == 0:
        return out
    block_p = min(32, triton.next_power_of_2(p))
    opts = dict(num_warps=4) if xbc.is_cuda else {}
    launch(_ssd_decode_kernel, (bs, heads, triton.cdiv(p, block_p)), state, rows, xbc, dt.contiguous(),
           a.float().contiguous(), d.float().contiguous(), out, state.stride(0), state.stride(1), xbc.stride(0),
           heads, heads * p, HEADS_PER_GROUP=heads // groups, P=p, N=n, BLOCK_P=block_p,
           BLOCK_N=triton.next_power_of_2(n), **opts, **pdl.launch_opts(xbc))
    return out
