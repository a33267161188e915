"""Rotary position embedding: the neox layout (halves rotated together, as HF Llama/Qwen use) or the interleaved one
(pairs (x0, x1), (x2, x3), ... as DeepSeek's checkpoints lay out their rotary dims); Llama-3, linear, YaRN and
LongRoPE frequency scaling, per-frequency divisors read from a GGUF file (llama.cpp's `rope_freqs` tensor), and
partial rotation (`rotary_dim` < head_dim, as Phi-4-mini's `partial_rotary_factor`).

Partial rotation keeps every kernel as it is: the frequencies past rotary_dim / 2 are 0 (cos 1, sin 0: those dims
pass unchanged), which rotates the pairs (i, i + head_dim / 2), i < rotary_dim / 2. Transformers rotates the pairs
(i, i + rotary_dim / 2) of the first rotary_dim dims instead, so a model using it lays its q and k head dims out with
`partial_rotary_order` at load (q.k is the same sum in any order of the dims; v is not reordered)."""

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
# Qwen2-VL's rope_scaling type (transformers renames it "default" as it reads the config): its sections take the
# temporal / height / width position per frequency, the token's own position for each on text
MROPE = "mrope"


def _freq_factors(scaling: dict[str, Any], head_dim: int) -> torch.Tensor:
    factors = torch.as_tensor(scaling.get("freq_factors", ()), dtype=torch.float32).flatten()
    if factors.numel() != head_dim // 2:
        raise ValueError(f"rope freq_factors: expected {head_dim // 2} values (head_dim / 2), got {factors.numel()}")
    if not bool(torch.isfinite(factors).all()) or bool((factors <= 0).any()):
        raise ValueError("rope freq_factors must be finite and positive")
    return factors


def _longrope(inv_freq: torch.Tensor, scaling: dict[str, Any], max_position: int
              ) -> tuple[torch.Tensor, float, tuple[int, torch.Tensor]]:
    """LongRoPE (Phi-3 / Phi-3.5 / Phi-4-mini): the frequencies divided by `short_factor` for positions below
    `original_max_position_embeddings` and by `long_factor` from there on, cos/sin times sqrt(1 + ln(factor) /
    ln(original)), factor defaulting to max_position / original. Transformers and vLLM instead switch a whole
    forward to the long factors once any position in it passes the original context (so a long prompt's first
    positions turn differently there); by position, a cached key never depends on what it was computed with, which
    the prefix cache needs. Up to the original context the two agree exactly."""
    original = scaling.get("original_max_position_embeddings")
    if not original:
        raise ValueError("longrope rope scaling needs original_max_position_embeddings")
    factors = []
    for key in ("short_factor", "long_factor"):
        f = torch.as_tensor(scaling.get(key, ()), dtype=torch.float32).flatten()
        if f.numel() != inv_freq.numel() or not bool(torch.isfinite(f).all()) or bool((f <= 0).any()):
            raise ValueError(f"longrope {key}: expected {inv_freq.numel()} positive values (rotary_dim / 2), got "
                             f"{f.numel()}")
        factors.append(f)
    factor = scaling.get("factor") or max_position / original
    attention_factor = scaling.get("attention_factor")
    if attention_factor is None:
        attention_factor = 1.0 if factor <= 1.0 else math.sqrt(1 + math.log(factor) / math.log(original))
    return inv_freq / factors[0], float(attention_factor), (int(original), inv_freq / factors[1])


def partial_rotary_order(head_dim: int, rotary_dim: int) -> torch.Tensor:
    """The order of a head's dims under partial rotation (see the module's note): new dim j holds old dim order[j].
    The first half gets transformers' rotated first half (0 .. r/2 - 1) then half of the unrotated dims, the second
    half its rotated second half (r/2 .. r - 1) then the other unrotated dims."""
    # on the CPU whatever the default device (models are built under the GPU's): it indexes checkpoint tensors
    r, half, rest = rotary_dim // 2, head_dim // 2, torch.arange(rotary_dim, head_dim, device="cpu")
    return torch.cat([torch.arange(r, device="cpu"), rest[:half - r], torch.arange(r, rotary_dim, device="cpu"),
                      rest[half - r:]])


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
                 rope_scaling: dict[str, Any] | None = None, is_neox_style: bool = True,
                 rotary_dim: int | None = None, table_positions: int | None = None) -> None:
        """table_positions: build the cos/sin tables for at most this many positions (Llama 4's 10M-token
        max_position_embeddings would be gigabytes); the loader extends them to the served context (`cover`)."""
        super().__init__()
        self.head_dim = head_dim
        self.is_neox_style = is_neox_style
        rotary_dim = head_dim if rotary_dim is None else rotary_dim
        if rotary_dim != head_dim and (not is_neox_style or rotary_dim % 2 or not 0 <= rotary_dim < head_dim):
            raise ValueError(f"partial rotation needs the neox layout and an even rotary_dim below head_dim "
                             f"{head_dim}; got {rotary_dim}")  # 0: no rotation (SmolLM3's NoPE layers)
        self.rotary_dim = rotary_dim
        inv_freq = 1.0 / (base ** (torch.arange(0, rotary_dim, 2, dtype=torch.int64).float() / rotary_dim))
        attention_factor = 1.0
        self._long: tuple[int, torch.Tensor] | None = None  # LongRoPE: (first position, its frequencies)
        kind = (rope_scaling or {}).get("rope_type", (rope_scaling or {}).get("type", "default"))
        if kind == MROPE:  # Qwen-VL's multimodal RoPE: on text positions, the 1-D one (models/qwen_vl.py)
            kind = "default"
        if kind in ("longrope", "su"):
            inv_freq, attention_factor, self._long = _longrope(inv_freq, rope_scaling, max_position)
        elif kind == "llama3":
            inv_freq = _llama3_inv_freq(inv_freq, rope_scaling)
        elif kind == "linear":
            inv_freq = inv_freq / rope_scaling["factor"]
        elif kind == "dynamic":  # dynamic NTK: the config's own frequencies up to its original context, where
            pass                 # transformers rescales nothing (ModelConfig refuses a longer served context)
        elif kind == "yarn":
            inv_freq, attention_factor = _yarn_inv_freq(base, rotary_dim, rope_scaling, max_position)
        elif kind == FREQ_FACTORS:
            inv_freq = inv_freq / _freq_factors(rope_scaling, rotary_dim)
        elif kind not in ("default", None):
            raise ValueError(f"unsupported rope scaling type {kind!r} (supported: default, linear, dynamic, llama3, "
                             f"yarn, longrope, {FREQ_FACTORS})")
        if rotary_dim < head_dim:  # the dims past rotary_dim / 2 of each half keep frequency 0
            pad = inv_freq.new_zeros((head_dim - rotary_dim) // 2)
            inv_freq = torch.cat([inv_freq, pad])
            if self._long is not None:
                self._long = (self._long[0], torch.cat([self._long[1], pad]))
        self._inv_freq, self._attention_factor = inv_freq, attention_factor
        cos, sin = self._tables(max_position if table_positions is None else min(max_position, table_positions))
        # Kept in fp32; computed on the CPU at construction, moved with the module.
        self.register_buffer("cos_cache", cos, persistent=False)
        self.register_buffer("sin_cache", sin, persistent=False)

    def _tables(self, num_positions: int) -> tuple[torch.Tensor, torch.Tensor]:
        inv_freq = self._inv_freq
        freqs = torch.outer(torch.arange(num_positions, dtype=torch.float32, device=inv_freq.device), inv_freq)
        if self._long is not None and num_positions > self._long[0]:  # LongRoPE: the positions past the original
            first, long_freq = self._long                               # context turn with the long factors
            freqs[first:] = torch.outer(torch.arange(first, num_positions, dtype=torch.float32,
                                                      device=inv_freq.device), long_freq)
        cos, sin = freqs.cos() * self._attention_factor, freqs.sin() * self._attention_factor
        cos[:, self.rotary_dim // 2:] = 1.0  # unrotated dims pass unscaled (LongRoPE / YaRN scale the rotated ones)
        return cos, sin

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
