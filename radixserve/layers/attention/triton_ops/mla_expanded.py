"""MLA prefill in the expanded (multi-head) form.

The latent form (`mla_attention.py`) costs a query head 2 x (C + R + C) multiply-adds a key (C = 512 latent values
as key and as value, R = 64 rotated values): right for decode, which reads each latent once for all heads, but 3.4x
the arithmetic of the heads' own dimensions in a prefill, where the work is the products, not the reads. Here each
key is first expanded through kv_b_proj into the heads' own key part (D = qk_nope_head_dim) and value (DV =
v_head_dim), and the attention is plain causal multi-head attention with a head dimension of D + R for the scores
and DV for the output; the rotated key part (R) is one row a token shared by every head.

Layout: the queries of request b are rows q_start[b] .. q_start[b] + ext[b] - 1, its keys rows kv_start[b] ..
kv_start[b] + kv_len[b] - 1 (the cached prefix followed by the new tokens), so query i of the request sits at key
position kv_len[b] - ext[b] + i and sees the keys up to it. One program per (request, head, BLOCK_M queries): the
key blocks wholly before its first query run without a mask, the rest with the causal one.

`expanded_pays` says from the batch's lengths whether this form is cheaper than the latent one.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.common import LOG2E, mma, online_softmax_step
from radixserve.layers.triton_ops.launch import launch


@triton.jit
def _expanded_step(q_n, q_r, kn, kr, v, visible, m_i, l_i, acc, scale_log2, DOT_FP32: tl.constexpr,
                   MASKED: tl.constexpr):
    """One key block: the scores from the heads' own part and the shared rotated part, then the online softmax."""
    qk = (mma(q_n, tl.trans(kn), DOT_FP32) + mma(q_r, tl.trans(kr), DOT_FP32)) * scale_log2
    return online_softmax_step(qk, v, visible, m_i, l_i, acc, DOT_FP32, MASKED)


@triton.jit
def _mla_expanded_kernel(
    Q, K, V, KPE, Out, QStart, KVStart, ExtLens, KVLens, scale_log2,
    stride_qt, stride_qh, stride_kt, stride_kh, stride_vt, stride_vh, stride_pt, stride_ot, stride_oh,
    D: tl.constexpr, R: tl.constexpr, DV: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_R: tl.constexpr,
    BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DOT_FP32: tl.constexpr,
):
    b = tl.program_id(0)
    h = tl.program_id(1)
    mblk = tl.program_id(2)
    ext = tl.load(ExtLens + b)
    if mblk * BLOCK_M >= ext:
        return
    kv_len = tl.load(KVLens + b)
    q0 = tl.load(QStart + b).to(tl.int64)
    k0 = tl.load(KVStart + b).to(tl.int64)
    offs_m = mblk * BLOCK_M + tl.arange(0, BLOCK_M)
    mask_m = offs_m < ext
    offs_d = tl.arange(0, BLOCK_D)
    offs_r = tl.arange(0, BLOCK_R)
    offs_v = tl.arange(0, BLOCK_DV)
    d_ok = offs_d[None, :] < D  # all true at DeepSeek's powers of two
    r_ok = offs_r[None, :] < R
    v_ok = offs_v[None, :] < DV
    q_rows = Q + (q0 + offs_m[:, None]) * stride_qt + h * stride_qh
    q_n = tl.load(q_rows + offs_d[None, :], mask=mask_m[:, None] & d_ok, other=0.0)
    q_r = tl.load(q_rows + D + offs_r[None, :], mask=mask_m[:, None] & r_ok, other=0.0)
    first_pos = kv_len - ext + mblk * BLOCK_M  # the key position of this program's first query
    q_pos = first_pos + offs_m - mblk * BLOCK_M
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    k_rows = K + h * stride_kh + offs_d[None, :]
    v_rows = V + h * stride_vh + offs_v[None, :]
    p_rows = KPE + offs_r[None, :]
    # every key before the first query is seen by all of them: whole blocks without a mask
    full_end = (first_pos // BLOCK_N) * BLOCK_N
    for n0 in range(0, full_end, BLOCK_N):
        t = k0 + n0 + tl.arange(0, BLOCK_N)
        kn = tl.load(k_rows + t[:, None] * stride_kt, mask=d_ok, other=0.0)
        kr = tl.load(p_rows + t[:, None] * stride_pt, mask=r_ok, other=0.0)
        v = tl.load(v_rows + t[:, None] * stride_vt, mask=v_ok, other=0.0)
        m_i, l_i, acc = _expanded_step(q_n, q_r, kn, kr, v, None, m_i, l_i, acc, scale_log2, DOT_FP32, False)
    end = tl.minimum(kv_len, first_pos + BLOCK_M)
    for n0 in range(full_end, end, BLOCK_N):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        mask_n = offs_n < end
        t = k0 + offs_n
        kn = tl.load(k_rows + t[:, None] * stride_kt, mask=mask_n[:, None] & d_ok, other=0.0)
        kr = tl.load(p_rows + t[:, None] * stride_pt, mask=mask_n[:, None] & r_ok, other=0.0)
        v = tl.load(v_rows + t[:, None] * stride_vt, mask=mask_n[:, None] & v_ok, other=0.0)
        visible = mask_n[None, :] & (offs_n[None, :] <= q_pos[:, None])
        m_i, l_i, acc = _expanded_step(q_n, q_r, kn, kr, v, visible, m_i, l_i, acc, scale_log2, DOT_FP32, True)
    out = acc / tl.where(l_i > 0, l_i, 1.0)[:, None]
    tl.store(Out + (q0 + offs_m[:, None]) * stride_ot + h * stride_oh + offs_v[None, :],
             out.to(Out.dtype.element_ty), mask=mask_m[:, None] & v_ok)


def mla_expanded_extend(q: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor, k_pe: torch.Tensor,
                        o: torch.Tensor, q_start: torch.Tensor, kv_start: torch.Tensor, ext_lens: torch.Tensor,
                        kv_lens: torch.Tensor, max_ext: int, sm_scale: float,
                        blocks: tuple[int, int, int, int] | None = None) -> None:
    """q [T, H, D + R] (the rotated part last); k_nope [S, H, D], v [S, H, DV] (views of kv_b_proj's output may
    be passed: any row and head strides); k_pe [S, R]; o [T, H, DV]. The integer vectors (int32 or int64) give each
    request's first query row, first key row, new tokens and keys (see the module's text). blocks: (BLOCK_M,
    BLOCK_N, warps, stages) instead of the default."""
    num_tokens, heads, qk_dim = q.shape
    d, dv, r = k_nope.shape[2], v.shape[2], k_pe.shape[1]
    if (qk_dim != d + r or k_nope.shape[1] != heads or v.shape[:2] != k_nope.shape[:2]
            or k_pe.shape[0] != k_nope.shape[0] or o.shape != (num_tokens, heads, dv)):
        raise ValueError(f"MLA expanded extend: q {tuple(q.shape)}, k_nope {tuple(k_nope.shape)}, v "
                         f"{tuple(v.shape)}, k_pe {tuple(k_pe.shape)}, o {tuple(o.shape)} do not fit together")
    for name, t in (("q", q), ("k_nope", k_nope), ("v", v), ("k_pe", k_pe), ("o", o)):
        if t.stride(-1) != 1:
            raise ValueError(f"MLA expanded extend: {name}'s last dimension must be contiguous")
    bs = ext_lens.shape[0]
    if num_tokens == 0 or bs == 0 or max_ext == 0:
        return
    from radixserve.layers.attention.triton_ops.decode_attention import is_interpreted

    interp = is_interpreted()
    block_m, block_n, warps, stages = blocks or default_blocks(q.dtype, interp, (d, r, dv))
    launch(_mla_expanded_kernel, (bs, heads, triton.cdiv(max_ext, block_m)),
           q, k_nope, v, k_pe, o, q_start, kv_start, ext_lens, kv_lens, sm_scale * LOG2E,
           q.stride(0), q.stride(1), k_nope.stride(0), k_nope.stride(1), v.stride(0), v.stride(1), k_pe.stride(0),
           o.stride(0), o.stride(1), D=d, R=r, DV=dv, BLOCK_D=_pow2(d), BLOCK_R=_pow2(r), BLOCK_DV=_pow2(dv),
           BLOCK_M=block_m, BLOCK_N=block_n,
           DOT_FP32=interp or q.dtype == torch.float32, **({} if interp else dict(num_warps=warps,
                                                                                  num_stages=stages)))


def default_blocks(dtype: torch.dtype, interpreted: bool = False, head_dims: tuple[int, int, int] = (128, 64, 128)
                   ) -> tuple[int, int, int, int]:
    """(BLOCK_M, BLOCK_N, warps, stages) on a GPU for head_dims (D, R, DV): 128 x 64, 8 warps, 3 stages won the bf16
    sweep (`benchmarks/bench_mla_prefill.py`, DeepSeek's 128, 64, 128); float32 operands take 64 x 64, 4 warps, 2
    stages, since the bf16 tiles would need 295 KB of shared memory at DeepSeek's head sizes (sm_90 gives a block at
    most 227 KB), and 64 x 32 where the padded head dims are wider than DeepSeek's (GLM-4.7-Flash's 192, 64, 256:
    64 x 64 needs 246 KB there, 64 x 32 164 KB); 16-bit tiles as `_smem_16bit` finds room (GLM-4.7-Flash: 128 x 32,
    the sweep's 128 x 64 needing 296 KB there). Chosen by those sizes, not timed."""
    if interpreted:
        return 16, 16, 1, 1
    if dtype.itemsize < 4:  # the first of these that fits
        for bm, bn, warps, stages in ((128, 64, 8, 3), (128, 32, 8, 3), (64, 32, 4, 2)):
            if _smem_16bit(bm, bn, stages, head_dims) <= _SMEM_BUDGET:
                return bm, bn, warps, stages
        return 64, 32, 4, 2
    wide = sum(_pow2(n) for n in head_dims) > 320
    return (64, 32, 4, 2) if wide else (64, 64, 4, 2)


_SMEM_BUDGET = 220 * 1024  # sm_90 gives a block 227 KB


def _smem_16bit(bm: int, bn: int, stages: int, head_dims: tuple[int, int, int]) -> int:
    """Shared memory of the kernel's 16-bit tiles: `stages` buffers of the K / k_pe / V tiles and the Q tile (the
    H100's launch of 128 x 64, 3 stages at GLM-4.7-Flash's heads asked for exactly this, 303,104 bytes)."""
    d, r, dv = (_pow2(n) for n in head_dims)
    return 2 * (stages * bn * (d + r + dv) + bm * (d + r))


def _pow2(n: int) -> int:
    return max(16, triton.next_power_of_2(n))


def mla_expanded_extend_torch(q: torch.Tensor, k_nope: torch.Tensor, v: torch.Tensor, k_pe: torch.Tensor,
                              q_start: list[int], kv_start: list[int], ext_lens: list[int], kv_lens: list[int],
                              sm_scale: float) -> torch.Tensor:
    """The reference: each request's queries against its keys, causal at the queries' key positions; [T, H, DV]."""
    heads, r = k_nope.shape[1], k_pe.shape[1]
    out = torch.zeros(q.shape[0], heads, v.shape[2], dtype=q.dtype, device=q.device)
    for qs, ks, e, n in zip(q_start, kv_start, ext_lens, kv_lens, strict=True):
        qq = q[qs:qs + e].float()
        k = torch.cat([k_nope[ks:ks + n], k_pe[ks:ks + n, None, :].expand(n, heads, r)], dim=-1).float()
        scores = torch.einsum("qhd,khd->hqk", qq, k) * sm_scale
        visible = torch.arange(n, device=q.device)[None, :] <= (n - e + torch.arange(e, device=q.device))[:, None]
        p = scores.masked_fill(~visible, float("-inf")).softmax(dim=-1)
        out[qs:qs + e] = torch.einsum("hqk,khd->qhd", p, v[ks:ks + n].float()).to(q.dtype)
    return out


# Rates the two forms ran at on an H200 (bf16; benchmarks/bench_mla_prefill.py): the latent-form kernel's FLOP/s,
# this kernel's, and the key expansion's (a plain GEMM). They only decide between the forms, so rough is enough.
LATENT_FLOPS, EXPANDED_FLOPS, GEMM_FLOPS = 80e12, 250e12, 500e12


def expanded_pays(ext_lens: list[int], prefix_lens: list[int], heads: int, latent: int, rope: int, nope: int,
                  v_dim: int) -> bool:
    """Whether a batch of these new-token and prefix lengths is cheaper in the expanded form (its keys expanded
    through kv_b_proj, plain attention) than in the latent one (queries and outputs absorbed, attention on the
    latent): a prefill of fresh prompts is, a few new tokens on a long cached prefix are not."""
    pairs = sum(e * (p + (e + 1) / 2) for e, p in zip(ext_lens, prefix_lens, strict=True))
    keys = sum(ext_lens) + sum(prefix_lens)
    tokens = sum(ext_lens)
    latent_s = (pairs * heads * 2 * (2 * latent + rope) / LATENT_FLOPS
                + tokens * heads * 2 * latent * (nope + v_dim) / GEMM_FLOPS)
    expanded_s = (pairs * heads * 2 * (nope + rope + v_dim) / EXPANDED_FLOPS
                  + keys * heads * 2 * latent * (nope + v_dim) / GEMM_FLOPS)
    return expanded_s < latent_s
