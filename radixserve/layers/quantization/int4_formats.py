"""4-bit weights with a scale and a zero point per group of input columns (GPTQ, AWQ, compressed-tensors'
pack-quantized W4A16): the checkpoints' packings and the one layout our kernels read.

Our layout, for a weight W [N, K] in groups of G columns:
- `qweight` uint8 [N, K/2]: byte c of row n holds column 2c in its low nibble and 2c + 1 in its high nibble;
- `scales` [N, K/G] (the checkpoint's float dtype) and `qzeros` uint8 [N, K/G];
- W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G].

The checkpoints (int32 words of eight 4-bit values, the lowest bits first):
- GPTQ: `qweight` [K/8, N] packed along K (word i of column n: rows 8i..8i+7), `qzeros` [K/G, N/8] packed along N,
  each stored as zero - 1 (the format's original convention; a symmetric model stores 7 for 8), `scales` [K/G, N],
  `g_idx` [K] (the group of each input column; not k // G when the model was quantised in activation order);
- AWQ (GEMM layout): `qweight` [K, N/8] and `qzeros` [K/G, N/8] packed along N in the order 0 2 4 6 1 3 5 7 (the
  word's i-th value is column 8c + AWQ_ORDER[i]), zeros stored as they are, `scales` [K/G, N];
- compressed-tensors: `weight_packed` [N, K/8] packed along K, values stored plus 8 (symmetric, zero 8),
  `weight_scale` [N, K/G].
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
_SHIFTS = torch.arange(0, 32, 4, dtype=torch.int32)


def unpack_words(words: torch.Tensor) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 8]: each word's eight 4-bit values, lowest bits first."""
    if words.dtype != torch.int32:
        raise ValueError(f"packed 4-bit weights are int32 words, got {words.dtype}")
    return ((words.unsqueeze(-1) >> _SHIFTS.to(words.device)) & 15).to(torch.uint8)


def pack_words(values: torch.Tensor) -> torch.Tensor:
    """uint8 [..., W, 8] (each < 16) -> int32 [..., W]: the inverse of `unpack_words`."""
    v = values.to(torch.int64) << _SHIFTS.to(values.device).to(torch.int64)
    word = v.sum(dim=-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values (each < 16) -> our `qweight` uint8 [N, K/2]."""
    if q.shape[-1] % 2:
        raise ValueError(f"4-bit weights need an even number of columns, got {q.shape[-1]}")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_pairs(qweight: torch.Tensor) -> torch.Tensor:
    """Our `qweight` uint8 [N, K/2] -> uint8 [N, K]."""
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(*qweight.shape[:-1], -1)


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of our layout."""
    q = unpack_pairs(qweight).float()
    group = q.shape[1] // scales.shape[1]
    z = qzeros.float().repeat_interleave(group, dim=1)
    s = scales.float().repeat_interleave(group, dim=1)
    return (q - z) * s


def dequantize_by_index(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                        g_idx: torch.Tensor) -> torch.Tensor:
    """float32 [N, K] of our layout with column k in group g_idx[k] (GPTQ's activation order), in column order."""
    q = unpack_pairs(qweight).float()
    g = g_idx.long()
    return (q - qzeros.float()[:, g]) * scales.float()[:, g]


# ---------------------------------------------------------------- checkpoint packings -> ours (whole tensors)
def gptq_qweight(words: torch.Tensor) -> torch.Tensor:
    """GPTQ `qweight` int32 [K/8, N] -> ours [N, K/2]."""
    vals = unpack_words(words.t().contiguous())  # [N, K/8, 8]: column n's words, each eight rows
    return pack_pairs(vals.reshape(vals.shape[0], -1))


def gptq_qzeros(words: torch.Tensor) -> torch.Tensor:
    """GPTQ `qzeros` int32 [K/G, N/8] (zero - 1 stored) -> ours uint8 [N, K/G]."""
    vals = unpack_words(words).reshape(words.shape[0], -1)  # [K/G, N]
    return (vals + 1).t().contiguous()


def awq_columns(words: torch.Tensor) -> torch.Tensor:
    """AWQ words [R, N/8] -> uint8 [R, N] in column order."""
    vals = unpack_words(words)  # [R, N/8, 8], value i of a word is column 8c + AWQ_ORDER[i]
    out = torch.empty_like(vals)
    out[..., list(AWQ_ORDER)] = vals
    return out.reshape(words.shape[0], -1)


def awq_qweight(words: torch.Tensor) -> torch.Tensor:
    """AWQ `qweight` int32 [K, N/8] -> ours [N, K/2]."""
    return pack_pairs(awq_columns(words).t().contiguous())


def awq_qzeros(words: torch.Tensor) -> torch.Tensor:
    """AWQ `qzeros` int32 [K/G, N/8] -> ours uint8 [N, K/G]."""
    return awq_columns(words).t().contiguous()


def ct_weight_packed(words: torch.Tensor) -> torch.Tensor:
    """compressed-tensors `weight_packed` int32 [N, K/8] (values + 8) -> ours [N, K/2] (zero 8)."""
    vals = unpack_words(words)  # [N, K/8, 8]
    return pack_pairs(vals.reshape(words.shape[0], -1))


def group_transpose(t: torch.Tensor) -> torch.Tensor:
    """A checkpoint's per-group [K/G, N] tensor (GPTQ / AWQ scales) -> ours [N, K/G]."""
    return t.t().contiguous()
