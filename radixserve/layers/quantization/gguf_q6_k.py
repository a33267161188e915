"""Q6_K, written (not served packed): the format llama.cpp's Q4_K_M mix gives to some attn_v / ffn_down tensors and
to the output matrix. The `gguf` package reads Q6_K but cannot write it, so the writer (`gguf_writer`) uses this.

A super-block of 256 weights: 16 sub-blocks of 16, each with a signed 8-bit scale, one fp16 d, and 6-bit q in
0..63: w = d * scale_j * (q - 32). 210 bytes: the low 4 bits of q (128 bytes), their high 2 bits (64 bytes), the 16
scales, d. Each sub-block's scale is fitted as llama.cpp does (the largest-magnitude weight sets the grid, 19
neighbouring grids are tried and the one with the least squared error, weighted by x^2, kept); the scales are then
rounded to 8 bits against the super-block's largest, and every weight to the nearest of its 64 levels."""

from __future__ import annotations

import torch

BLOCK = 256
TYPE_SIZE = 210


def _fit_scales(x: torch.Tensor, nmax: int = 32) -> torch.Tensor:
    """Scale of each row of x[..., 16] for x ~= scale * l, l in -nmax..nmax-1 (0 for an all-zero row)."""
    ax = x.abs()
    idx = ax.argmax(dim=-1, keepdim=True)
    top = torch.gather(x, -1, idx)  # the signed value of largest magnitude
    zero = top.abs() < 1e-15
    safe_top = torch.where(zero, torch.ones_like(top), top)
    w = x * x
    best_scale = torch.zeros_like(top.squeeze(-1))
    best = torch.full_like(best_scale, -1.0)
    for step in [0, *range(-9, 0), *range(1, 10)]:
        iscale = -(nmax + 0.1 * step) / safe_top
        lv = torch.round(iscale * x).clamp(-nmax, nmax - 1)
        sumlx = (w * x * lv).sum(-1)
        suml2 = (w * lv * lv).sum(-1)
        ok = suml2 > 0
        score = torch.where(ok, sumlx * sumlx / torch.where(ok, suml2, 1.0), -1.0)
        take = score > best if step else torch.ones_like(ok)
        best = torch.where(take, score, best)
        best_scale = torch.where(take, torch.where(ok, sumlx / torch.where(ok, suml2, 1.0), 0.0), best_scale)
    return torch.where(zero.squeeze(-1), 0.0, best_scale)


def quantize_q6_k(w: torch.Tensor) -> torch.Tensor:
    """float [N, K] (K a multiple of 256) -> uint8 [N, K / 256 * 210], llama.cpp's Q6_K block bytes."""
    w = w.float()
    n, k = w.shape
    if k % BLOCK:
        raise ValueError(f"Q6_K needs rows that are a multiple of {BLOCK} weights, got {k}")
    nb = k // BLOCK
    x = w.view(n, nb, 16, 16)
    scales = _fit_scales(x)  # [n, nb, 16]
    pick = scales.abs().argmax(dim=-1, keepdim=True)
    max_scale = torch.gather(scales, -1, pick).squeeze(-1)  # signed, largest magnitude
    empty = max_scale.abs() < 1e-15
    iscale = torch.where(empty, 0.0, -128.0 / torch.where(empty, 1.0, max_scale))
    d = torch.where(empty, 0.0, 1.0 / torch.where(empty, 1.0, iscale)).to(torch.float16)
    sc = torch.round(iscale[..., None] * scales).clamp(max=127).clamp(min=-128).to(torch.int8)
    step = d.float()[..., None] * sc.float()  # [n, nb, 16]
    safe = torch.where(step == 0, 1.0, step)[..., None]
    q = torch.where(step[..., None] == 0, 0.0, torch.round(x / safe).clamp(-32, 31)) + 32
    q = q.to(torch.int32).view(n, nb, 2, 4, 32)  # [half, quarter, l]: weight 128 * half + 32 * quarter + l
    ql = torch.cat([q[:, :, :, 0] & 0xF | ((q[:, :, :, 2] & 0xF) << 4),
                    q[:, :, :, 1] & 0xF | ((q[:, :, :, 3] & 0xF) << 4)], dim=-1)  # [n, nb, 2, 64]
    qh = (q[:, :, :, 0] >> 4) | ((q[:, :, :, 1] >> 4) << 2) | ((q[:, :, :, 2] >> 4) << 4) | ((q[:, :, :, 3] >> 4) << 6)
    parts = [ql.reshape(n, nb, 128).to(torch.uint8), qh.reshape(n, nb, 64).to(torch.uint8),
             sc.view(torch.uint8).reshape(n, nb, 16), d.contiguous().view(torch.uint8).reshape(n, nb, 2)]
    return torch.cat(parts, dim=-1).reshape(n, nb * TYPE_SIZE)
