"""The Mamba2 scan over prefill tokens (`layers/mamba2.py`'s extend) in one launch: the chunked form of
`mamba2.ssd_chunked`, each program carrying its slice of a request's state through the chunks in registers.

In torch the chunked scan is a dozen passes per chunk over float32 temporaries ([S, G, r, L, L] decays and scores,
[S, L, G, r, P] products) plus a Python loop over chunks. Here each program owns one sequence, one head and BLOCK_P
of its P rows; it reads its [BLOCK_P, N] slice of the start state once and then, for each chunk of CHUNK tokens
(with L_t the running sum of dt * A from the chunk's start, u = dt x):

    y = ((C B^T) * e^{L_t - L_j} [j <= t]) u + e^{L_t} C S^T
    S = e^{L_last} S + (u * e^{L_last - L_j})^T B

four tensor-core products of CHUNK x N, CHUNK x CHUNK and BLOCK_P sizes. Chunks past a sequence's length are
skipped; inside the last one the tokens past it load dt = 0 and are not written, so they leave the state as it is
(as the torch form's padding does). C B^T is recomputed by each head of a group (cheap beside the loads it saves).
The products take float32 operands: TF32x3 (three TF32 products, about float32's precision) for float32 models,
single TF32 otherwise (x, B and C were rounded through bf16 / fp16 before, which TF32 holds exactly); IEEE under
the interpreter. On an H100 at Nemotron-H-8B's shape (`benchmarks/bench_recurrent_prefill.py`), 1 x 8,192 / 8 x
1,024 / 64 x 512 tokens took 1.38 / 1.08 / 4.26 ms a layer (TF32; 4.17 / 4.51 / 18.5 with TF32x3) against 52.7 /
14.8 / 23.8 for the torch form."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _ssd_scan_kernel(State, X, Dt, A, B, C, Y, Lens,
                     ss_s, ss_h, ss_p, sx_s, sx_t, sx_h, sx_p, sd_s, sd_t, sb_s, sb_t, sb_g, sb_n,
                     sc_s, sc_t, sc_g, sc_n, sy_s, sy_t, sy_h,
                     HEADS_PER_GROUP: tl.constexpr, P: tl.constexpr, N: tl.constexpr, CHUNK: tl.constexpr,
                     BLOCK_P: tl.constexpr, BLOCK_N: tl.constexpr, PRECISION: tl.constexpr):
    s = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    offs_p = tl.program_id(2) * BLOCK_P + tl.arange(0, BLOCK_P)
    offs_n = tl.arange(0, BLOCK_N)
    offs_l = tl.arange(0, CHUNK)
    mask_p = offs_p < P
    mask_n = offs_n < N
    g = h // HEADS_PER_GROUP
    a = tl.load(A + h)
    length = tl.load(Lens + s)
    s_ptrs = State + s * ss_s + h * ss_h + offs_p[:, None] * ss_p + offs_n[None, :]
    state = tl.load(s_ptrs, mask=mask_p[:, None] & mask_n[None, :], other=0.0)  # [BLOCK_P, BLOCK_N]
    causal = offs_l[:, None] >= offs_l[None, :]
    x_base = X + s * sx_s + h * sx_h
    b_base = B + s * sb_s + g * sb_g
    c_base = C + s * sc_s + g * sc_g
    y_base = Y + s * sy_s + h * sy_h
    for start in range(0, length, CHUNK):
        t = start + offs_l
        mask_t = t < length
        dt = tl.load(Dt + s * sd_s + t * sd_t + h, mask=mask_t, other=0.0)  # [L]
        cum = tl.cumsum(dt * a, 0)  # L_t
        x = tl.load(x_base + t[:, None] * sx_t + offs_p[None, :] * sx_p, mask=mask_t[:, None] & mask_p[None, :],
                    other=0.0)  # [L, BLOCK_P]
        mask_tn = mask_t[:, None] & mask_n[None, :]
        bm = tl.load(b_base + t[:, None] * sb_t + offs_n[None, :] * sb_n, mask=mask_tn, other=0.0)  # [L, BLOCK_N]
        cm = tl.load(c_base + t[:, None] * sc_t + offs_n[None, :] * sc_n, mask=mask_tn, other=0.0)
        u = x * dt[:, None]
        scores = tl.dot(cm, tl.trans(bm), input_precision=PRECISION)  # [L, L]: C_t . B_j
        decay = tl.exp(tl.where(causal, cum[:, None] - cum[None, :], float("-inf")))
        y = tl.dot(scores * decay, u, input_precision=PRECISION)
        y += tl.exp(cum)[:, None] * tl.dot(cm, tl.trans(state), input_precision=PRECISION)
        tl.store(y_base + t[:, None] * sy_t + offs_p[None, :], y, mask=mask_t[:, None] & mask_p[None, :])
        last = tl.sum(tl.where(offs_l == CHUNK - 1, cum, 0.0), 0)  # (dt = 0 past the length: the last token's)
        w = u * tl.exp(last - cum)[:, None]
        state = state * tl.exp(last) + tl.dot(tl.trans(w), bm, input_precision=PRECISION)
    tl.store(s_ptrs, state, mask=mask_p[:, None] & mask_n[None, :])


# (tokens a chunk, rows of P a program, warps, pipeline stages): a full 64-row head (Nemotron-H, Granite 4.0) in one
# program needs ~80 KB of shared memory at these chunks (sm_90), two programs an SM; the fastest of the sweep in
# `benchmarks/bench_recurrent_prefill.py --sweep` on an H100 (Nemotron-H-8B, 8 x 1,024 tokens)
CONFIG = (32, 64, 4, 2)


def ssd_scan(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor, lens: torch.Tensor, exact: bool = True,
             config: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """`mamba2.ssd_chunked` in one launch. state [S, H, P, N] float32 (each sequence's start; updated in place to its
    end), x [S, T, H, P], dt [S, T, H] (after softplus and clamp), b / c [S, T, G, N] (float32, any strides with
    contiguous heads of dt), a [H] (= A, negative), lens [S] (each sequence's tokens, ≤ T) -> y [S, T, H, P]
    float32 (without the D skip; zero past each length). `exact`: TF32x3 products on CUDA (else TF32); `config`:
    `CONFIG`'s fields (benchmarks sweep them)."""
    s, length, h, p = x.shape
    if b.dim() != 4 or b.shape[:2] != (s, length) or c.shape != b.shape:
        raise ValueError(f"ssd_scan: b {tuple(b.shape)} and c {tuple(c.shape)} must be [{s}, {length}, G, N]")
    g, n = b.shape[2:]
    if state.shape != (s, h, p, n) or state.dtype != torch.float32 or state.stride(3) != 1:
        raise ValueError(f"ssd_scan: state {tuple(state.shape)} {state.dtype} must be float32 [{s}, {h}, {p}, {n}] "
                         "with contiguous rows")
    if g <= 0 or h % g or dt.shape != (s, length, h) or dt.stride(2) != 1 or a.shape != (h,) \
            or lens.shape != (s,):
        raise ValueError(f"ssd_scan: dt {tuple(dt.shape)}, a {tuple(a.shape)}, lens {tuple(lens.shape)} do not fit "
                         f"{s} sequences of {length} tokens, {h} heads in {g} groups")
    if any(t.dtype != torch.float32 for t in (x, dt, b, c)):
        raise ValueError("ssd_scan: x, dt, b and c must be float32")
    y = torch.zeros((s, length, h, p), dtype=torch.float32, device=x.device)
    if s == 0 or length == 0:
        return y
    chunk, block_p, warps, stages = config or CONFIG
    block_p = min(block_p, max(16, triton.next_power_of_2(p)))
    opts = dict(num_warps=warps, num_stages=stages) if x.is_cuda else {}
    launch(_ssd_scan_kernel, (s, h, triton.cdiv(p, block_p)), state, x, dt, a.float().contiguous(), b, c, y,
           lens.to(device=x.device, dtype=torch.int32), state.stride(0), state.stride(1), state.stride(2),
           *x.stride(), dt.stride(0), dt.stride(1), *b.stride(), *c.stride(), y.stride(0), y.stride(1), y.stride(2),
           HEADS_PER_GROUP=h // g, P=p, N=n, CHUNK=chunk, BLOCK_P=block_p,
           BLOCK_N=max(16, triton.next_power_of_2(n)),
           PRECISION=("tf32x3" if x.is_cuda else "ieee") if exact else "tf32", **opts)
    return y
