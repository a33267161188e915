"""The chunk-to-chunk pass of the gated delta rule's prefill (`linear_attention.delta_rule_sequences`) in one launch.

The torch form solves every chunk's updates at once (batched over the chunks) and then walks the chunks in a Python
loop, four small batched products a chunk carrying the state: a 4,096-token prefill is 64 steps of ~6 launches a
layer. Here each program owns one (request, value head) sequence and BLOCK_V of its Dv state columns (the columns
are independent), reads its [Dk, BLOCK_V] slice of the start state once and, chunk by chunk, with the chunk's
precomputed terms (U = the updates from v, W = their part from the start state, Qd = q e^{c}, the causal decayed
q . k scores, Kend = k e^{c_last - c}, e^{c_last}):

    u = U - W S;   o = Qd S + scores u;   S = e^{c_last} S + Kend^T u

The products keep about float32's precision on CUDA (TF32x3, three TF32 products each): on an H100 at Qwen3.5-9B's
shape (`benchmarks/bench_recurrent_prefill.py`), 1 x 8,192 / 8 x 1,024 / 64 x 512 tokens took 15.5 / 7.0 / 28.5 ms
a layer against 12.4 / 7.2 / 23.2 with single TF32 products (whose outputs were 1e-2 off the torch loop's,
relative to the largest) and 219 / 34 / 75 for the torch loop. IEEE under the interpreter."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _delta_chunks_kernel(State, U, W, Qd, Scores, Kend, Last, Out, chunks,
                         su_h, su_n, su_c, su_d, sw_h, sw_n, sw_c, sw_d, sq_h, sq_n, sq_c, sq_d,
                         sp_h, sp_n, sp_c, sp_d, sk_h, sk_n, sk_c, sk_d, sl_h, so_h, so_t,
                         DK: tl.constexpr, DV: tl.constexpr, C: tl.constexpr, BLOCK_K: tl.constexpr,
                         BLOCK_V: tl.constexpr, PRECISION: tl.constexpr):
    h = tl.program_id(0).to(tl.int64)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_k = tl.arange(0, BLOCK_K)
    offs_c = tl.arange(0, C)
    mask_v = offs_v < DV
    mask_k = offs_k < DK
    s_ptrs = State + h * DK * DV + offs_k[:, None] * DV + offs_v[None, :]
    mask_s = mask_k[:, None] & mask_v[None, :]
    state = tl.load(s_ptrs, mask=mask_s, other=0.0)  # [BLOCK_K, BLOCK_V]
    mask_ck = mask_k[None, :]
    for n in range(chunks):
        u = tl.load(U + h * su_h + n * su_n + offs_c[:, None] * su_c + offs_v[None, :] * su_d, mask=mask_v[None, :],
                    other=0.0)  # [C, BLOCK_V]
        w = tl.load(W + h * sw_h + n * sw_n + offs_c[:, None] * sw_c + offs_k[None, :] * sw_d, mask=mask_ck, other=0.0)
        u -= tl.dot(w, state, input_precision=PRECISION)
        qd = tl.load(Qd + h * sq_h + n * sq_n + offs_c[:, None] * sq_c + offs_k[None, :] * sq_d, mask=mask_ck,
                     other=0.0)
        scores = tl.load(Scores + h * sp_h + n * sp_n + offs_c[:, None] * sp_c + offs_c[None, :] * sp_d)  # [C, C]
        o = tl.dot(qd, state, input_precision=PRECISION) + tl.dot(scores, u, input_precision=PRECISION)
        tl.store(Out + h * so_h + (n * C + offs_c[:, None]) * so_t + offs_v[None, :], o, mask=mask_v[None, :])
        kend = tl.load(Kend + h * sk_h + n * sk_n + offs_c[:, None] * sk_c + offs_k[None, :] * sk_d, mask=mask_ck,
                       other=0.0)
        last = tl.load(Last + h * sl_h + n)
        state = state * last + tl.dot(tl.trans(kend), u, input_precision=PRECISION)
    tl.store(s_ptrs, state, mask=mask_s)


# (state columns a program, warps, pipeline stages): at Qwen3.5's 128 x 128 heads and 64-token chunks a program's
# float32 tiles take ~72 KB of shared memory in one stage (sm_90; a second stage doubles it)
CONFIG = (32, 4, 1)


def delta_chunks(state: torch.Tensor, from_v: torch.Tensor, from_state: torch.Tensor, q_decayed: torch.Tensor,
                 scores: torch.Tensor, k_to_end: torch.Tensor, last_decay: torch.Tensor,
                 config: tuple[int, int, int] | None = None) -> torch.Tensor:
    """The chunk loop of `delta_rule_sequences`. state [H, Dk, Dv] float32 (contiguous; updated in place to the
    end state), from_v [H, N, C, Dv], from_state / q_decayed / k_to_end [H, N, C, Dk], scores [H, N, C, C],
    last_decay [H, N] (e^{c_last} of each chunk), all float32, any strides (solve_triangular's output comes
    column-major) -> o [H, N C, Dv] float32. `config`: `CONFIG`'s fields (benchmarks sweep them)."""
    heads, chunks, c, dv = from_v.shape
    dk = from_state.shape[-1]
    if state.shape != (heads, dk, dv) or not state.is_contiguous() or state.dtype != torch.float32:
        raise ValueError(f"delta_chunks: state {tuple(state.shape)} {state.dtype} must be contiguous float32 "
                         f"[{heads}, {dk}, {dv}]")
    for name, t, d in (("from_v", from_v, dv), ("from_state", from_state, dk), ("q_decayed", q_decayed, dk),
                       ("k_to_end", k_to_end, dk), ("scores", scores, c)):
        if t.shape != (heads, chunks, c, d):
            raise ValueError(f"delta_chunks: {name} {tuple(t.shape)} must be [{heads}, {chunks}, {c}, {d}]")
    if last_decay.shape != (heads, chunks) or c < 16 or c & (c - 1):
        raise ValueError(f"delta_chunks: last_decay {tuple(last_decay.shape)} must be [{heads}, {chunks}] and the "
                         f"chunk ({c}) a power of two of at least 16")
    if any(t.dtype != torch.float32 for t in (from_v, from_state, q_decayed, scores, k_to_end, last_decay)):
        raise ValueError("delta_chunks: every operand must be float32")
    out = torch.empty((heads, chunks * c, dv), dtype=torch.float32, device=state.device)
    if heads == 0 or chunks == 0:
        return out
    block_v, warps, stages = config or CONFIG
    block_v = min(block_v, max(16, triton.next_power_of_2(dv)))
    last_decay = last_decay.contiguous()
    opts = dict(num_warps=warps, num_stages=stages) if state.is_cuda else {}
    launch(_delta_chunks_kernel, (heads, triton.cdiv(dv, block_v)), state, from_v, from_state, q_decayed, scores,
           k_to_end, last_decay, out, chunks, *from_v.stride(), *from_state.stride(), *q_decayed.stride(),
           *scores.stride(), *k_to_end.stride(), last_decay.stride(0), out.stride(0), out.stride(1),
           DK=dk, DV=dv, C=c, BLOCK_K=max(16, triton.next_power_of_2(dk)), BLOCK_V=block_v,
           PRECISION="tf32x3" if state.is_cuda else "ieee", **opts)
    return out
