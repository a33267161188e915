"""Gated DeltaNet, the linear-attention layer of the hybrid Qwen models (Qwen3-Next, Qwen3.5): a recurrent state per
request instead of a KV cache.

Each token's q, k, v (one projection with z, b and a), after a causal depthwise convolution of width K over the
q/k/v channels and SiLU, updates a [Dk, Dv] state per value head with the gated delta rule:

    S <- exp(g) * S;  S <- S + k (beta * (v - S^T k))^T;  o = S^T q

(q and k L2-normalised, q scaled by Dk^-1/2, g = -exp(A_log) * softplus(a + dt_bias) <= 0, beta = sigmoid(b); each
q/k head serves Hv / Hk value heads). The output is RMS-normed per head, times SiLU(z), then out_proj.

State: a request's conv window (the last K - 1 inputs of the convolution, model dtype) and its S (float32), in
`StateBuffers` rows indexed by its request-pool slot; one more row takes the writes of a CUDA graph's padding rows
(their KV slot is 0, which no real token has). A prefill chunk whose request has no prefix starts from zeros,
otherwise from the state its previous chunk left.

Decode (one token a request) is batched tensor ops, the delta rule's step one Triton launch on CUDA
(`triton_ops/delta_rule.py`), captured in the decode CUDA graphs. Extend: the convolution over [window; tokens] and
the delta rule in chunks of 64 tokens, each chunk's updates solved at once (a unit lower-triangular system; the "WY"
form), the chunks in sequence; requests of similar lengths together (each padded to the longest), otherwise one by
one (a request with one token then takes the recurrent step).

Tensor parallelism splits the heads: each rank holds Hk / tp key heads and Hv / tp value heads, their channels of
the projection and of the convolution, and out_proj's matching input columns (one all-reduce after it)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import torch
import torch.nn.functional as F
from torch import nn

from radixserve.layers.linear import MergedColumnParallelLinear, RowParallelLinear
from radixserve.layers.triton_ops import use_fused

if TYPE_CHECKING:
    from transformers import PretrainedConfig

    from radixserve.model_executor.forward_batch_info import ForwardBatch

CHUNK = 64  # tokens whose delta-rule updates are solved together in extend
PAD_TOKENS = 4096  # the most padded tokens an extend runs at once (bounds its float32 temporaries)
SEQ_BUDGET = 256 << 20  # bytes of temporaries the chunked delta rule may take at once (it runs in slices of heads)


def l2_normalize(x: torch.Tensor, eps: float = 1e-6) -> torch.Tensor:
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def delta_rule_step(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                    beta: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """One token of the gated delta rule for a batch. state [B, H, Dk, Dv], q/k [B, H, Dk] (normalised, q scaled),
    v [B, H, Dv], g/beta [B, H], all float32 -> (o [B, H, Dv], the new state)."""
    state = state * g.exp()[..., None, None]
    remembered = (state * k[..., None]).sum(-2)
    delta = (v - remembered) * beta[..., None]
    state = state + k[..., None] * delta[..., None, :]
    return (state * q[..., None]).sum(-2), state


def delta_rule_chunked(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                       beta: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """`delta_rule_sequences` over slices of the sequences (heads) whose temporaries fit SEQ_BUDGET."""
    seqs, length, dk = k.shape
    per_seq = 4 * (length + chunk) * (5 * dk + 5 * v.shape[-1] + 4 * chunk)  # float32 temporaries (a bound)
    step = max(1, SEQ_BUDGET // per_seq)
    if seqs <= step:
        return delta_rule_sequences(state, q, k, v, g, beta, chunk)
    parts = [delta_rule_sequences(state[i:i + step], q[i:i + step], k[i:i + step], v[i:i + step], g[i:i + step],
                                  beta[i:i + step], chunk) for i in range(0, seqs, step)]
    return torch.cat([o for o, _ in parts]), torch.cat([s for _, s in parts])


def delta_rule_sequences(state: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                         beta: torch.Tensor, chunk: int = CHUNK) -> tuple[torch.Tensor, torch.Tensor]:
    """The gated delta rule over one sequence, `chunk` tokens at a time. state [H, Dk, Dv], q/k [H, T, Dk],
    v [H, T, Dv], g/beta [H, T], float32 -> (o [H, T, Dv], the final state).

    Within a chunk starting from state S0, with c_i the cumulative log decay up to token i, the update each token
    writes is u_i = beta_i (v_i - e^{c_i} S0^T k_i - sum_{j<i} e^{c_i - c_j} (k_i . k_j) u_j): a unit lower-triangular
    system (I + A) U = beta * V - (beta e^c * K) S0, solved for the two right-hand sides at once; then
    o_i = e^{c_i} S0^T q_i + sum_{j<=i} e^{c_i - c_j} (q_i . k_j) u_j and S = e^{c_last} S0 + sum_j e^{c_last - c_j}
    k_j u_j^T. Padding tokens (k = 0, beta = 0, g = 0) change nothing. On CUDA the walk over the chunks is one
    Triton launch (`triton_ops/delta_chunks.py`)."""
    heads, length, dk = k.shape
    pad = (-length) % chunk
    if pad:
        q, k, v = (F.pad(t, (0, 0, 0, pad)) for t in (q, k, v))
        g, beta = (F.pad(t, (0, pad)) for t in (g, beta))
    n = (length + pad) // chunk
    q, k, v = (t.reshape(heads, n, chunk, t.shape[-1]) for t in (q, k, v))
    g, beta = g.reshape(heads, n, chunk), beta.reshape(heads, n, chunk)
    cum = g.cumsum(-1)  # [H, N, C]
    gap = cum[..., :, None] - cum[..., None, :]  # c_i - c_j
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=k.device).tril()
    decay = gap.masked_fill(~lower, float("-inf")).exp()  # e^{c_i - c_j} for j <= i, else 0
    strict = (k @ k.transpose(-1, -2)) * decay * beta[..., :, None]
    system = strict.tril(-1) + torch.eye(chunk, dtype=k.dtype, device=k.device)
    rhs = torch.cat([v * beta[..., None], k * (beta * cum.exp())[..., None]], dim=-1)
    solved = torch.linalg.solve_triangular(system, rhs, upper=False, unitriangular=True)
    from_v, from_state = solved[..., :v.shape[-1]], solved[..., v.shape[-1]:]
    scores = (q @ k.transpose(-1, -2)) * decay  # [H, N, C, C], causal within the chunk
    q_decayed = q * cum.exp()[..., None]
    k_to_end = k * (cum[..., -1:] - cum).exp()[..., None]
    if use_fused(k) and chunk >= 16 and chunk & (chunk - 1) == 0:  # the chunk loop in one launch
        from radixserve.layers.triton_ops.delta_chunks import delta_chunks

        state = state.contiguous().clone()  # (updated in place by the kernel)
        out = delta_chunks(state, from_v, from_state, q_decayed, scores, k_to_end, cum[..., -1].exp())
        return out[:, :length], state
    outs = []
    for c in range(n):
        u = from_v[:, c] - from_state[:, c] @ state
        outs.append(q_decayed[:, c] @ state + scores[:, c] @ u)
        state = state * cum[:, c, -1].exp()[:, None, None] + k_to_end[:, c].transpose(-1, -2) @ u
    out = torch.stack(outs, dim=1).reshape(heads, n * chunk, -1)[:, :length]
    return out, state


def state_cuts(checkpoints: list[tuple[int, int, int]] | None) -> dict[int, dict[int, int]]:
    """`ForwardBatch.state_checkpoints` by request: request -> {tokens into its extend: snapshot row}."""
    cuts: dict[int, dict[int, int]] = {}
    for i, at, row in checkpoints or ():
        cuts.setdefault(i, {})[at] = row
    return cuts


def _pieces(lens: list[int], prefixes: list[int], cuts: dict[int, dict[int, int]] | None = None
            ) -> tuple[list[int], list[int], list[int], list[int]]:
    """(the request of each piece, the pieces' lengths, their prefixes, the snapshot row to copy the state into
    after the piece or -1): requests cut into pieces of at most PAD_TOKENS tokens, and where `cuts` (`state_cuts`)
    asks for a state snapshot."""
    owner, out_lens, out_prefixes, stash = [], [], [], []
    for i, (n, prefix) in enumerate(zip(lens, prefixes, strict=True)):
        at = (cuts or {}).get(i, {})
        bounds = sorted({*range(0, n, PAD_TOKENS), *(a for a in at if 0 < a < n)}) + [n]
        for first, last in zip(bounds, bounds[1:], strict=False):
            owner.append(i)
            out_lens.append(last - first)
            out_prefixes.append(prefix + first)
            stash.append(at.get(last, -1))
    return owner, out_lens, out_prefixes, stash


def _pad_groups(lens: list[int], owner: list[int] | None = None) -> list[list[int]]:
    """Consecutive requests run together, each padded to the group's longest: while the padded tokens stay within
    PAD_TOKENS and within twice the real ones (plus a chunk a request). Two pieces of one request (`owner`) never
    share a group: the second starts from the state the first leaves."""
    groups: list[list[int]] = []
    for i in range(len(lens)):
        group = groups[-1] + [i] if groups and (owner is None or owner[groups[-1][-1]] != owner[i]) else []
        if group:
            padded = len(group) * max(lens[j] for j in group)
            real = sum(lens[j] for j in group)
            if padded <= PAD_TOKENS and padded <= 2 * real + CHUNK * len(group):
                groups[-1] = group
                continue
        groups.append([i])
    return groups


class StateBuffers:
    """One layer's recurrent state for every request slot (+ the padding row): conv windows [slots + 1, C, K - 1]
    in the model dtype, delta-rule states [slots + 1, Hv, Dk, Dv] in float32."""

    def __init__(self, slots: int, channels: int, width: int, heads: int, dk: int, dv: int, dtype: torch.dtype,
                 device: torch.device | str) -> None:
        self.padding_row = slots
        self.conv = torch.zeros((slots + 1, channels, width - 1), dtype=dtype, device=device)
        self.ssm = torch.zeros((slots + 1, heads, dk, dv), dtype=torch.float32, device=device)

    def keep_checkpoints(self, group: list[int], owner: list[int], stash: list[int], rows: torch.Tensor) -> None:
        """After a group of extend pieces ran: a piece that ends at a state checkpoint (`stash[i]` >= 0) copies its
        request's row (`rows[owner[i]]`) into that snapshot row."""
        for i in group:
            if stash[i] >= 0:
                row = int(rows[owner[i]])
                self.conv[stash[i]].copy_(self.conv[row])
                self.ssm[stash[i]].copy_(self.ssm[row])

    @staticmethod
    def bytes_per_slot(channels: int, width: int, heads: int, dk: int, dv: int, dtype: torch.dtype) -> int:
        return channels * (width - 1) * torch.finfo(dtype).bits // 8 + heads * dk * dv * 4


class GatedDeltaNet(nn.Module):
    def __init__(self, config: PretrainedConfig, tp_rank: int = 0, tp_size: int = 1) -> None:
        super().__init__()
        hk, hv = config.linear_num_key_heads, config.linear_num_value_heads
        self.dk, self.dv = config.linear_key_head_dim, config.linear_value_head_dim
        if hk % tp_size or hv % tp_size or hv % hk:
            raise ValueError(f"linear attention: {hk} key heads and {hv} value heads must be divisible by the tensor "
                             f"parallel size {tp_size}, and the value heads by the key heads")
        if getattr(config, "hidden_act", "silu") != "silu":
            raise ValueError(f"linear attention: hidden_act {config.hidden_act!r} is not supported (silu)")
        self.hk, self.hv = hk // tp_size, hv // tp_size  # this rank's heads
        self.width = int(config.linear_conv_kernel_dim)
        key, value = hk * self.dk, hv * self.dv
        # q, k, v, z in one product and b, a in another (fp8 checkpoints keep b and a in 16 bits): this rank's heads
        self.in_proj_qkvz = MergedColumnParallelLinear(config.hidden_size, [key, key, value, value], False, tp_rank,
                                                       tp_size)
        self.in_proj_ba = MergedColumnParallelLinear(config.hidden_size, [hv, hv], False, tp_rank, tp_size)
        self.tp_size = tp_size
        self.sections = list(self.in_proj_qkvz.shard_sizes) + list(self.in_proj_ba.shard_sizes)
        self.channels = sum(self.sections[:3])  # q, k, v: the convolved channels
        self.conv_weight = nn.Parameter(torch.empty(self.channels, self.width), requires_grad=False)
        self.conv_weight.weight_loader = self._load_conv
        self.A_log = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        self.dt_bias = nn.Parameter(torch.empty(self.hv), requires_grad=False)
        for p in (self.A_log, self.dt_bias):
            p.weight_loader = self._load_heads
        self.norm_weight = nn.Parameter(torch.ones(self.dv), requires_grad=False)
        self.eps = config.rms_norm_eps
        self.out_proj = RowParallelLinear(value, config.hidden_size, False, tp_rank, tp_size)
        self.tp_rank = tp_rank
        self.states: StateBuffers | None = None

    # ------------------------------------------------------------------ weights and state
    def _load_conv(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        """The checkpoint's conv1d weight [C, 1, K] (all ranks' q, k, v channels): this rank's channels of each."""
        loaded = loaded.reshape(loaded.shape[0], -1)
        parts, start = [], 0
        for n in self.sections[:3]:
            total = n * self.tp_size
            parts.append(loaded[start + self.tp_rank * n: start + (self.tp_rank + 1) * n])
            start += total
        if start != loaded.shape[0] or loaded.shape[1] != self.width:
            raise ValueError(f"linear attention conv1d weight {tuple(loaded.shape)}: expected "
                             f"({start}, {self.width})")
        param.data.copy_(torch.cat(parts))

    def _load_heads(self, param: nn.Parameter, loaded: torch.Tensor) -> None:
        if loaded.shape != (self.hv * self.tp_size,):
            raise ValueError(f"linear attention per-head parameter {tuple(loaded.shape)}: expected "
                             f"({self.hv * self.tp_size},)")
        param.data.copy_(loaded[self.tp_rank * self.hv:(self.tp_rank + 1) * self.hv])

    def state_bytes(self, dtype: torch.dtype) -> int:
        return StateBuffers.bytes_per_slot(self.channels, self.width, self.hv, self.dk, self.dv, dtype)

    def allocate_states(self, slots: int, dtype: torch.dtype, device: torch.device | str) -> None:
        self.states = StateBuffers(slots, self.channels, self.width, self.hv, self.dk, self.dv, dtype, device)

    # ------------------------------------------------------------------ forward
    def forward(self, hidden: torch.Tensor, forward_batch: ForwardBatch) -> torch.Tensor:
        if self.states is None:
            raise RuntimeError("linear attention states are not allocated (ModelRunner allocates them with the pools)")
        mixed, z = self.in_proj_qkvz(hidden).split([self.channels, self.sections[3]], dim=-1)
        b, a = self.in_proj_ba(hidden).split(self.sections[4:], dim=-1)
        beta = b.sigmoid().float()
        g = -self.A_log.float().exp() * F.softplus(a.float() + self.dt_bias)
        if forward_batch.forward_mode.is_decode():
            core = self._decode(mixed, g, beta, forward_batch)
        else:
            core = self._extend(mixed, g, beta, forward_batch)
        return self.out_proj(self._gated_norm(core, z))

    def _gated_norm(self, core: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        """RMSNorm of each value head's output (weight after the cast, as transformers), times SiLU(z)."""
        dtype = z.dtype
        x = core.reshape(-1, self.dv).float()
        x = (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)).to(dtype)
        x = self.norm_weight * x
        out = x.float() * F.silu(z.reshape(-1, self.dv).float())
        return out.to(dtype).reshape(z.shape[0], -1)

    def _split_heads(self, conv_out: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """Convolved [T, C] -> q, k [T, Hv, Dk] (normalised, repeated over their value heads, q scaled), v [T, Hv,
        Dv], float32."""
        q, k, v = conv_out.float().split(self.sections[:3], dim=-1)
        t, r = q.shape[0], self.hv // self.hk
        q = l2_normalize(q.reshape(t, self.hk, self.dk)).repeat_interleave(r, dim=1) * self.dk ** -0.5
        k = l2_normalize(k.reshape(t, self.hk, self.dk)).repeat_interleave(r, dim=1)
        return q, k, v.reshape(t, self.hv, self.dv)

    def _decode(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        st = self.states
        rows = forward_batch.req_pool_indices
        # a CUDA graph's padding rows (KV slot 0) write the padding row, not a request's
        rows = torch.where(forward_batch.out_cache_loc != 0, rows, torch.full_like(rows, st.padding_row))
        window = torch.cat([st.conv[rows], mixed[:, :, None]], dim=-1)  # [B, C, K]
        st.conv.index_copy_(0, rows, window[:, :, 1:])
        conv = F.silu((window.float() * self.conv_weight.float()).sum(-1)).to(mixed.dtype)
        if use_fused(conv):  # the step in one launch, each state slice read and written once
            from radixserve.layers.triton_ops.delta_rule import delta_rule_decode

            return delta_rule_decode(st.ssm, rows, conv, g, beta, self.hk, self.dk, self.dv)
        q, k, v = self._split_heads(conv)
        out, state = delta_rule_step(st.ssm[rows], q, k, v, g, beta)
        st.ssm.index_copy_(0, rows, state)
        return out.to(mixed.dtype)

    def _extend(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor,
                forward_batch: ForwardBatch) -> torch.Tensor:
        lens, prefixes = forward_batch.extend_seq_lens_cpu, forward_batch.extend_prefix_lens_cpu
        if lens is None or prefixes is None:
            raise RuntimeError("linear attention extend needs the batch's extend lengths on the host")
        # a request longer than PAD_TOKENS runs in pieces, each continuing from the state the one before left; a
        # piece also ends where the radix cache asked for a snapshot of the state (copied once the piece ran)
        owner, lens, prefixes, stash = _pieces(lens, prefixes, state_cuts(forward_batch.state_checkpoints))
        rows = forward_batch.req_pool_indices
        st = self.states
        outs, start = [], 0
        for group in _pad_groups(lens, owner):  # consecutive pieces: their tokens are contiguous
            n = sum(lens[i] for i in group)
            part = slice(start, start + n)
            sub_lens, sub_prefixes = [lens[i] for i in group], [prefixes[i] for i in group]
            if len(group) > 1:
                sub_rows = rows[torch.tensor([owner[i] for i in group], device=rows.device)]
                outs.append(self._extend_padded(mixed[part], g[part], beta[part], sub_rows, sub_lens, sub_prefixes))
            else:
                outs.append(self._extend_each(mixed[part], g[part], beta[part], [int(rows[owner[group[0]]])],
                                              sub_lens, sub_prefixes))
            st.keep_checkpoints(group, owner, stash, rows)
            start += n
        return torch.cat(outs)

    def _extend_each(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rows: list[int],
                     lens: list[int], prefixes: list[int]) -> torch.Tensor:
        """The extend request by request (a single request, or lengths too unequal to pad to the longest)."""
        st = self.states
        outs, start = [], 0
        for row, n, prefix in zip(rows, lens, prefixes, strict=True):
            x = mixed[start:start + n]
            if prefix == 0:  # a fresh sequence (or one recomputed from its start)
                st.conv[row].zero_()
                st.ssm[row].zero_()
            window = torch.cat([st.conv[row], x.t()], dim=-1)  # [C, K - 1 + n]
            conv = F.conv1d(window.float()[None], self.conv_weight.float()[:, None, :], groups=self.channels)[0]
            st.conv[row] = window[:, -(self.width - 1):]
            q, k, v = self._split_heads(F.silu(conv).to(mixed.dtype).t())
            gi, bi = g[start:start + n], beta[start:start + n]
            if n == 1:  # (a decode riding in a mixed batch, a one-token chunk): the recurrent step
                o, state = delta_rule_step(st.ssm[row][None], q, k, v, gi, bi)
                state = state[0]
            else:
                o, state = delta_rule_chunked(st.ssm[row], q.transpose(0, 1), k.transpose(0, 1), v.transpose(0, 1),
                                              gi.t(), bi.t())
                o = o.transpose(0, 1)
            st.ssm[row] = state
            outs.append(o)
            start += n
        return torch.cat(outs).to(mixed.dtype)

    def _extend_padded(self, mixed: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, rows: torch.Tensor,
                       lens: list[int], prefixes: list[int]) -> torch.Tensor:
        """The extend of a batch whose requests are of similar lengths, all at once: each request's tokens padded
        to the longest (padding after them: beta = 0 and g = 0 leave the state as it is, and their outputs are
        dropped), the convolution batched, the delta rule over (request, head) sequences."""
        st, b, longest, width = self.states, len(lens), max(lens), self.width
        device = mixed.device
        n = torch.tensor(lens, device=device)
        keep = (torch.tensor(prefixes, device=device) > 0).to(st.ssm.dtype)  # 0: a fresh sequence starts at zero
        x = torch.nn.utils.rnn.pad_sequence(list(mixed.split(lens)), batch_first=True)  # [B, T, C]
        window = torch.cat([st.conv[rows] * keep.to(st.conv.dtype)[:, None, None], x.transpose(1, 2)], dim=-1)
        conv = F.conv1d(window.float(), self.conv_weight.float()[:, None, :], groups=self.channels)  # [B, C, T]
        last = (n[:, None] + torch.arange(width - 1, device=device))[:, None, :].expand(b, self.channels, -1)
        st.conv[rows] = torch.gather(window, 2, last)  # each request's last K - 1 inputs
        q, k, v = self._split_heads(F.silu(conv).to(mixed.dtype).transpose(1, 2).reshape(b * longest, -1))
        real = torch.arange(longest, device=device)[None, :] < n[:, None]  # [B, T]

        def padded(t: torch.Tensor) -> torch.Tensor:  # [tokens, Hv] -> [B x Hv, T], zeros after each request
            out = t.new_zeros((b, longest, t.shape[-1]))
            out[real] = t
            return out.transpose(1, 2).reshape(b * self.hv, longest)

        def heads(t: torch.Tensor) -> torch.Tensor:  # [B x T, Hv, D] -> [B x Hv, T, D]
            return t.reshape(b, longest, self.hv, -1).transpose(1, 2).reshape(b * self.hv, longest, -1)

        state = (st.ssm[rows] * keep[:, None, None, None]).reshape(b * self.hv, self.dk, self.dv)
        o, state = delta_rule_chunked(state, heads(q), heads(k), heads(v), padded(g), padded(beta))
        st.ssm[rows] = state.reshape(b, self.hv, self.dk, self.dv)
        o = o.reshape(b, self.hv, longest, self.dv).transpose(1, 2)  # [B, T, Hv, Dv]
        return o[real].to(mixed.dtype)
