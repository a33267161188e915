"""The two GGUF formats kept packed on the device, in torch: conversion from/to llama.cpp's block bytes, online
quantisation, and the dequantising reference.

- Q8_0: blocks of 32 weights: an fp16 scale d and 32 int8 q; w = d * q (34 bytes / 32 weights).
- Q4_K: super-blocks of 256 weights: fp16 d and dmin, eight 6-bit (scale, min) pairs packed in 12 bytes, and 128
  bytes of 4-bit q; sub-block j of 32 weights is w = d * sc_j * q - dmin * m_j (144 bytes / 256 weights). In each
  64-weight chunk c, byte 32c + l holds weight 64c + l in its low nibble and weight 64c + 32 + l in its high one.

On the device a layer holds them split by field (row-major, so rows shard and stack like any weight):
Q8_0 `qweight` int8 [N, K] + `d` fp16 [N, K/32]; Q4_K `qweight` uint8 [N, K/2] (the q bytes as llama.cpp lays them
out) + `scales`, `mins` uint8 [N, K/32] (the 6-bit values unpacked) + `d`, `dmin` fp16 [N, K/256] — 4.625 bits a
weight instead of 4.5, and the kernels need no bit surgery on the scales."""

from __future__ import annotations

import torch

Q8_0, Q4_K = "Q8_0", "Q4_K"
BLOCK = {Q8_0: 32, Q4_K: 256}
TYPE_SIZE = {Q8_0: 34, Q4_K: 144}
FIELDS = {Q8_0: ("qweight", "d"), Q4_K: ("qweight", "scales", "mins", "d", "dmin")}
# columns of the full weight that one element of each field covers (along K)
FIELD_BLOCK = {"qweight": 1, "d": 32, "scales": 32, "mins": 32, "dmin": 256}
FIELD_DTYPE = {"d": torch.float16, "dmin": torch.float16, "scales": torch.uint8, "mins": torch.uint8}


def field_shape(fmt: str, field: str, n: int, k: int) -> tuple[int, int]:
    if field == "qweight":
        return (n, k) if fmt == Q8_0 else (n, k // 2)
    if field == "d" and fmt == Q4_K:
        return n, k // 256
    return n, k // FIELD_BLOCK[field]


def field_dtype(fmt: str, field: str) -> torch.dtype:
    if field == "qweight":
        return torch.int8 if fmt == Q8_0 else torch.uint8
    return FIELD_DTYPE[field]


def field_input_block(fmt: str, field: str) -> int:
    if field == "qweight":
        return 1 if fmt == Q8_0 else 2
    if field == "d" and fmt == Q4_K:
        return 256
    return FIELD_BLOCK[field]


# ---------------------------------------------------------------- llama.cpp bytes <-> fields
def from_ggml_bytes(fmt: str, raw: torch.Tensor, n: int, k: int) -> dict[str, torch.Tensor]:
    """raw uint8 [N, K / block * type_size] (one GGUF tensor's rows) -> the fields."""
    blocks = raw.reshape(n, k // BLOCK[fmt], TYPE_SIZE[fmt])
    if fmt == Q8_0:
        d = blocks[..., :2].contiguous().view(torch.float16).reshape(n, k // 32)
        q = blocks[..., 2:].contiguous().view(torch.int8).reshape(n, k)
        return {"qweight": q, "d": d}
    d = blocks[..., 0:2].contiguous().view(torch.float16).reshape(n, -1)
    dmin = blocks[..., 2:4].contiguous().view(torch.float16).reshape(n, -1)
    s = blocks[..., 4:16].to(torch.int32)  # [n, nb, 12]
    sc = torch.empty(*s.shape[:2], 8, dtype=torch.int32)
    m = torch.empty_like(sc)
    sc[..., :4] = s[..., 0:4] & 63
    m[..., :4] = s[..., 4:8] & 63
    sc[..., 4:] = (s[..., 8:12] & 0xF) | ((s[..., 0:4] >> 6) << 4)
    m[..., 4:] = (s[..., 8:12] >> 4) | ((s[..., 4:8] >> 6) << 4)
    qs = blocks[..., 16:].reshape(n, k // 2)
    return {"qweight": qs.contiguous(), "scales": sc.reshape(n, -1).to(torch.uint8),
            "mins": m.reshape(n, -1).to(torch.uint8), "d": d, "dmin": dmin}


def to_ggml_bytes(fmt: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """The fields -> raw uint8 [N, K / block * type_size], as a GGUF file stores the tensor."""
    q = f["qweight"].cpu()
    n = q.shape[0]
    if fmt == Q8_0:
        k = q.shape[1]
        d = f["d"].cpu().contiguous().view(torch.uint8).reshape(n, k // 32, 2)
        return torch.cat([d, q.view(torch.uint8).reshape(n, k // 32, 32)], dim=-1).reshape(n, -1)
    k = q.shape[1] * 2
    nb = k // 256
    sc = f["scales"].cpu().to(torch.int32).reshape(n, nb, 8)
    m = f["mins"].cpu().to(torch.int32).reshape(n, nb, 8)
    s = torch.empty(n, nb, 12, dtype=torch.int32)
    s[..., 0:4] = sc[..., :4] | ((sc[..., 4:] >> 4) << 6)
    s[..., 4:8] = m[..., :4] | ((m[..., 4:] >> 4) << 6)
    s[..., 8:12] = (sc[..., 4:] & 0xF) | ((m[..., 4:] & 0xF) << 4)
    d = f["d"].cpu().contiguous().view(torch.uint8).reshape(n, nb, 2)
    dmin = f["dmin"].cpu().contiguous().view(torch.uint8).reshape(n, nb, 2)
    return torch.cat([d, dmin, s.to(torch.uint8), q.reshape(n, nb, 128)], dim=-1).reshape(n, -1)


# ---------------------------------------------------------------- reference and online quantisation
def dequantize(fmt: str, f: dict[str, torch.Tensor]) -> torch.Tensor:
    """float32 [N, K] weight of the fields (what llama.cpp's dequantisation gives)."""
    q = f["qweight"]
    n = q.shape[0]
    if fmt == Q8_0:
        return (q.float().view(n, -1, 32) * f["d"].float()[..., None]).view(n, -1)
    k = q.shape[1] * 2
    b = q.view(n, k // 64, 32).to(torch.int32)
    vals = torch.stack([b & 0xF, b >> 4], dim=2).reshape(n, k // 32, 32).float()  # sub-block j = 2c (lo), 2c+1 (hi)
    d = f["d"].float().repeat_interleave(8, dim=1)
    dmin = f["dmin"].float().repeat_interleave(8, dim=1)
    scale = d * f["scales"].float()
    minimum = dmin * f["mins"].float()
    return (vals * scale[..., None] - minimum[..., None]).view(n, k)


def _fit_sub_blocks(g: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(scale, min) of each 32-weight sub-block g[..., 32] for w ~= scale * q - min, q in 0..15, min >= 0: 21
    candidate grids spanning the sub-block's range, each refitted by weighted least squares (weights |x| + rms, as
    in llama.cpp's make_qkx2_quants), the one with the least weighted error kept."""
    lo = g.amin(dim=-1, keepdim=True).clamp(max=0.0)
    hi = g.amax(dim=-1, keepdim=True)
    span = (hi - lo).clamp(min=1e-12)
    wt = g.pow(2).mean(dim=-1, keepdim=True).sqrt() + g.abs()
    best_err = torch.full(g.shape[:-1], float("inf"), device=g.device)
    best_scale = (span / 15.0).squeeze(-1)
    best_min = (-lo).squeeze(-1)
    sw = wt.sum(dim=-1)
    sx = (wt * g).sum(dim=-1)
    for step in range(21):
        iscale = (14.0 + 0.1 * step) / span
        q = torch.round((g - lo) * iscale).clamp(0, 15)
        sq, sqq, sqx = (wt * q).sum(-1), (wt * q * q).sum(-1), (wt * q * g).sum(-1)
        det = sw * sqq - sq * sq
        safe = torch.where(det > 0, det, 1.0)
        scale = torch.where(det > 0, (sw * sqx - sq * sx) / safe, best_scale)
        offset = torch.where(det > 0, (sqq * sx - sq * sqx) / safe, -best_min)  # w ~= scale * q + offset
        pos = offset > 0  # the format needs offset <= 0
        scale = torch.where(pos, sqx / sqq.clamp(min=1e-12), scale)
        offset = torch.where(pos, 0.0, offset)
        err = (wt * (scale[..., None] * q + offset[..., None] - g) ** 2).sum(-1)
        better = (err < best_err) & (scale > 0)
        best_err = torch.where(better, err, best_err)
        best_scale = torch.where(better, scale, best_scale)
        best_min = torch.where(better, -offset, best_min)
    return best_scale, best_min


def quantize(fmt: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
    """Online quantisation of a float weight [N, K] (K a multiple of the block) to the fields, on w's device.
    Q8_0 is llama.cpp's (amax / 127, round to nearest). Q4_K fits each 32-weight sub-block's scale and min as
    llama.cpp does (`_fit_sub_blocks`), quantises those to 6 bits against the super-block's largest, then rounds
    each weight to the nearest of its 16 levels."""
    w = w.float()
    n, k = w.shape
    if k % BLOCK[fmt]:
        raise ValueError(f"{fmt} needs rows that are a multiple of {BLOCK[fmt]} weights, got {k}")
    if fmt == Q8_0:
        g = w.view(n, k // 32, 32)
        d = (g.abs().amax(dim=-1) / 127.0).to(torch.float16)
        inv = torch.where(d.float() > 0, 1.0 / d.float(), torch.zeros_like(d.float()))
        q = torch.round(g * inv[..., None]).clamp(-127, 127).to(torch.int8).view(n, k)
        return {"qweight": q, "d": d}
    g = w.view(n, k // 256, 8, 32)
    sub_scale, sub_min = torch.empty(g.shape[:3], device=w.device), torch.empty(g.shape[:3], device=w.device)
    rows = 8192 if w.is_cuda else 1024  # bounded memory for the candidate search (~1.5 GB of temporaries on a GPU)
    for r in range(0, n, rows):
        sub_scale[r:r + rows], sub_min[r:r + rows] = _fit_sub_blocks(g[r:r + rows])
    d = (sub_scale.amax(dim=-1) / 63.0).to(torch.float16)
    dmin = (sub_min.amax(dim=-1) / 63.0).to(torch.float16)

    def six_bits(x: torch.Tensor, unit: torch.Tensor) -> torch.Tensor:
        u = unit.float()[..., None]
        return torch.where(u > 0, torch.round(x / torch.where(u > 0, u, 1.0)), 0.0).clamp(0, 63)

    sc = six_bits(sub_scale, d)
    m = six_bits(sub_min, dmin)
    step = d.float()[..., None] * sc
    offset = dmin.float()[..., None] * m
    safe_step = torch.where(step > 0, step, 1.0)[..., None]
    q = torch.where(step[..., None] > 0, torch.round((g + offset[..., None]) / safe_step), 0.0)
    q = q.clamp(0, 15).to(torch.uint8)  # [n, nb, 8, 32]
    q = q.view(n, k // 64, 2, 32)
    qs = (q[:, :, 0] | (q[:, :, 1] << 4)).reshape(n, k // 2)
    return {"qweight": qs.contiguous(), "scales": sc.to(torch.uint8).reshape(n, -1),
            "mins": m.to(torch.uint8).reshape(n, -1), "d": d, "dmin": dmin}


def quantize_to_ggml(array: object, type_name: str) -> object:
    """A float32 numpy array [N, K] as GGUF block bytes of `type_name`: the `gguf` package's own quantiser where it
    has one (Q8_0, Q4_0, Q5_0, ...), ours for Q4_K and Q6_K (which `gguf` can read but not write)."""
    if type_name == Q4_K:
        w = torch.from_numpy(array)
        return to_ggml_bytes(Q4_K, quantize(Q4_K, w)).numpy()
    if type_name == "Q6_K":
        from radixserve.layers.quantization.gguf_q6_k import quantize_q6_k

        return quantize_q6_k(torch.from_numpy(array)).numpy()
    from gguf import GGMLQuantizationType, quants

    return quants.quantize(array, GGMLQuantizationType[type_name])
