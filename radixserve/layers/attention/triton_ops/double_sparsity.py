"""Double-sparsity decode kernels: score every cached token on a few "heavy" channels, keep the best tokens, attend
exactly over them.

The label cache holds, for every KV slot and KV head, the key's values on that head's heavy channels (a few of
head_dim). `ds_score_fwd` launches one program per (request, block of BLOCK_N positions): it reads the positions'
slots through req_to_token and their label rows (all KV heads: one contiguous row per token), and multiplies them
(tl.dot) with a block-diagonal matrix of the query's values on the same channels (the q labels, gathered from q by
the kernel), which gives q-label . k-label for every query head against its own KV head. A position's score
for a KV head is the largest over the query heads that share it (a token stays if any head of the group would look
at it). Positions at or past
a request's seq_len score -inf, so `torch.topk` over the row never picks them while real tokens remain.

`ds_sparse_decode_fwd` is the split-KV decode of `decode_attention.py` over a list of positions instead of a range:
a request whose seq_len is at most `dense_len` attends over all its positions (the dense fallback for short
contexts, in the same launch), any other request over the `top_k` positions selected for each KV head. Its second
stage is the dense decode's merge kernel, fed with each request's count of attended positions.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.attention.triton_ops.common import (
    LOG2E,
    decode_head_block,
    decode_splits,
    head_dims,
    mma,
    store_decode_partial,
)
from radixserve.layers.attention.triton_ops.decode_attention import (
    _block_h,
    _decode_stage2_kernel,
    is_interpreted,
    split_capacity,
)
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue

# Programmatic dependent launch for the sparse decode's chain of short kernels (score, the top-k's rounds and select,
# the two attention stages: each a few microseconds, so launch latency is a large share): level 1, each kernel waits
# for the one before to finish (triton_ops/pdl.py), only its launch overlaps. None: RADIXSERVE_PDL decides.
PDL_LEVEL: int | None = 1


@triton.jit(do_not_specialize=["n_cols", "keep_first", "keep_last"])
def _ds_score_kernel(
    Q, Q_channels, Labels, Req_to_token, Req_pool_indices, Seq_lens, Scores, n_cols, keep_first, keep_last,
    stride_qb, stride_qh,
    stride_ch,
    stride_lt,
    stride_r2t,
    stride_sb, stride_sh,
    NUM_KV_HEADS: tl.constexpr,
    GROUP: tl.constexpr,
    CHANNELS: tl.constexpr,
    KV_PAD: tl.constexpr,
    G_PAD: tl.constexpr,
    BLOCK_K: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    offs_n = tl.program_id(1) * BLOCK_N + tl.arange(0, BLOCK_N)
    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    mask_n = offs_n < seq_len
    row = tl.load(Req_pool_indices + b).to(tl.int64)
    loc = tl.load(Req_to_token + row * stride_r2t + offs_n, mask=mask_n, other=0).to(tl.int64)
    offs_k = tl.arange(0, BLOCK_K)
    ROW: tl.constexpr = NUM_KV_HEADS * CHANNELS
    # every KV head's labels of a token are one contiguous row of ROW = Hkv * C values
    kl = tl.load(Labels + loc[:, None] * stride_lt + offs_k[None, :],
                 mask=mask_n[:, None] & (offs_k[None, :] < ROW), other=0.0)  # [N, K]
    # the block-diagonal matrix of the query's heavy channels, gathered from q here: column j is query head
    # j % G_PAD of KV head j // G_PAD, which holds its values on its channels at rows kv * C .. kv * C + C - 1
    offs_j = tl.arange(0, KV_PAD * G_PAD)
    kv, g = offs_j // G_PAD, offs_j % G_PAD
    head = kv * GROUP + g
    c = offs_k[:, None] - kv[None, :] * CHANNELS
    real = (g < GROUP) & (kv < NUM_KV_HEADS)
    on = (c >= 0) & (c < CHANNELS) & real[None, :]
    ch = tl.load(Q_channels + head[None, :] * stride_ch + c, mask=on, other=0)
    qb = tl.load(Q + b.to(tl.int64) * stride_qb + head[None, :] * stride_qh + ch, mask=on, other=0.0)  # [K, J]
    s = mma(kl, qb.to(kl.dtype), DOT_FP32)  # [N, J]: q_label . k_label of each (KV head, query head of the group)
    s = tl.where(real[None, :], s, float("-inf"))
    best = tl.max(tl.reshape(s, (BLOCK_N, KV_PAD, G_PAD)), axis=2)  # [N, KV_PAD]: the group's best
    kept = (offs_n < keep_first) | (offs_n >= seq_len - keep_last)  # always selected: +inf
    best = tl.where(kept[:, None], float("inf"), best)
    best = tl.where(mask_n[:, None], best, float("-inf"))
    offs_h = tl.arange(0, KV_PAD)
    tl.store(Scores + b.to(tl.int64) * stride_sb + offs_h[None, :] * stride_sh + offs_n[:, None], best,
             mask=(offs_n[:, None] < n_cols) & (offs_h[None, :] < NUM_KV_HEADS))


@triton.jit(do_not_specialize=["num_kv_splits", "min_split_len", "dense_len", "top_k"])
def _ds_sparse_stage1_kernel(
    Q, K_Buf, V_Buf, Req_to_token, Req_pool_indices, Seq_lens, TopIdx, Mid_O, Mid_LSE,
    sm_scale_log2, v_scale, num_kv_splits, min_split_len, dense_len, top_k,
    stride_qb, stride_qh,
    stride_kt, stride_kh,
    stride_vt, stride_vh,
    stride_r2t,
    stride_ib, stride_ih,
    stride_mob, stride_moh, stride_mos,
    stride_mlb, stride_mlh,
    GROUP: tl.constexpr,
    HEAD_BLOCKS: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    BLOCK_D: tl.constexpr,
    BLOCK_H: tl.constexpr,
    BLOCK_N: tl.constexpr,
    DOT_FP32: tl.constexpr,
    PDL: tl.constexpr = 0,
):
    pdl_prologue(PDL)
    b = tl.program_id(0)
    split = tl.program_id(2)
    kv_head, heads, mask_h = decode_head_block(tl.program_id(1), GROUP, HEAD_BLOCKS, BLOCK_H)
    offs_d, mask_d = head_dims(HEAD_DIM, BLOCK_D)

    seq_len = tl.load(Seq_lens + b).to(tl.int32)
    is_sparse = seq_len > dense_len
    count = tl.where(is_sparse, top_k, seq_len)  # positions this request attends over
    _, chunk, _ = decode_splits(count, 0, num_kv_splits, min_split_len, BLOCK_N)
    start = split * chunk
    end = tl.minimum(start + chunk, count)

    pick_end = tl.where(is_sparse, end, start)  # where the position list is read (nowhere for a dense request)
    if start < end:
        row = tl.load(Req_pool_indices + b).to(tl.int64)
        idx_base = TopIdx + b.to(tl.int64) * stride_ib + kv_head * stride_ih
        q = tl.load(Q + b.to(tl.int64) * stride_qb + heads[:, None] * stride_qh + offs_d[None, :],
                    mask=mask_h[:, None] & mask_d[None, :], other=0.0)
        m_i = tl.full([BLOCK_H], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_H], dtype=tl.float32)
        acc = tl.zeros([BLOCK_H, BLOCK_D], dtype=tl.float32)
        for n0 in range(start, end, BLOCK_N):
            offs_n = n0 + tl.arange(0, BLOCK_N)
            mask_n = offs_n < end
            picked = tl.load(idx_base + offs_n, mask=offs_n < pick_end, other=0)
            pos = tl.where(is_sparse, picked.to(tl.int32), offs_n)
            mask_n = mask_n & (pos < seq_len)  # top-k over a row shorter than K also picks -inf padding
            loc = tl.load(Req_to_token + row * stride_r2t + pos, mask=mask_n, other=0).to(tl.int64)
            mask_kv = mask_n[:, None] & mask_d[None, :]
            k = tl.load(K_Buf + loc[:, None] * stride_kt + kv_head * stride_kh + offs_d[None, :],
                        mask=mask_kv, other=0.0)
            qk = mma(q, tl.trans(k), DOT_FP32)
            qk = tl.where(mask_n[None, :], qk * sm_scale_log2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(qk, axis=1))
            m_new = tl.where(m_new == float("-inf"), 0.0, m_new)  # a block of padding picks only: no NaN
            alpha = tl.exp2(m_i - m_new)
            p = tl.exp2(qk - m_new[:, None])
            l_i = l_i * alpha + tl.sum(p, axis=1)
            v = tl.load(V_Buf + loc[:, None] * stride_vt + kv_head * stride_vh + offs_d[None, :],
                        mask=mask_kv, other=0.0)
            acc = acc * alpha[:, None] + mma(p.to(q.dtype), v, DOT_FP32)
            m_i = m_new

        # a split of padding picks only has l_i = 0: it writes zeros that the merge gives no weight
        store_decode_partial(Mid_O, Mid_LSE, b, heads, split, offs_d, mask_h, mask_d, acc, m_i, l_i, v_scale,
                             stride_mob, stride_moh, stride_mos, stride_mlb, stride_mlh)


def score_layout(num_heads: int, num_kv_heads: int, channels: int) -> tuple[int, int, int]:
    """(KV_PAD, G_PAD, BLOCK_K) of the scoring kernel: padded KV heads x padded group >= 16 columns for tl.dot, and
    the padded label row (Hkv * C values)."""
    kv_pad = triton.next_power_of_2(num_kv_heads)
    g_pad = max(triton.next_power_of_2(num_heads // num_kv_heads), triton.cdiv(16, kv_pad))
    return kv_pad, g_pad, max(16, triton.next_power_of_2(num_kv_heads * channels))


def ds_score_fwd(q: torch.Tensor, labels: torch.Tensor, req_to_token: torch.Tensor,
                 req_pool_indices: torch.Tensor, seq_lens: torch.Tensor, scores: torch.Tensor,
                 keep_first: int = 0, keep_last: int = 0, block_n: int | None = None,
                 q_channels: torch.Tensor | None = None) -> None:
    """scores[b, g, p] = max over the query heads h of KV head g of q_label[b, h] . labels[slot of position p of
    request b, g], for p < seq_lens[b]; -inf for seq_lens[b] <= p < scores.shape[2]. The first `keep_first` and the
    last `keep_last` positions of each request score +inf (a top-k always keeps them).

    q_label[b, h, c] = q[b, h, q_channels[h, c]]: q [bs, H, D] with q_channels [H, C] (the heavy channels of each
    query head, gathered in the kernel), or q is the q_label [bs, H, C] itself when q_channels is None.
    labels: [slots, Hkv, C] (contiguous rows); scores: [bs, Hkv, n_cols] float32 (written in place).
    One program scores BLOCK_N positions of a request for all its KV heads."""
    if q.dim() != 3 or labels.dim() != 3 or scores.dim() != 3:
        raise ValueError(f"q [bs, H, D], labels [slots, Hkv, C] and scores [bs, Hkv, L] expected; got "
                         f"{tuple(q.shape)}, {tuple(labels.shape)}, {tuple(scores.shape)}")
    bs, num_heads = q.shape[:2]
    num_kv_heads, channels = labels.shape[1:]
    if q_channels is None:
        if q.shape[2] != channels:
            raise ValueError(f"q_label {tuple(q.shape)} and labels {tuple(labels.shape)} differ in channels")
        q_channels = torch.arange(channels, device=q.device).expand(num_heads, channels)
    if tuple(q_channels.shape) != (num_heads, channels) or q_channels.stride(1) != 1 and channels > 1:
        raise ValueError(f"q_channels must be [H, C] = [{num_heads}, {channels}] with unit column stride; got "
                         f"{tuple(q_channels.shape)}")
    if num_heads % num_kv_heads or tuple(scores.shape[:2]) != (bs, num_kv_heads) or q.stride(2) != 1:
        raise ValueError(f"shapes disagree: q {tuple(q.shape)}, labels {tuple(labels.shape)}, scores "
                         f"{tuple(scores.shape)} (q needs a unit last stride)")
    if scores.dtype != torch.float32 or scores.stride(-1) != 1 or labels.stride(2) != 1 \
            or labels.stride(1) != channels:
        raise ValueError("scores must be float32 with a unit last stride, labels rows contiguous")
    n_cols = scores.shape[2]
    if bs == 0 or n_cols == 0:
        return
    kv_pad, g_pad, block_k = score_layout(num_heads, num_kv_heads, channels)
    interp = is_interpreted()
    if block_n is None:
        block_n = 32 if interp else 128
    grid = (bs, triton.cdiv(n_cols, block_n))
    launch(_ds_score_kernel, grid,
        q, q_channels, labels, req_to_token, req_pool_indices, seq_lens, scores, n_cols, keep_first, keep_last,
        q.stride(0), q.stride(1),
        q_channels.stride(0),
        labels.stride(0),
        req_to_token.stride(0),
        scores.stride(0), scores.stride(1),
        NUM_KV_HEADS=num_kv_heads, GROUP=num_heads // num_kv_heads, CHANNELS=channels, KV_PAD=kv_pad, G_PAD=g_pad,
        BLOCK_K=block_k, BLOCK_N=block_n, DOT_FP32=interp or labels.dtype == torch.float32,
        num_warps=4, num_stages=2, **pdl.launch_opts(q, PDL_LEVEL),
    )


def topk_positions(scores: torch.Tensor, k: int, chunks: int = 1) -> torch.Tensor:
    """Positions [..., k] of the k best scores of each row of scores [..., L], in no particular order. With chunks > 1
    each row is cut into `chunks` pieces, the best k of every piece are taken first and the best k of those after:
    the same positions (up to ties), from more and shorter rows, which suits torch.topk better on long rows."""
    n = scores.shape[-1]
    if chunks <= 1 or n < 2 * chunks * k:
        return scores.topk(k, dim=-1, sorted=False).indices
    width = n // chunks
    body = scores[..., :width * chunks].unflatten(-1, (chunks, width))
    values, idx = body.topk(k, dim=-1, sorted=False)  # [..., chunks, k]
    idx = idx + torch.arange(0, width * chunks, width, device=scores.device).unsqueeze(-1)
    values, idx = values.flatten(-2), idx.flatten(-2)
    if width * chunks < n:  # the remainder joins the candidates whole
        tail = torch.arange(width * chunks, n, device=scores.device).expand(*scores.shape[:-1], -1)
        values = torch.cat([values, scores[..., width * chunks:]], dim=-1)
        idx = torch.cat([idx, tail], dim=-1)
    return idx.gather(-1, values.topk(k, dim=-1, sorted=False).indices)


def ds_sparse_decode_fwd(
    q: torch.Tensor,
    k_buffer: torch.Tensor,
    v_buffer: torch.Tensor,
    o: torch.Tensor,
    req_to_token: torch.Tensor,
    req_pool_indices: torch.Tensor,
    seq_lens: torch.Tensor,
    top_idx: torch.Tensor,
    dense_len: int,
    mid_o: torch.Tensor,
    mid_lse: torch.Tensor,
    sm_scale: float,
    num_kv_splits: int,
    min_split_len: int = 64,
    block_n: int | None = None,
    k_scale: float = 1.0,
    v_scale: float = 1.0,
) -> None:
    """Decode attention of one query per request: over positions 0..seq_len-1 where seq_len <= dense_len, else over
    the top_idx.shape[2] positions top_idx[b, g] for each KV head g (all distinct; those at or past seq_len, which
    top-k over a padded row picks when seq_len < K, are skipped). Writes o.

    q, o: [bs, H, D]; k/v_buffer: [slots, Hkv, D]; top_idx: [bs, Hkv, K] int32/int64 (rows of dense requests are not
    read); mid_o [bs, H, S, D] / mid_lse [bs, H, S] float32 scratch, S >= num_kv_splits."""
    if q.dim() != 3 or top_idx.dim() != 3 or o.shape != q.shape:
        raise ValueError(f"q/o [bs, H, D] and top_idx [bs, Hkv, K] expected; got {tuple(q.shape)}, "
                         f"{tuple(o.shape)}, {tuple(top_idx.shape)}")
    bs, num_heads, head_dim = q.shape
    num_kv_heads = k_buffer.shape[1]
    top_k = top_idx.shape[2]
    if tuple(top_idx.shape[:2]) != (bs, num_kv_heads) or num_heads % num_kv_heads:
        raise ValueError(f"top_idx {tuple(top_idx.shape)} does not fit q {tuple(q.shape)} and "
                         f"{num_kv_heads} KV heads")
    if dense_len < 0 or top_k < 1:
        raise ValueError(f"dense_len must be >= 0 and at least one token selected; got {dense_len}, {top_k}")
    if num_kv_splits < 1 or mid_lse.shape[-1] < num_kv_splits or mid_o.shape[:3] != mid_lse.shape:
        raise ValueError("partial buffers must have at least num_kv_splits (>= 1) split slots")
    if bs == 0:
        return
    group = num_heads // num_kv_heads
    interp = is_interpreted()
    if k_buffer.dtype not in (torch.float8_e4m3fn, torch.float8_e5m2):
        k_scale = v_scale = 1.0
    block_d = max(16, triton.next_power_of_2(head_dim))
    block_h = _block_h(group, True)
    head_blocks = triton.cdiv(group, block_h)
    if block_n is None:
        block_n = 32 if interp else 64
    dot_fp32 = interp or q.dtype == torch.float32
    launch(_ds_sparse_stage1_kernel, (bs, num_kv_heads * head_blocks, num_kv_splits),
        q, k_buffer, v_buffer, req_to_token, req_pool_indices, seq_lens, top_idx, mid_o, mid_lse,
        sm_scale * k_scale * LOG2E, v_scale, num_kv_splits, min_split_len, dense_len, top_k,
        q.stride(0), q.stride(1),
        k_buffer.stride(0), k_buffer.stride(1),
        v_buffer.stride(0), v_buffer.stride(1),
        req_to_token.stride(0),
        top_idx.stride(0), top_idx.stride(1),
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        GROUP=group, HEAD_BLOCKS=head_blocks, HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_H=block_h,
        BLOCK_N=block_n, DOT_FP32=dot_fp32, num_warps=4 if head_dim <= 128 else 8, num_stages=2,
        **pdl.launch_opts(q, PDL_LEVEL),
    )
    # the merge recomputes the same split boundaries from each request's attended count (SPARSE: from seq_lens)
    launch(_decode_stage2_kernel, (bs, num_heads),
        mid_o, mid_lse, o, seq_lens, mid_lse,  # (no sinks: a stand-in pointer)
        num_kv_splits, min_split_len, 0, dense_len, top_k,
        mid_o.stride(0), mid_o.stride(1), mid_o.stride(2),
        mid_lse.stride(0), mid_lse.stride(1),
        o.stride(0), o.stride(1),
        HEAD_DIM=head_dim, BLOCK_D=block_d, BLOCK_N=block_n, SPLIT_BLOCK=1, SPARSE=1, num_warps=4, num_stages=1,
        **pdl.launch_opts(q, PDL_LEVEL),
    )


__all__ = ["ds_score_fwd", "ds_sparse_decode_fwd", "split_capacity", "topk_positions"]
