"""The adapter slots on the device, and each adapter's host copy laid out like one slot.

For every base layer that carries LoRA (a `LoRATarget`) the pool holds A [S, n_sub*R, in_local] and
B [S, out_local, R] (S slots, R = --max-lora-rank): sub-projection j's A rows are j*R .. j*R + r, its B rows the
sub-projection's output range, columns 0 .. r. An adapter of rank r < R, or one that does not target some
sub-projection, leaves zeros there (the kernels compute with them, the torch path skips them). Loading an adapter
into a slot is one copy per tensor from its (pinned) host copy, so swapping adapters in and out (LRU) needs no
disk read.

Stacking: for an unquantized base layer the pool's A is the tail of one buffer [W; A_0; ...; A_{S-1}] whose head is
the base weight (the layer's `weight` becomes a view of it), so one GEMM computes the base output and every slot's
shrink (x @ A^T) at once, and one expand kernel finishes the layer (triton_ops.lora_expand_stacked). This pays
while the stacked rows are few next to the base rows (the GEMM then reads and computes every slot's A, used or not):
by default when they are at most a quarter of them; `set_lora_stacking` forces it on or off (tests,
comparisons)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.layers.quantization.base import UnquantizedLinearMethod
from radixserve.lora.adapter import LoRAWeights
from radixserve.lora.layers import GROUPS, LoRATarget

_stacking: bool | None = None  # None: when it pays (see the module's docstring)


def set_lora_stacking(enabled: bool | None) -> None:
    """None: stack A under the base weight when it pays (the default); True: whenever the base layer allows it;
    False: never (separate shrink kernels). Read when a pool is built."""
    global _stacking
    _stacking = enabled


def _can_stack(t: LoRATarget, extra_rows: int, dtype: torch.dtype) -> bool:
    base = t.base
    weight = getattr(base, "weight", None)
    if _stacking is False or type(base.quant_method) is not UnquantizedLinearMethod or weight is None:
        return False
    if weight.dtype != dtype or weight.dim() != 2 or not weight.is_contiguous():
        return False
    return _stacking is True or 4 * extra_rows <= weight.shape[0]


@dataclass
class HostAdapter:
    """An adapter ready to go into a slot: this rank's shards, padded to the pool's rank, in the pool's dtype."""

    name: str
    path: str
    rank: int
    scaling: float
    target_modules: set[str]
    tensors: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    sub_masks: dict[str, list[bool]] = field(default_factory=dict)  # group -> targets sub-projection j?
    nbytes: int = 0


class LoRAMemoryPool:
    def __init__(self, targets: list[LoRATarget], num_slots: int, max_rank: int, dtype: torch.dtype,
                 device: str) -> None:
        self.targets = targets
        self.num_slots, self.max_rank = num_slots, max_rank
        self.dtype, self.device = dtype, device
        self.a: dict[tuple[int, str], torch.Tensor] = {}
        self.b: dict[tuple[int, str], torch.Tensor] = {}
        # stacked layers: (the [W; A] buffer, the bias padded with zeros or None) by target
        self.stacked: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor | None]] = {}
        for t in targets:
            key = (t.layer_id, t.group)
            n_sub = len(t.subs)
            out_local = sum(n for _, n in t.out_slices)
            extra = num_slots * n_sub * max_rank
            if _can_stack(t, extra, dtype):
                self.a[key] = self._stack(t, extra).view(num_slots, n_sub * max_rank, t.in_local)
            else:
                self.a[key] = torch.zeros(num_slots, n_sub * max_rank, t.in_local, dtype=dtype, device=device)
            self.b[key] = torch.zeros(num_slots, out_local, max_rank, dtype=dtype, device=device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.scalings_cpu = [0.0] * num_slots
        self.ranks = [0] * num_slots
        groups = {t.group for t in targets}
        self.sub_masks = {g: [[False] * len(GROUPS[g]) for _ in range(num_slots)] for g in groups}
        self.slot_names: list[str | None] = [None] * num_slots
        self.nbytes = sum(x.numel() * x.element_size() for x in (*self.a.values(), *self.b.values()))

    def _stack(self, t: LoRATarget, extra: int) -> torch.Tensor:
        """Move the base weight (and bias) into a buffer with `extra` zero rows under it; returns those rows."""
        base = t.base
        w = base.weight
        n = w.shape[0]
        buf = torch.zeros(n + extra, w.shape[1], dtype=w.dtype, device=w.device)
        buf[:n].copy_(w.data)
        w.data = buf[:n]
        bias = None
        if base.bias is not None:
            bias = torch.zeros(n + extra, dtype=base.bias.dtype, device=base.bias.device)
            bias[:n].copy_(base.bias.data)
            base.bias.data = bias[:n]
        self.stacked[(t.layer_id, t.group)] = (buf, bias)
        return buf[n:]

    def host_copy(self, name: str, weights: LoRAWeights) -> HostAdapter:
        """Shard, pad and cast an adapter's weights into slot layout (pinned when the pool is on CUDA)."""
        cfg = weights.config
        R = self.max_rank
        if cfg.r > R:
            raise ValueError(f"LoRA adapter {name!r} has rank {cfg.r}, above --max-lora-rank {R}")
        groups = {t.group for t in self.targets}
        missing = sorted(m for _, m in weights.weights if not any(m in GROUPS[g] for g in groups))
        if missing:
            raise ValueError(f"LoRA adapter {name!r} targets {', '.join(sorted(set(missing)))}, which this server "
                             f"does not serve: the model has no LoRA layer for it (an ungated MLP's up_proj has no "
                             f"gate_up_proj to carry it) or --lora-target-modules leaves it out")
        pin = torch.device(self.device).type == "cuda"
        host = HostAdapter(name=name, path=cfg.path, rank=cfg.r, scaling=cfg.scaling,
                           target_modules=weights.target_modules,
                           sub_masks={g: [s in weights.target_modules for s in GROUPS[g]] for g in groups})
        for t in self.targets:
            subs = t.subs
            if not any((t.layer_id, s) in weights.weights for s in subs):
                continue
            a = torch.zeros(len(subs) * R, t.in_local, dtype=self.dtype)
            b = torch.zeros(sum(n for _, n in t.out_slices), R, dtype=self.dtype)
            for j, sub in enumerate(subs):
                pair = weights.weights.get((t.layer_id, sub))
                if pair is None:
                    continue
                full_a, full_b = pair
                want_out, want_in = t.full_shape(sub)
                off, n = t.out_slices[j]
                if full_a.shape[1] != want_in or full_b.shape[0] != want_out:
                    raise ValueError(f"LoRA adapter {name!r}: layer {t.layer_id} {sub}: A {tuple(full_a.shape)} / "
                                     f"B {tuple(full_b.shape)} do not fit the model ({want_in} in, {want_out} out)")
                a[j * R:j * R + cfg.r] = t.shard_a(full_a).to(self.dtype)
                b[off:off + n, :cfg.r] = t.shard_b(sub, full_b).to(self.dtype)
            if pin:
                a, b = a.pin_memory(), b.pin_memory()
            host.tensors[(t.layer_id, t.group)] = (a, b)
            host.nbytes += a.numel() * a.element_size() + b.numel() * b.element_size()
        return host

    def load(self, slot: int, host: HostAdapter) -> None:
        """Put `host` into `slot` (queued on the current stream; the host copies are pinned on CUDA)."""
        if not 0 <= slot < self.num_slots:
            raise ValueError(f"LoRA slot {slot} out of range 0..{self.num_slots - 1}")
        for key, a_buf in self.a.items():
            b_buf = self.b[key]
            pair = host.tensors.get(key)
            if pair is None:
                a_buf[slot].zero_()
                b_buf[slot].zero_()
            else:
                a_buf[slot].copy_(pair[0], non_blocking=True)
                b_buf[slot].copy_(pair[1], non_blocking=True)
        self.scalings[slot] = host.scaling
        self.scalings_cpu[slot] = host.scaling
        self.ranks[slot] = host.rank
        for g, mask in host.sub_masks.items():
            self.sub_masks[g][slot] = list(mask)
        self.slot_names[slot] = host.name
