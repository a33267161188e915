"""4- and 8-bit integer weights with a scale and a zero point per group of input columns (GPTQ, AWQ,
compressed-tensors' pack-quantized W4A16 / W8A16): the checkpoints' packings and the one layout our kernels read.

Our layout, for a weight W [N, K] in groups of G columns:
- `qweight` uint8: 4 bits [N, K/2], byte c of row n holding column 2c in its low nibble and 2c + 1 in its high
  nibble; 8 bits [N, K], a byte a value;
- `scales` [N, K/G] (the checkpoint's float dtype) and `qzeros` uint8 [N, K/G];
- W[n, k] = (q[n, k] - zero[n, k // G]) * scale[n, k // G].

The checkpoints (int32 words of 32 / bits values, the lowest bits first; the shapes below for 4 bits):
- GPTQ: `qweight` [K/8, N] packed along K (word i of column n: rows 8i..8i+7), `qzeros` [K/G, N/8] packed along N,
  each stored as zero - 1 (the format's original convention; a symmetric model stores 7 for 8, gptq_v2 the zero
  itself), `scales` [K/G, N], `g_idx` [K] (the group of each input column; not k // G when the model was
  quantised in activation order);
- AWQ (GEMM layout): `qweight` [K, N/8] and `qzeros` [K/G, N/8] packed along N in the order 0 2 4 6 1 3 5 7 (the
  word's i-th value is column 8c + AWQ_ORDER[i]), zeros stored as they are, `scales` [K/G, N]; 4 bits only;
- compressed-tensors: `weight_packed` [N, K/8] packed along K, values stored plus 8 (symmetric, zero 8; 8 bits:
  plus 128), `weight_scale` [N, K/G].
"""

from __future__ import annotations

import torch

AWQ_ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
BITS = (4, 8)


def _check_bits(bits: int) -> None:
    if bits not in BITS:
        raise ValueError(f"integer weights of {bits} bits are not supported (4 or 8)")


def unpack_words(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """int32 [..., W] -> uint8 [..., W, 32 / bits]: each word's values, lowest bits first."""
    _check_bits(bits)
    if words.dtype != torch.int32:
        raise ValueError(f"packed {bits}-bit weights are int32 words, got {words.dtype}")
    shifts = torch.arange(0, 32, bits, dtype=torch.int32, device=words.device)
    return ((words.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)).to(torch.uint8)


def pack_words(values: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """uint8 [..., W, 32 / bits] (each < 2^bits) -> int32 [..., W]: the inverse of `unpack_words`."""
    _check_bits(bits)
    shifts = torch.arange(0, 32, bits, dtype=torch.int64, device=values.device)
    word = (values.to(torch.int64) << shifts).sum(dim=-1)
    return torch.where(word >= 1 << 31, word - (1 << 32), word).to(torch.int32)


def pack_pairs(q: torch.Tensor) -> torch.Tensor:
    """uint8 [N, K] values (each < 16) -> our 4-bit `qweight` uint8 [N, K/2]."""
    if q.shape[-1] % 2:
        raise ValueError(f"4-bit weights need an even number of columns, got {q.shape[-1]}")
    return (q[..., 0::2] | (q[..., 1::2] << 4)).contiguous()


def unpack_pairs(qweight: torch.Tensor) -> torch.Tensor:
    """Our 4-bit `qweight` uint8 [N, K/2] -> uint8 [N, K]."""
    return torch.stack([qweight & 15, qweight >> 4], dim=-1).reshape(*qweight.shape[:-1], -1)


def to_layout(q: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 values [N, K] -> our `qweight` ([N, K/2] for 4 bits, [N, K] for 8)."""
    _check_bits(bits)
    return pack_pairs(q) if bits == 4 else q.to(torch.uint8).contiguous()


def values_of(qweight: torch.Tensor, bits: int) -> torch.Tensor:
    """Our `qweight` -> uint8 values [N, K]."""
    _check_bits(bits)
    return unpack_pairs(qweight) if bits == 4 else qweight


def dequantize(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """float32 [N, K] of our layout."""
    q = values_of(qweight, bits).float()
    group = q.shape[1] // scales.shape[1]
    z = qzeros.float().repeat_interleave(group, dim=1)
    s = scales.float().repeat_interleave(group, dim=1)
    return (q - z) * s


def dequantize_by_index(qweight: torch.Tensor, scales: torch.Tensor, qzeros: torch.Tensor,
                        g_idx: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """float32 [N, K] of our layout with column k in group g_idx[k] (GPTQ's activation order), in column order."""
    q = values_of(qweight, bits).float()
    g = g_idx.long()
    return (q - qzeros.float()[:, g]) * scales.float()[:, g]


# ---------------------------------------------------------------- checkpoint packings -> ours (whole tensors)
def gptq_qweight(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """GPTQ `qweight` int32 [K * bits / 32, N] -> ours."""
    vals = unpack_words(words.t().contiguous(), bits)  # [N, K*bits/32, 32/bits]: column n's words
    return to_layout(vals.reshape(vals.shape[0], -1), bits)


def gptq_qzeros(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """GPTQ `qzeros` int32 [K/G, N * bits / 32] (zero - 1 stored) -> ours uint8 [N, K/G] (an 8-bit zero of 256
    cannot be held: refused)."""
    vals = unpack_words(words, bits).reshape(words.shape[0], -1).to(torch.int32) + 1  # [K/G, N]
    if bits == 8 and bool((vals > 255).any()):
        raise ValueError("gptq 8-bit zero point 256 cannot be represented")
    return vals.to(torch.uint8).t().contiguous()


def gptq_v2_qzeros(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """gptq_v2 `qzeros` (zeros stored as they are) -> ours uint8 [N, K/G]."""
    return unpack_words(words, bits).reshape(words.shape[0], -1).t().contiguous()


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


def ct_weight_packed(words: torch.Tensor, bits: int = 4) -> torch.Tensor:
    """compressed-tensors `weight_packed` int32 [N, K * bits / 32] (values + 2^(bits-1)) -> ours (zero
    2^(bits-1))."""
    vals = unpack_words(words, bits)  # [N, K*bits/32, 32/bits]
    return to_layout(vals.reshape(words.shape[0], -1), bits)


def group_transpose(t: torch.Tensor) -> torch.Tensor:
    """A checkpoint's per-group [K/G, N] tensor (GPTQ / AWQ scales) -> ours [N, K/G]."""
    return t.t().contiguous()
