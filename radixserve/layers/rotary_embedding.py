"""Rotary position embedding: the neox layout (halves rotated together, as HF Llama/Qwen use) or the interleaved one
(pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay out their rotary dims); Llama-3, linear and YaRN
frequency scaling, and per-frequency divisors read from a GGUF file (llama.cpp's `rope_freqs` tensor)."""

from __future__ import annotations

import math
from typing import TYPE_CHECKING, Any

import torch
from torch import nn

from radixserve.layers import cpu_ops
from radixserve.layers.triton_ops import use_fused

if TYPE_CHECKING:
    from radixserve.layers.triton_ops.rotary import KVWrite, QKNorm


def _llama3_inv_freq(inv_freq: torch.Tensor, scaling: dict[str, Any]) -> torch.Tensor:
    factor = scaling["factor"]
    low, high = scaling.get("low_freq_factor", 1.0), scaling.get("high_freq_factor", 4.0)
    old_ctx = scaling["original_max_position_embeddings"]
    low_wavelen, high_wavelen = old_ctx / low, old_ctx / high
    wavelen = 2 * math.pi / inv_freq
    scaled = torch.where(wavelen > low_wavelen, inv_freq / factor, inv_freq)
    smooth = (old_ctx / wavelen - low) / (high - low)
    smoothed = (1 - smooth) * scaled / factor + smooth * scaled
    medium = (wavelen >= high_wavelen) & (wavelen <= low_wavelen)
    return torch.where(medium, smoothed, scaled)


# llama.cpp's per-frequency divisors (a GGUF file's `rope_freqs` tensor: Llama 3.x's RoPE scaling, precomputed by its
# converter): rope_scaling {"rope_type": FREQ_FACTORS, "freq_factors": [head_dim / 2 floats]}; inv_freq[i] / factor[i]
FREQ_FACTORS = "gguf_freq_factors"


def _freq_factors(scaling: dict[str, Any], head_dim: int) -> torch.Tensor:
    factors = torch.as_tensor(scaling.get("freq_factors", ()), dtype=torch.float32).flatten()
    if factors.numel() != head_dim // 2:
        raise ValueError(f"rope freq_factors: expected {head_dim // 2} values (head_dim / 2), got {factors.numel()}")
    if not bool(torch.isfinite(factors).all()) or bool((factors <= 0).any()):
        raise ValueError("rope freq_factors must be finite and positive")
    return factors


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def _yarn_inv_freq(base: float, dim: int, scaling: dict[str, Any], max_position: int) -> tuple[torch.Tensor, float]:
    """YaRN (as transformers computes it): each frequency blends its interpolated (/factor) and original value by
    a linear ramp over the dims between the beta_fast and beta_slow rotation counts; cos/sin are scaled by the
    attention factor (DeepSeek: mscale(factor, mscale) / mscale(factor, mscale_all_dim))."""
    old_ctx = scaling["original_max_position_embeddings"]
    factor = scaling.get("factor") or max_position / old_ctx
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        mscale, mscale_all = scaling.get("mscale"), scaling.get("mscale_all_dim")
        attention_factor = (yarn_mscale(factor, mscale) / yarn_mscale(factor, mscale_all) if mscale and mscale_all
                            else yarn_mscale(factor))
    beta_fast, beta_slow = scaling.get("beta_fast") or 32, scaling.get("beta_slow") or 1

    def correction_dim(rotations: float) -> float:
        return dim * math.log(old_ctx / (rotations * 2 * math.pi)) / (2 * math.log(base))

    low, high = correction_dim(beta_fast), correction_dim(beta_slow)
    if scaling.get("truncate", True):
        low, high = math.floor(low), math.ceil(high)
    low, high = max(low, 0), min(high, dim - 1)
    if low == high:
        high += 0.001
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    pos_freqs = base ** (torch.arange(0, dim, 2).float() / dim)
    extrapolation = 1 - ramp
    inv_freq = (1.0 / (factor * pos_freqs)) * (1 - extrapolation) + (1.0 / pos_freqs) * extrapolation
    return inv_freq, float(attention_factor)


class RotaryEmbedding(nn.Module):
    def __init__(self, head_dim: int, max_position: int, base: float,
                 rope_scaling: dict[str, Any] | None = None, is_neox_style: bool = True) -> None:
        super().__init__()
        self.head_dim = head_dim
        self.is_neox_style = is_neox_style
        inv_freq = 1.0 / (base ** (torch.arange(0, head_dim, 2, dtype=torch.int64).float() / head_dim))
        attention_factor = 1.0
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif kind == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(base, head_dim, rope_scaling, max_position)
        elif kind == FREQ_FACTORS:
            inv_freq = inv_freq / _freq_factors(rope_scaling, head_dim)
        elif kind not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, llama3, yarn, "
                             f"{FREQ_FACTORS})")
        self._inv_freq, self._attention_factor = inv_freq, attention_factor
        cos, sin = self._tables(max_position)
        # Kept in fp32; computed on the CPU at construction, moved with the module.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=inv_freq.device), inv_freq)
        return freqs.cos() * self._attention_factor, freqs.sin() * self._attention_factor

    def cover(self, num_positions: int) -> None:
        """Extend the cos/sin tables to positions 0..num_positions - 1 (a served context longer than the model's
        max_position_embeddings, `--context-length`); the frequencies stay those of the config."""
        if num_positions <= self.cos_cache.shape[0]:
            return
        cos, sin = self._tables(num_positions)
        self.cos_cache = cos.to(self.cos_cache.device)
        self.sin_cache = sin.to(self.sin_cache.device)

    def can_fuse(self, q: torch.Tensor, k: torch.Tensor) -> bool:
        """Whether forward runs the fused kernel for these tensors (which can also store K/V: `kv_write`)."""
        return (use_fused(q) and self.is_neox_style and q.dim() == 2 and k.dim() == 2 and q.stride(-1) == 1
                and k.stride(-1) == 1)

    def forward(self, positions: torch.Tensor, q: torch.Tensor, k: torch.Tensor, kv_write: KVWrite | None = None,
                qk_norm: QKNorm | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """q: [T, H*D], k: [T, Hkv*D] → rotated, same shapes and dtypes. On CUDA (and for float32 / bfloat16 on the CPU,
        `cpu_ops.rotary_neox_inplace`) q and k are rotated in place
        (they may be views into the qkv projection) and returned. `kv_write` (only where `can_fuse`): the same
        kernel also writes the rotated k and the v rows into the KV pool; `qk_norm` (only where `can_fuse`): it also
        RMS-normalises each q and k head first."""
        if self.can_fuse(q, k):
            from radixserve.layers.triton_ops.rotary import apply_rotary_inplace

            apply_rotary_inplace(positions, q, k, self.cos_cache, self.sin_cache, self.head_dim, kv_write, qk_norm)
            return q, k
        if kv_write is not None or qk_norm is not None:
            raise ValueError("kv_write / qk_norm need the fused rotary kernel (CUDA tensors, 2-D q/k with unit "
                             "stride)")
        if self.is_neox_style and cpu_ops.rotary_neox_inplace(positions, q, k, self.cos_cache, self.sin_cache,
                                                              self.head_dim):
            return q, k  # rotated in place by the CPU kernel, bit-identical to the torch ops below
        cos = self.cos_cache[positions].unsqueeze(1)  # [T, 1, D/2]
        sin = self.sin_cache[positions].unsqueeze(1)

        def rotate(x: torch.Tensor) -> torch.Tensor:
            shape, dtype = x.shape, x.dtype
            x = x.reshape(shape[0], -1, self.head_dim).float()
            if self.is_neox_style:
                x1, x2 = x.chunk(2, dim=-1)
                out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
            else:  # pairs (x0, x1), (x2, x3), ... each rotated by one frequency; the output keeps that layout
                x1, x2 = x[..., 0::2], x[..., 1::2]
                out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
            return out.to(dtype).reshape(shape)

        return rotate(q), rotate(k)
