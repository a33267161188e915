"""Mamba2, the recurrent layer of IBM Granite 4.0's and NVIDIA Nemotron-H's hybrid models
(`models/granitemoehybrid.py`, `models/nemotron_h.py`): a state per request instead of a KV cache.

One projection gives each token a gate z (the layer's inner width I), the convolved channels xBC (x: I, then B and C:
G groups of N each) and one dt a head. After a causal depthwise convolution of width K (with bias) and SiLU over xBC,
each head h (of H, head width P, group g = h // (H / G)) updates a [P, N] state:

    dt = softplus(dt + dt_bias);  S <- exp(dt * A) S + dt x B^T;  y = S C + D x

with A = -exp(A_log) per head (extend clamps dt to `time_step_limit`; the decode step does not, as in
transformers). The output times SiLU(z) is RMS-normed in G groups of I / G channels (the norm's
weight after), then out_proj.

State: a request's conv window (the last K - 1 xBC inputs, model dtype) and its S [H, P, N] (float32), in
`StateBuffers` rows indexed by its request-pool slot, the snapshot rows of the radix cache after them, then the
padding row that CUDA-graph padding entries (KV slot 0) write. A prefill chunk whose request has no prefix starts
from zeros, otherwise from the state its previous chunk left.

Decode is the recurrent step, batched over the requests (on CUDA in one Triton launch after the convolution:
`triton_ops/ssd_decode.py`). Extend runs the convolution over [window; tokens] and the
scan in chunks of `CHUNK` tokens (the state space duality form): within a chunk the outputs are a causal, decayed
C B^T product applied to dt x plus the chunk's start state read through C; the state is carried chunk to chunk
(on CUDA all the chunks of a group's requests in one Triton launch, `triton_ops/ssd_scan.py`). Requests are
grouped and padded as the linear-attention layer's (`_pieces`, `_pad_groups`: padding tokens have dt = 0, so they
leave the state as it is), which also cuts a request where the radix cache asked for a state snapshot.
Temporaries are bounded by the group's padded tokens (PAD_TOKENS) and the chunk.

Tensor parallelism splits the heads and the groups: each rank holds H / tp heads and G / tp groups (whole norm
groups, since the norm's groups are the same G), its rows of each section of in_proj (z, x, B, C, dt), its x, B and
C channels of the convolution, its heads' dt_bias / A_log / D, its channels of the norm's weight, and out_proj's
matching input columns (one all-reduce after it). The state rows then hold this rank's heads and channels only."""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.linear_attention import StateBuffers, _pad_groups, _pieces, state_cuts
from radixserve.layers.triton_ops import use_fused

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

CHUNK = 64  # tokens of the scan solved at once in extend (any size gives the same result)


def ssd_step(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
             c: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the scan for a batch (without the D skip). state [S, H, P, N], x [S, H, P], dt [S, H] (after
    softplus and clamp), a [H] (= A, negative), b / c [S, G, N], float32 -> (y [S, H, P], the new state)."""
    s, h, p = x.shape
    g, n = b.shape[1:]
    st = state.reshape(s, g, h // g, p, n)
    decay = (dt * a).exp().reshape(s, g, h // g)[..., None, None]
    u = (x * dt[..., None]).reshape(s, g, h // g, p)
    st = st * decay + u[..., None] * b[:, :, None, None, :]
    y = (st * c[:, :, None, None, :]).sum(-1)
    return y.reshape(s, h, p), st.reshape(s, h, p, n)


def ssd_chunked(state: torch.Tensor, x: torch.Tensor, dt: torch.Tensor, a: torch.Tensor, b: torch.Tensor,
                c: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The scan over sequences (without the D skip), `chunk` tokens at a time. state [S, H, P, N], x [S, T, H, P],
    dt [S, T, H] (after softplus and clamp; 0 on padding tokens), a [H], b / c [S, T, G, N], float32 -> (y [S, T,
    H, P], the final state).

    Within a chunk starting from S0, with L_t the cumulative log decay (sum of dt * A) up to token t:
    y_t = e^{L_t} S0 C_t + sum_{j<=t} e^{L_t - L_j} (C_t . B_j) dt_j x_j and
    S = e^{L_last} S0 + sum_j e^{L_last - L_j} dt_j x_j B_j^T."""
    s, length, h, p = x.shape
    g, n = b.shape[2:]
    r = h // g
    st = state.reshape(s, g, r, p, n)
    outs = []
    for start in range(0, length, chunk):
        end = min(start + chunk, length)
        size = end - start
        u = (x[:, start:end] * dt[:, start:end, :, None]).reshape(s, size, g, r, p)  # dt x
        cum = (dt[:, start:end] * a).cumsum(1).reshape(s, size, g, r).permute(0, 2, 3, 1)  # [S, G, r, L]
        bj, ct = b[:, start:end], c[:, start:end]  # [S, L, G, N]
        lower = torch.ones(size, size, dtype=torch.bool, device=x.device).tril()
        decay = (cum[..., :, None] - cum[..., None, :]).masked_fill(~lower, float("-inf")).exp()  # [S, G, r, L, L]
        scores = torch.einsum("slgn,smgn->sglm", ct, bj)[:, :, None] * decay  # causal, decayed C . B
        y = torch.einsum("sgrlm,smgrp->slgrp", scores, u)
        y = y + torch.einsum("slgn,sgrpn->slgrp", ct, st) * cum.permute(0, 3, 1, 2).exp()[..., None]
        to_end = (cum[..., -1:] - cum).exp().permute(0, 3, 1, 2)  # [S, L, G, r]
        st = st * cum[..., -1].exp()[..., None, None] + torch.einsum("slgrp,slgn->sgrpn", u * to_end[..., None], bj)
        outs.append(y.reshape(s, size, h, p))
    return torch.cat(outs, dim=1), st.reshape(s, h, p, n)


@dataclass(frozen=True)
class Mamba2Names:
    """Where a family's config keeps the Mamba2 layer's sizes and switches (the attribute names). `expand`: None
    where the inner width is simply heads x head width (Nemotron-H), else the attribute whose value times
    hidden_size gives it (Granite, which then checks heads x head width against it)."""

    heads: str
    head_dim: str
    groups: str
    state: str
    conv: str
    act: str
    conv_bias: str
    proj_bias: str
    eps: str
    expand: str | None


GRANITE = Mamba2Names("mamba_n_heads", "mamba_d_head", "mamba_n_groups", "mamba_d_state", "mamba_d_conv", "hidden_act",
                      "mamba_conv_bias", "mamba_proj_bias", "rms_norm_eps", "mamba_expand")
NEMOTRON_H = Mamba2Names("mamba_num_heads", "mamba_head_dim", "n_groups", "ssm_state_size", "conv_kernel",
                         "mamba_hidden_act", "use_conv_bias", "use_bias", "layer_norm_epsilon", None)


class StackedColumnLinear(MergedColumnParallelLinear):
    """Column-parallel sections loaded from one checkpoint tensor that stacks them whole (Mamba2's in_proj: z, x,
    B, C, dt): without a shard id, this rank's rows of each section; an fp8 checkpoint's per-tensor scale of the
    whole tensor (`weight_scale`, `input_scale`: one value) is every section's."""

    def weight_loader(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: str | int | None = None) -> None:
        if shard_id is None and getattr(param, "shard_scalar", False):
            if loaded.numel() != 1:
                raise ValueError(f"expected a per-tensor scale (one value), got shape {tuple(loaded.shape)}")
            param.data.fill_(float(loaded.reshape(())))
            return
        if shard_id is not None or getattr(param, "shard_scalar", False) or getattr(param, "output_dim", 0) is None:
            super().weight_loader(param, loaded, shard_id)
            return
        if self.tp_size == 1:  # the tensor as it is (also a block-quantized one)
            self._copy(param, loaded)
            return
        dim = getattr(param, "output_dim", 0)
        full = [n * self.tp_size for n in self.shard_sizes]
        if getattr(param, "output_block", 1) > 1 or loaded.dim() != param.dim() or loaded.shape[dim] != sum(full):
            raise ValueError(f"weight shape mismatch: expected {sum(full)} rows stacking sections {full} along dim "
                             f"{dim}, got a tensor of shape {tuple(loaded.shape)}")
        start = 0
        for i, n in enumerate(full):
            super().weight_loader(param, loaded.narrow(dim, start, n), i)
            start += n


class Mamba2Mixer(nn.Module):
    """The Mamba2 layer of Granite 4.0 and Nemotron-H (transformers' parameter names: in_proj, conv1d as
    conv_weight / conv_bias, dt_bias, A_log, D, norm.weight as norm_weight, out_proj). `names`: the family's config
    attribute names (GRANITE, NEMOTRON_H). With tp_size > 1, `heads`, `groups`, `inner` and `channels` are this
    rank's; the loaders cut the checkpoint's whole tensors to them."""

    def __init__(self, config: PretrainedConfig, names: Mamba2Names = GRANITE, tp_rank: int = 0,
                 tp_size: int = 1) -> None:
        super().__init__()
        hidden = config.hidden_size
        heads = int(getattr(config, names.heads))
        head_dim = getattr(config, names.head_dim, "auto")
        if names.expand is None:
            self.head_dim = int(head_dim)
            inner = heads * self.head_dim
        else:
            inner = int(getattr(config, names.expand) * hidden)
            self.head_dim = inner // heads if head_dim in (None, "auto") else int(head_dim)
        groups, self.state_size = int(getattr(config, names.groups)), int(getattr(config, names.state))
        self.width = int(getattr(config, names.conv))
        if heads * self.head_dim != inner:
            raise ValueError(f"Mamba2: {names.heads} {heads} x {names.head_dim} {self.head_dim} must equal "
                             f"{names.expand} x hidden_size = {inner}")
        if heads % groups or inner % groups:
            raise ValueError(f"Mamba2: {names.groups} {groups} must divide {names.heads} {heads}")
        if heads % tp_size or groups % tp_size:
            raise ValueError(f"Mamba2: {names.heads} {heads} and {names.groups} {groups} must be divisible by the "
                             f"tensor parallel size {tp_size}")
        if (inner // tp_size) % (inner // groups):  # (with G % tp == 0 each rank holds whole norm groups)
            raise ValueError(f"Mamba2: the gated norm's {groups} groups of {inner // groups} channels would straddle "
                             f"the tensor parallel ranks ({tp_size})")
        if self.width < 2:
            raise ValueError(f"Mamba2: {names.conv} must be at least 2; got {self.width}")
        act = getattr(config, names.act, None) or "silu"
        if act not in ("silu", "swish"):
            raise ValueError(f"Mamba2: {names.act} {act!r} is not supported (silu)")
        limit = getattr(config, "time_step_limit", None) or (0.0, math.inf)
        self.dt_min, self.dt_max = float(limit[0]), float(limit[1])
        self.tp_rank, self.tp_size = tp_rank, tp_size
        # this rank's heads, groups, inner width and convolved channels (x, B, C)
        self.heads, self.groups, self.inner = heads // tp_size, groups // tp_size, inner // tp_size
        self.channels = self.inner + 2 * self.groups * self.state_size
        bias = bool(getattr(config, names.proj_bias, False))
        gn = groups * self.state_size
        self.sections = [inner, inner, gn, gn, heads]  # z, x, B, C, dt: the full sizes, as the checkpoint stacks them
        self.in_proj = StackedColumnLinear(hidden, self.sections, bias, tp_rank, tp_size)  # this rank's rows of each
        self.conv_weight = nn.Parameter(torch.empty(self.channels, self.width), requires_grad=False)
        self.conv_weight.weight_loader = self._load_conv
        self.conv_bias = nn.Parameter(torch.zeros(self.channels), requires_grad=False) \
            if getattr(config, names.conv_bias, True) else None
        if self.conv_bias is not None:
            self.conv_bias.weight_loader = self._load_conv
        self.dt_bias = nn.Parameter(torch.empty(self.heads), requires_grad=False)
        self.A_log = nn.Parameter(torch.empty(self.heads), requires_grad=False)
        self.D = nn.Parameter(torch.empty(self.heads), requires_grad=False)
        for p in (self.dt_bias, self.A_log, self.D):
            p.weight_loader = self._load_heads
        self.norm_weight = nn.Parameter(torch.ones(self.inner), requires_grad=False)
        self.norm_weight.weight_loader = self._load_heads
        self.eps = float(getattr(config, names.eps))
        self.out_proj = RowParallelLinear(inner, hidden, bias, tp_rank, tp_size)
        self.states: StateBuffers | None = None

    # ------------------------------------------------------------------ weights
    def checkpoint_shape(self, leaf: str) -> tuple[int, ...]:
        """The whole (all ranks') shape of this layer's own parameter `leaf` (conv1d's weight as [C, K]), what its
        loader takes (the dummy loader's)."""
        param = getattr(self, leaf)
        if leaf in ("conv_weight", "conv_bias"):
            return (sum(self.sections[1:4]), *param.shape[1:])
        return (param.shape[0] * self.tp_size,)

    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """The conv1d weight [C, K] or bias [C] (every rank's x, B, C channels): this rank's channels of each."""
        full = self.sections[1:4]
        if loaded.shape[0] != sum(full) or loaded.shape[1:] != param.shape[1:]:
            raise ValueError(f"Mamba2 conv1d {tuple(loaded.shape)}: expected ({sum(full)}"
                             f"{', ' + str(self.width) if param.dim() == 2 else ''})")
        parts, start = [], 0
        for total in full:
            n = total // self.tp_size
            parts.append(loaded[start + self.tp_rank * n:start + (self.tp_rank + 1) * n])
            start += total
        param.data.copy_(torch.cat(parts))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor, shard_id: object = None) -> None:
        """dt_bias, A_log, D (one value a head) or the norm's weight (one a channel): this rank's."""
        n = param.shape[0]
        if loaded.shape != (n * self.tp_size,):
            raise ValueError(f"Mamba2 per-head parameter {tuple(loaded.shape)}: expected ({n * self.tp_size},)")
        param.data.copy_(loaded[self.tp_rank * n:(self.tp_rank + 1) * n])

    # ------------------------------------------------------------------ state
    def state_bytes(self, dtype: torch.dtype) -> int:
        return StateBuffers.bytes_per_slot(self.channels, self.width, self.heads, self.head_dim, self.state_size,
                                           dtype)

    def allocate_states(self, slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.states = StateBuffers(slots, self.channels, self.width, self.heads, self.head_dim, self.state_size,
                                   dtype, device)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError("Mamba2 states are not allocated (ModelRunner allocates them with the pools)")
        z, xbc, dt = self.in_proj(hidden).split([self.inner, self.channels, self.heads], dim=-1)
        dt = F.softplus(dt.float() + self.dt_bias.float())
        if forward_batch.forward_mode.is_decode():  # (the step takes dt unclamped, as transformers' and mamba_ssm's)
            y = self._decode(xbc, dt, forward_batch)
        else:
            y = self._extend(xbc, dt.clamp(self.dt_min, self.dt_max), forward_batch)
        return self.out_proj(self._gated_norm(y, z))

    def _gated_norm(self, y: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """y [T, I] (float32) times SiLU(z), RMS-normed over each group's I / G channels, times the weight."""
        x = (y * F.silu(z.float())).reshape(-1, self.groups, self.inner // self.groups)
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).reshape(-1, self.inner)
        return (self.norm_weight.float() * x).to(z.dtype)

    def _split(self, conv: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [..., C] (float32) -> x [..., H, P], B and C [..., G, N]."""
        x, b, c = conv.split([self.inner, self.groups * self.state_size, self.groups * self.state_size], dim=-1)
        lead = conv.shape[:-1]
        return (x.reshape(*lead, self.heads, self.head_dim), b.reshape(*lead, self.groups, self.state_size),
                c.reshape(*lead, self.groups, self.state_size))

    def _conv_out(self, conv: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
        """SiLU of the convolution's float32 output, rounded through the model dtype, back in float32."""
        return F.silu(conv).to(dtype).float()

    def _decode(self, xbc: torch.Tensor, dt: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        st = self.states
        rows = forward_batch.req_pool_indices
        # a CUDA graph's padding rows (KV slot 0) write the padding row, not a request's
        rows = torch.where(forward_batch.out_cache_loc != 0, rows, torch.full_like(rows, st.padding_row))
        window = torch.cat([st.conv[rows], xbc[:, :, None]], dim=-1)  # [B, C, K]
        st.conv.index_copy_(0, rows, window[:, :, 1:])
        conv = (window.float() * self.conv_weight.float()).sum(-1)
        if self.conv_bias is not None:
            conv = conv + self.conv_bias.float()
        conv = self._conv_out(conv, xbc.dtype)
        a = -self.A_log.float().exp()
        if use_fused(conv):  # the scan's step in one launch, each state slice read and written once
            from radixserve.layers.triton_ops.ssd_decode import ssd_decode

            return ssd_decode(st.ssm, rows, conv, dt, a, self.D.float(), self.groups)
        x, b, c = self._split(conv)
        y, state = ssd_step(st.ssm[rows], x, dt, a, b, c)
        st.ssm.index_copy_(0, rows, state)
        y = y + x * self.D.float()[:, None]
        return y.reshape(xbc.shape[0], self.inner)

    def _extend(self, xbc: torch.Tensor, dt: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        lens, prefixes = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
        if lens is None or prefixes is None:
            raise RuntimeError("Mamba2 extend needs the batch's extend lengths on the host")
        # pieces of at most PAD_TOKENS tokens, cut where the radix cache asked for a state snapshot (copied after)
        owner, lens, prefixes, stash = _pieces(lens, prefixes, state_cuts(forward_batch.state_checkpoints))
        rows, st = forward_batch.req_pool_indices, self.states
        outs, start = [], 0
        for group in _pad_groups(lens, owner):  # consecutive pieces: their tokens are contiguous
            n = sum(lens[i] for i in group)
            part = slice(start, start + n)
            sub_rows = rows[torch.tensor([owner[i] for i in group], device=rows.device)]
            outs.append(self.extend_padded(xbc[part], dt[part], sub_rows, [lens[i] for i in group],
                                           [prefixes[i] for i in group]))
            st.keep_checkpoints(group, owner, stash, rows)
            start += n
        return torch.cat(outs)

    def extend_padded(self, xbc: torch.Tensor, dt: torch.Tensor, rows: torch.Tensor, lens: list[int],
                      prefixes: list[int]) -> torch.Tensor:
        """The extend of consecutive requests (state rows `rows`) at once, each padded to the longest (padding after
        its tokens: dt = 0 leaves the state as it is, the outputs are dropped) -> y [tokens, I] (float32, with the
        D skip)."""
        st, count, longest, width = self.states, len(lens), max(lens), self.width
        device = xbc.device
        n = torch.tensor(lens, device=device)
        keep = torch.tensor(prefixes, device=device) > 0  # False: a fresh sequence starts at zero
        x = torch.nn.utils.rnn.pad_sequence(list(xbc.split(lens)), batch_first=True)  # [S, T, C]
        window = torch.cat([st.conv[rows] * keep.to(st.conv.dtype)[:, None, None], x.transpose(1, 2)], dim=-1)
        bias = None if self.conv_bias is None else self.conv_bias.float()
        conv = F.conv1d(window.float(), self.conv_weight.float()[:, None, :], bias, groups=self.channels)
        last = (n[:, None] + torch.arange(width - 1, device=device))[:, None, :].expand(count, self.channels, -1)
        st.conv[rows] = torch.gather(window, 2, last)  # each request's last K - 1 inputs
        real = torch.arange(longest, device=device)[None, :] < n[:, None]  # [S, T]
        xs, b, c = self._split(self._conv_out(conv.transpose(1, 2), xbc.dtype))
        dts = dt.new_zeros((count, longest, self.heads))
        dts[real] = dt
        state = st.ssm[rows] * keep.to(st.ssm.dtype)[:, None, None, None]
        a = -self.A_log.float().exp()
        if use_fused(xs):  # the chunks in one launch, each program's state slice carried in registers
            from radixserve.layers.triton_ops.ssd_scan import ssd_scan

            y = ssd_scan(state, xs, dts, a, b, c, n, exact=xbc.dtype == torch.float32)
        else:
            y, state = ssd_chunked(state, xs, dts, a, b, c)
        st.ssm[rows] = state
        y = y + xs * self.D.float()[:, None]
        return y[real].reshape(-1, self.inner)
