"""The one-row fp8 q/k/v product (`fp8_gemv`, the elementwise kernel) with the rotary embedding and the KV store in
its epilogue, as `triton_ops/gemv_rope` does for 16-bit weights.

At batch 1 the rotary kernel after q/k/v moves a few KB: its time is its launch and ramp (~2 µs a layer). Here
each program owns R = BLOCK_N / 2 rows of the first half of one head and the R rows HALF further on (the other
halves of the same rotary pairs), multiplies them as the elementwise kernel does (the table's "fp8" tile for the
shape, its variant flags) and ends in `gemv_rope`'s epilogue (`_rope_store`: the product rounded as the plain GEMV
stores it, q and k rotated, k and v stored at the token's slot). The weight is read as by the plain kernel."""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from radixserve.layers.quantization import gemv_configs
from radixserve.layers.quantization.fp8_gemv import EW_FLAGS, _acc, _load_w, _row_out, _widen
from radixserve.layers.quantization.gguf_chunk_rope import RopeArgs
from radixserve.layers.triton_ops import pdl
from radixserve.layers.triton_ops.gemv_rope import _rope_store, rope_launch_args
from radixserve.layers.triton_ops.launch import launch
from radixserve.layers.triton_ops.pdl import pdl_prologue, prefetch_rows


@triton.jit
def _fp8_gemv_rope_kernel(X, W, S, Bias, Out, Positions, Cos, Sin, Loc, KBuf, VBuf, N, K, stride_wn, out_factor,
                          stride_cache, stride_kb, stride_vb, num_q_heads, num_kv_heads, k_inv, v_inv,
                          HAS_BIAS: tl.constexpr, STORE_KV: tl.constexpr, FP8_MAX: tl.constexpr, HALF: tl.constexpr,
                          WIDEN_F16: tl.constexpr, EVICT: tl.constexpr, RED8: tl.constexpr, BLOCK_N: tl.constexpr,
                          BLOCK_K: tl.constexpr, PDL: tl.constexpr = 0, PREFETCH: tl.constexpr = 0):
    pid = tl.program_id(0)
    R: tl.constexpr = BLOCK_N // 2
    per_head = HALF // R
    head = pid // per_head
    i = tl.arange(0, BLOCK_N)
    offs_n = head * (2 * HALF) + (pid % per_head) * R + i % R + (i // R) * HALF  # both runs
    mask_n = offs_n < N
    prefetch_rows(W, tl.minimum(offs_n, N - 1), stride_wn, PREFETCH)  # before the wait: `pdl.prefetch_rows`
    pdl_prologue(PDL)
    pos = tl.load(Positions).to(tl.int64)  # before the loop: their latency hides behind the weight's
    loc = tl.load(Loc).to(tl.int64) if STORE_KV else 0
    offs_k = tl.arange(0, BLOCK_K)
    offs_k = (offs_k // 8) * 8 + offs_k % 8  # runs of 8 columns a thread, as in `_fp8_gemv_ew_kernel`
    w_ptrs = W + offs_n[:, None].to(tl.int64) * stride_wn + offs_k[None, :]
    x_ptrs = X + offs_k[None, :] + 0 * offs_n[:, None]  # x in the weight tile's layout (L1 serves the repeats)
    ACC_K: tl.constexpr = BLOCK_K // 8 if RED8 else BLOCK_K
    acc = tl.zeros((BLOCK_N, ACC_K), dtype=tl.float32)
    for _ in range(0, K, BLOCK_K):  # K % BLOCK_K == 0 (the wrapper checks)
        w = _load_w(w_ptrs, mask_n, EVICT)
        acc = _acc(acc, _widen(w, WIDEN_F16), tl.load(x_ptrs).to(tl.float32), RED8)
        w_ptrs += BLOCK_K
        x_ptrs += BLOCK_K
    out = _row_out(acc, acc, S, Bias, offs_n, mask_n, N, out_factor, HAS_BIAS, False, Out.dtype.element_ty)
    o1, o2 = tl.split(tl.permute(tl.reshape(out, (2, R)), (1, 0)))
    d = (pid % per_head) * R + tl.arange(0, R)
    _rope_store(o1, o2, head, d, head * (2 * HALF) + d, Out, Cos, Sin, pos, stride_cache, loc, KBuf, VBuf,
                stride_kb, stride_vb, num_q_heads, num_kv_heads, k_inv, v_inv, STORE_KV, FP8_MAX, HALF)


def rope_rows(cfg: gemv_configs.GemvConfig, head_dim: int) -> int:
    """Rows per half-head run for the elementwise tiles `cfg` (BLOCK_N = 2 R), or 0 where they do not pair."""
    r = cfg.block_n // 2
    return r if cfg.block_n % 2 == 0 and r >= 1 and head_dim % 2 == 0 and (head_dim // 2) % r == 0 else 0


def fp8_qkv_rope(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor, bias: torch.Tensor | None, rope: RopeArgs,
                 config: gemv_configs.GemvConfig | None = None) -> torch.Tensor | None:
    """qkv [1, N] = x [1, K] @ (w * scale).T (+ bias) for the fp8 weight w [N, K] with per-channel scales [N], q and
    k heads rotated at `rope.positions[0]` (neox layout) and, with `rope.kv`, k and v stored at the token's slot.
    None where these kernels do not take it (the shape's tile is not the elementwise kernel's, or its rows do not
    pair the rotary halves): the caller runs the plain product and the rotary kernel. `config` overrides the table's
    "fp8" tile (tests)."""
    if x.dim() != 2 or x.shape[0] != 1 or x.stride(-1) != 1:
        raise ValueError(f"fp8_qkv_rope takes one row of x with unit stride; got {tuple(x.shape)}")
    n, k = w.shape
    if w.dim() != 2 or k != x.shape[1] or w.stride(-1) != 1 or scale.numel() != n:
        raise ValueError(f"fp8_qkv_rope: weight {tuple(w.shape)} with {scale.numel()} scales does not fit x "
                         f"{tuple(x.shape)} (per-channel scales)")
    cfg = config or gemv_configs.get("fp8", 1, n, k, x.is_cuda)
    r = rope_rows(cfg, rope.head_dim)
    if cfg.kernel != "ew" or k % 16 or r == 0:
        return None
    flags = set(cfg.variant.split("+"))
    if not flags <= EW_FLAGS:
        raise ValueError(f"fp8 GEMV: unknown variant {cfg.variant!r} (flags joined by '+': {sorted(EW_FLAGS)})")
    block_k = cfg.block_k
    while k % block_k:
        block_k //= 2
    out = torch.empty((1, n), dtype=x.dtype, device=x.device)
    loc, k_buf, v_buf, skb, svb, k_inv, v_inv, fmax = rope_launch_args(
        "fp8_qkv_rope", n, rope.num_q_heads, rope.num_kv_heads, rope.head_dim, bias, rope.positions, rope.cos_cache,
        rope.sin_cache, rope.kv, out)
    widen = "f16" in flags
    s = scale.reshape(-1)
    opts = dict(num_warps=cfg.num_warps, num_stages=cfg.num_stages) if x.is_cuda else {}
    launch(_fp8_gemv_rope_kernel, (n // (2 * r),), x, w.view(torch.uint8) if widen else w, s,
           bias if bias is not None else s, out, rope.positions, rope.cos_cache, rope.sin_cache, loc, k_buf, v_buf, n,
           k, w.stride(0), 256.0 if widen else 1.0, rope.cos_cache.stride(0), skb, svb, rope.num_q_heads,
           rope.num_kv_heads, k_inv, v_inv, HAS_BIAS=bias is not None, STORE_KV=rope.kv is not None, FP8_MAX=fmax,
           HALF=rope.head_dim // 2, WIDEN_F16=widen, EVICT="ef" in flags, RED8="r8" in flags, BLOCK_N=2 * r,
           BLOCK_K=block_k, **opts, **pdl.launch_opts(x, prefetch_row_bytes=k))
    return out
