"""MLA's preparation in two launches at most: what `DeepseekMLAAttention` otherwise does with ~30 small kernels
(a copy, the latent RMSNorm, rotary on q_pe and k_pe in torch ops, the q absorption bmm with its transposes, two
concatenations and the latent store).

Up to HEAD_PROGRAM_TOKENS tokens (decode at small batch), one launch: program (h, r), r < R = ceil(rank /
BLOCK_R): q_full[t, h, r-block] = q_nope[t, h] · W_UK[h][:, r-block] for every token (the head's W_UK block read
once, held in registers); program (h, R): q_full[t, h, rank:] = rope(q_pe[t, h]); program (0, R) also writes every
token's key row [RMSNorm(c) · w, rope(k_pe)] — into the latent pool at the token's slot (`loc`) when given, else
into `k_out`. More tokens (large decode batches, prefill): the absorption is one batched GEMM writing into q_full,
then one program per token rotates its q_pe and writes its key row. Rotation pairs are
interleaved (DeepSeek's checkpoints) or neox halves. The arithmetic is the torch path's: float32, the RMSNorm
rounded as `RMSNorm` rounds, one rounding per output.

`mla_absorb_out` is the output side: o_proj's input [T, H·v] = per head the attention output (over the latent)
times W_UV^T, in one launch up to HEAD_PROGRAM_TOKENS tokens (a bmm into the output's layout beyond).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

HEAD_PROGRAM_TOKENS = 16  # up to this many tokens a program per head (block) loops over them; beyond, per token


@triton.jit
def _rope_row(Src, Dst, pos_cos, pos_sin, HALF: tl.constexpr, HALF_PAD: tl.constexpr, NEOX: tl.constexpr):
    i = tl.arange(0, HALF_PAD)
    ok = i < HALF
    if NEOX:
        i1 = i
        i2 = i + HALF
    else:
        i1 = 2 * i
        i2 = 2 * i + 1
    c = tl.load(pos_cos + i, mask=ok, other=0.0)
    s = tl.load(pos_sin + i, mask=ok, other=0.0)
    x1 = tl.load(Src + i1, mask=ok, other=0.0).to(tl.float32)
    x2 = tl.load(Src + i2, mask=ok, other=0.0).to(tl.float32)
    tl.store(Dst + i1, (x1 * c - x2 * s).to(Dst.dtype.element_ty), mask=ok)
    tl.store(Dst + i2, (x2 * c + x1 * s).to(Dst.dtype.element_ty), mask=ok)


@triton.jit
def _key_row(KVA, Positions, Cos, Sin, NormW, KOut, Loc, t, eps, stride_kva, stride_ko, stride_cache,
             RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_HALF: tl.constexpr, HALF_PAD: tl.constexpr,
             NEOX: tl.constexpr, USE_LOC: tl.constexpr):
    """Token t's key row [RMSNorm(c) · w, rope(k_pe)] into KOut's row t, or row Loc[t] (the latent pool)."""
    pos = tl.load(Positions + t).to(tl.int64)
    if USE_LOC:
        dst = KOut + tl.load(Loc + t).to(tl.int64) * stride_ko
    else:
        dst = KOut + t * stride_ko
    offs_c = tl.arange(0, RANK_PAD)
    c_ok = offs_c < RANK
    nw = tl.load(NormW + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    c = tl.load(KVA + t * stride_kva + offs_c, mask=c_ok, other=0.0).to(tl.float32)
    rstd = tl.rsqrt(tl.sum(c * c, axis=0) / RANK + eps)
    normed = (c * rstd).to(KVA.dtype.element_ty).to(tl.float32) * nw
    tl.store(dst + offs_c, normed.to(KVA.dtype.element_ty).to(KOut.dtype.element_ty), mask=c_ok)
    _rope_row(KVA + t * stride_kva + RANK, dst + RANK, Cos + pos * stride_cache, Sin + pos * stride_cache,
              ROPE_HALF, HALF_PAD, NEOX)


def mla_expanded_prep(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                      sin_cache: torch.Tensor, norm_weight: torch.Tensor, eps: float, neox: bool, k_out: torch.Tensor,
                      loc: torch.Tensor, interpreted: bool = False) -> torch.Tensor:
    """The expanded form's preparation in one launch (a program per token): returns q [T, H, nope + rope] with
    q_pe rotated, and writes the key rows [RMSNorm(c), rope(k_pe)] into rows `loc` of k_out (the latent pool's
    [slots, rank + rope] view). Shapes as `mla_decode_prep`'s, without W_UK."""
    t, heads, qk = q.shape
    rank = norm_weight.shape[0]
    rope = kv_a.shape[1] - rank
    nope = qk - rope
    if rope <= 0 or rope % 2 or nope <= 0 or kv_a.shape[0] != t or loc.shape != (t,) \
            or k_out.shape[-1] != rank + rope:
        raise ValueError(f"mla_expanded_prep: q {tuple(q.shape)}, kv_a {tuple(kv_a.shape)}, norm "
                         f"{tuple(norm_weight.shape)}, k_out {tuple(k_out.shape)}, loc {tuple(loc.shape)} do not fit")
    if q.stride(2) != 1 or kv_a.stride(1) != 1 or k_out.stride(-1) != 1 or cos_cache.stride(1) != 1 \
            or cos_cache.stride() != sin_cache.stride():
        raise ValueError("mla_expanded_prep: every operand needs unit stride in its last dimension")
    q_full = torch.empty((t, heads, qk), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_full
    launch(_mla_rows_kernel, (t,), q, q, kv_a, positions, cos_cache, sin_cache, norm_weight, q_full, k_out, loc,
           heads, float(eps), q.stride(0), q.stride(1), q.stride(1), q.stride(0), kv_a.stride(0), q_full.stride(0),
           q_full.stride(1), k_out.stride(0), cos_cache.stride(0), NOPE=nope, RANK=rank,
           RANK_PAD=triton.next_power_of_2(rank), ROPE_HALF=rope // 2, HALF_PAD=triton.next_power_of_2(rope // 2),
           NEOX=neox, USE_LOC=True, QW=nope, QW_PAD=triton.next_power_of_2(nope),
           **({} if interpreted else {"num_warps": 4}))
    return q_full


# a batch-dependent size, and two pointers read one value a token (views into a batch's host-built pack, at any
# 8-byte offset): one variant for all
@triton.jit(do_not_specialize=["num_tokens", "Positions", "Loc"], do_not_specialize_on_alignment=["Positions", "Loc"])
def _mla_prep_kernel(Q, KVA, Positions, Cos, Sin, WKC, NormW, QOut, KOut, Loc, num_tokens, eps,
                     stride_qt, stride_qh, stride_kva, stride_wh, stride_wn, stride_qot, stride_qoh, stride_ko,
                     stride_cache,
                     NOPE: tl.constexpr, NOPE_PAD: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr,
                     ROPE_HALF: tl.constexpr, HALF_PAD: tl.constexpr, BLOCK_R: tl.constexpr, NUM_RB: tl.constexpr,
                     NEOX: tl.constexpr, USE_LOC: tl.constexpr, PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    h = tl.program_id(0)
    rb = tl.program_id(1)
    if rb < NUM_RB:  # absorption: q_nope · W_UK for one rank block of one head
        offs_n = tl.arange(0, NOPE_PAD)
        offs_r = rb * BLOCK_R + tl.arange(0, BLOCK_R)
        r_ok = offs_r < RANK
        w = tl.load(WKC + h * stride_wh + offs_n[:, None] * stride_wn + offs_r[None, :],
                    mask=(offs_n < NOPE)[:, None] & r_ok[None, :], other=0.0).to(tl.float32)
        for t in range(num_tokens):
            qn = tl.load(Q + t * stride_qt + h * stride_qh + offs_n, mask=offs_n < NOPE, other=0.0).to(tl.float32)
            out = tl.sum(qn[:, None] * w, axis=0)
            tl.store(QOut + t * stride_qot + h * stride_qoh + offs_r, out.to(QOut.dtype.element_ty), mask=r_ok)
    else:
        for t in range(num_tokens):
            pos = tl.load(Positions + t).to(tl.int64)
            _rope_row(Q + t * stride_qt + h * stride_qh + NOPE, QOut + t * stride_qot + h * stride_qoh + RANK,
                      Cos + pos * stride_cache, Sin + pos * stride_cache, ROPE_HALF, HALF_PAD, NEOX)
        if h == 0:  # the key row of every token: normalised latent, rotated k_pe
            for t in range(num_tokens):
                _key_row(KVA, Positions, Cos, Sin, NormW, KOut, Loc, t, eps, stride_kva, stride_ko, stride_cache,
                         RANK, RANK_PAD, ROPE_HALF, HALF_PAD, NEOX, USE_LOC)


# as _mla_prep_kernel's: one value a token, at any offset
@triton.jit(do_not_specialize=["Positions", "Loc"], do_not_specialize_on_alignment=["Positions", "Loc"])
def _mla_rows_kernel(Q, QLat, KVA, Positions, Cos, Sin, NormW, QOut, KOut, Loc, num_heads, eps,
                     stride_qt, stride_qh, stride_lh, stride_lt, stride_kva, stride_qot, stride_qoh, stride_ko,
                     stride_cache,
                     NOPE: tl.constexpr, RANK: tl.constexpr, RANK_PAD: tl.constexpr, ROPE_HALF: tl.constexpr,
                     HALF_PAD: tl.constexpr, NEOX: tl.constexpr, USE_LOC: tl.constexpr, QW: tl.constexpr,
                     QW_PAD: tl.constexpr, COPY_Q: tl.constexpr = True):
    """Program t (many tokens): q_full[t, h] = [QLat[h, t] (QW values: q_nope itself for the expanded form; the
    absorption's bmm writes them in place, COPY_Q False), rope(q_pe[t, h])] for every head, and token t's key row."""
    t = tl.program_id(0)
    pos = tl.load(Positions + t).to(tl.int64)
    offs_c = tl.arange(0, QW_PAD)
    c_ok = offs_c < QW
    for h in range(num_heads):
        if COPY_Q:
            lat = tl.load(QLat + h * stride_lh + t * stride_lt + offs_c, mask=c_ok, other=0.0)
            tl.store(QOut + t * stride_qot + h * stride_qoh + offs_c, lat.to(QOut.dtype.element_ty), mask=c_ok)
        _rope_row(Q + t * stride_qt + h * stride_qh + NOPE, QOut + t * stride_qot + h * stride_qoh + QW,
                  Cos + pos * stride_cache, Sin + pos * stride_cache, ROPE_HALF, HALF_PAD, NEOX)
    _key_row(KVA, Positions, Cos, Sin, NormW, KOut, Loc, t, eps, stride_kva, stride_ko, stride_cache,
             RANK, RANK_PAD, ROPE_HALF, HALF_PAD, NEOX, USE_LOC)

def mla_decode_prep(q: torch.Tensor, kv_a: torch.Tensor, positions: torch.Tensor, cos_cache: torch.Tensor,
                    sin_cache: torch.Tensor, w_kc: torch.Tensor, norm_weight: torch.Tensor, eps: float,
                    neox: bool, k_out: torch.Tensor, loc: torch.Tensor | None = None,
                    interpreted: bool = False) -> torch.Tensor:
    """q [T, H, nope + rope] (q_proj's output), kv_a [T, rank + rope] (kv_a_proj_with_mqa's), w_kc [H, nope, rank]
    (W_UK, unit stride in rank), norm_weight [rank] (kv_a_layernorm), cos/sin caches [max_pos, rope / 2].
    Returns q_full [T, H, rank + rope] = [q_nope · W_UK, rope(q_pe)]; writes the key rows [RMSNorm(c), rope(k_pe)]
    into k_out [T, rank + rope], or, with `loc` [T], into rows loc of k_out (the latent pool's [slots, rank + rope]
    view)."""
    t, heads, qk = q.shape
    _, nope, rank = w_kc.shape
    rope = qk - nope
    if kv_a.shape != (t, rank + rope) or w_kc.shape[0] != heads or norm_weight.shape != (rank,) or rope % 2:
        raise ValueError(f"mla_decode_prep: q {tuple(q.shape)}, kv_a {tuple(kv_a.shape)}, w_kc {tuple(w_kc.shape)}, "
                         f"norm {tuple(norm_weight.shape)} do not fit together")
    if q.stride(2) != 1 or kv_a.stride(1) != 1 or w_kc.stride(2) != 1 or k_out.stride(-1) != 1 \
            or cos_cache.stride(1) != 1 or cos_cache.stride() != sin_cache.stride():
        raise ValueError("mla_decode_prep: every operand needs unit stride in its last dimension")
    if k_out.shape[-1] != rank + rope or (loc is None and k_out.shape[0] != t) or \
            (loc is not None and loc.shape != (t,)):
        raise ValueError(f"mla_decode_prep: k_out {tuple(k_out.shape)} / loc do not fit {t} tokens")
    q_full = torch.empty((t, heads, rank + rope), dtype=q.dtype, device=q.device)
    if t == 0:
        return q_full
    if t > HEAD_PROGRAM_TOKENS:  # the absorption as one batched GEMM into q_full, the rest a program per token
        torch.bmm(q[..., :nope].transpose(0, 1), w_kc, out=q_full[..., :rank].transpose(0, 1))  # [H, T, rank]
        launch(_mla_rows_kernel, (t,), q, q_full, kv_a, positions, cos_cache, sin_cache, norm_weight, q_full, k_out,
               loc if loc is not None else positions, heads, float(eps), q.stride(0), q.stride(1), 0, 0,
               kv_a.stride(0), q_full.stride(0), q_full.stride(1), k_out.stride(0),
               cos_cache.stride(0), NOPE=nope, RANK=rank, RANK_PAD=triton.next_power_of_2(rank),
               ROPE_HALF=rope // 2, HALF_PAD=triton.next_power_of_2(rope // 2), NEOX=neox, USE_LOC=loc is not None,
               QW=rank, QW_PAD=triton.next_power_of_2(rank), COPY_Q=False,
               **({} if interpreted else {"num_warps": 4}))
        return q_full
    block_r = 16 if interpreted else 64
    num_rb = triton.cdiv(rank, block_r)
    launch(_mla_prep_kernel, (heads, num_rb + 1), q, kv_a, positions, cos_cache, sin_cache, w_kc, norm_weight,
           q_full, k_out, loc if loc is not None else positions, t, float(eps), q.stride(0), q.stride(1),
           kv_a.stride(0), w_kc.stride(0), w_kc.stride(1), q_full.stride(0), q_full.stride(1), k_out.stride(0),
           cos_cache.stride(0), NOPE=nope, NOPE_PAD=triton.next_power_of_2(nope), RANK=rank,
           RANK_PAD=triton.next_power_of_2(rank), ROPE_HALF=rope // 2, HALF_PAD=triton.next_power_of_2(rope // 2),
           BLOCK_R=block_r, NUM_RB=num_rb, NEOX=neox, USE_LOC=loc is not None,
           **({} if interpreted else {"num_warps": 4, **pdl.launch_opts(q)}))
    return q_full


@triton.jit(do_not_specialize=["num_tokens"])  # a batch-dependent size: one variant for all
def _mla_out_kernel(Att, WVC, Out, num_tokens, stride_ot, stride_oh, stride_wh, stride_wv, stride_out,
                    RANK: tl.constexpr, RANK_PAD: tl.constexpr, V: tl.constexpr, BLOCK_V: tl.constexpr,
                    PDL: tl.constexpr = 0):
    pdl_prologue(PDL)
    h = tl.program_id(0)
    offs_v = tl.program_id(1) * BLOCK_V + tl.arange(0, BLOCK_V)
    offs_r = tl.arange(0, RANK_PAD)
    v_ok = offs_v < V
    w = tl.load(WVC + h * stride_wh + offs_v[:, None] * stride_wv + offs_r[None, :],
                mask=v_ok[:, None] & (offs_r < RANK)[None, :], other=0.0).to(tl.float32)
    for t in range(num_tokens):
        o = tl.load(Att + t * stride_ot + h * stride_oh + offs_r, mask=offs_r < RANK, other=0.0).to(tl.float32)
        out = tl.sum(w * o[None, :], axis=1)
        tl.store(Out + t * stride_out + h * V + offs_v, out.to(Out.dtype.element_ty), mask=v_ok)


def mla_absorb_out(o: torch.Tensor, w_vc: torch.Tensor, interpreted: bool = False) -> torch.Tensor:
    """o [T, H, rank] (attention over the latent), w_vc [H, v, rank] (W_UV, unit stride in rank) -> [T, H·v]."""
    t, heads, rank = o.shape
    v = w_vc.shape[1]
    if w_vc.shape != (heads, v, rank) or o.stride(2) != 1 or w_vc.stride(2) != 1:
        raise ValueError(f"mla_absorb_out: o {tuple(o.shape)} and w_vc {tuple(w_vc.shape)} do not fit together")
    out = torch.empty((t, heads * v), dtype=o.dtype, device=o.device)
    if t > HEAD_PROGRAM_TOKENS:  # a batched GEMM writing [T, H·v] through a transposed view (no copy after it)
        torch.bmm(o.transpose(0, 1), w_vc.transpose(1, 2), out=out.view(t, heads, v).transpose(0, 1))
        return out
    if t == 0:
        return out
    block_v = 16
    launch(_mla_out_kernel, (heads, triton.cdiv(v, block_v)), o, w_vc, out, t, o.stride(0), o.stride(1),
           w_vc.stride(0), w_vc.stride(1), out.stride(0), RANK=rank, RANK_PAD=triton.next_power_of_2(rank), V=v,
           BLOCK_V=block_v, **({} if interpreted else {"num_warps": 4, **pdl.launch_opts(o)}))
    return out
