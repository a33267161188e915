"""Write one layer's new K and V rows into the KV pool at their slots, both in one kernel (cast to the pool dtype;
for an fp8 pool divided by the layer's k/v scale and saturated first)."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.triton_ops.launch import launch


@triton.jit
def fp8_saturate(x, inv_scale, FMAX: tl.constexpr):
    """x / scale in float32, clamped to the fp8 format's finite range (the cast alone would overflow to NaN)."""
    return tl.minimum(tl.maximum(x.to(tl.float32) * inv_scale, -FMAX), FMAX)


@triton.jit
def _kv_store_kernel(K, V, KBuf, VBuf, Loc, stride_k, stride_v, stride_kb, stride_vb, width, k_inv, v_inv,
                     BLOCK: tl.constexpr, FP8_MAX: tl.constexpr):
    t = tl.program_id(0).to(tl.int64)
    cols = tl.program_id(1) * BLOCK + tl.arange(0, BLOCK)
    mask = cols < width
    loc = tl.load(Loc + t).to(tl.int64)
    k = tl.load(K + t * stride_k + cols, mask=mask)
    v = tl.load(V + t * stride_v + cols, mask=mask)
    if FP8_MAX > 0:
        k = fp8_saturate(k, k_inv, FP8_MAX)
        v = fp8_saturate(v, v_inv, FP8_MAX)
    tl.store(KBuf + loc * stride_kb + cols, k.to(KBuf.dtype.element_ty), mask=mask)
    tl.store(VBuf + loc * stride_vb + cols, v.to(VBuf.dtype.element_ty), mask=mask)


def _rows(x: torch.Tensor, name: str) -> tuple[int, int]:
    """(row stride, row width) of a [T, H, D] or [T, H*D] tensor whose rows are contiguous."""
    flat = x.reshape(x.shape[0], -1) if x.dim() == 3 else x
    if flat.dim() != 2 or flat.stride(-1) != 1 or (x.dim() == 3 and x.stride(1) != x.shape[2]):
        raise ValueError(f"{name} rows must be contiguous; got shape {tuple(x.shape)} strides {x.stride()}")
    return flat.stride(0), flat.shape[1]


def fp8_max(dtype: torch.dtype) -> float:
    """The largest finite value of an fp8 pool dtype; 0.0 for other dtypes (the kernels' "not fp8")."""
    return float(torch.finfo(dtype).max) if dtype in (torch.float8_e4m3fn, torch.float8_e5m2) else 0.0


def store_kv(k_buf: torch.Tensor, v_buf: torch.Tensor, loc: torch.Tensor, k: torch.Tensor, v: torch.Tensor,
             k_scale: float = 1.0, v_scale: float = 1.0) -> None:
    """k_buf/v_buf [slots, Hk, D]; loc [T] slot ids; k/v [T, Hk, D] or [T, Hk*D] (row-strided views allowed);
    k_scale / v_scale: an fp8 pool stores k / k_scale."""
    t = loc.shape[0]
    if k.shape[0] != t or v.shape[0] != t:
        raise ValueError(f"store_kv got {k.shape[0]}/{v.shape[0]} rows of k/v for {t} slots")
    sk, width = _rows(k, "k")
    sv, width_v = _rows(v, "v")
    if width != width_v or width != k_buf[0].numel() or k_buf.stride(0) != width or v_buf.stride(0) != width:
        raise ValueError(f"k/v rows of width {width}/{width_v} do not match pool rows of {k_buf[0].numel()}")
    if t == 0:
        return
    block = min(1024, triton.next_power_of_2(width))
    launch(_kv_store_kernel, (t, triton.cdiv(width, block)), k, v, k_buf, v_buf, loc, sk, sv, k_buf.stride(0),
           v_buf.stride(0), width, 1.0 / k_scale, 1.0 / v_scale, BLOCK=block, FP8_MAX=fp8_max(k_buf.dtype))
