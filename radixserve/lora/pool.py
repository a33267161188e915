"""The adapter slots on the device, and each adapter's host copy laid out like one slot.

For every base layer that carries LoRA (a `LoRATarget`) the pool holds A [S, n_sub*R, in_local] and
B [S, out_local, R] (S slots, R = --max-lora-rank): sub-projection j's A rows are j*R .. j*R + r, its B rows the
sub-projection's output range, columns 0 .. r. An adapter of rank r < R, or one that does not target some
sub-projection, leaves zeros there (the kernels compute with them, the torch path skips them). Loading an adapter
into a slot is one copy per tensor from its (pinned) host copy, so swapping adapters in and out (LRU) needs no
disk read."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from radixserve.lora.adapter import LoRAWeights
from radixserve.lora.layers import GROUPS, LoRATarget


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
        for t in targets:
            n_sub = len(t.subs)
            out_local = sum(n for _, n in t.out_slices)
            self.a[(t.layer_id, t.group)] = torch.zeros(num_slots, n_sub * max_rank, t.in_local, dtype=dtype,
                                                        device=device)
            self.b[(t.layer_id, t.group)] = torch.zeros(num_slots, out_local, max_rank, dtype=dtype, device=device)
        self.scalings = torch.zeros(num_slots, dtype=torch.float32, device=device)
        self.scalings_cpu = [0.0] * num_slots
        self.ranks = [0] * num_slots
        groups = {t.group for t in targets}
        self.sub_masks = {g: [[False] * len(GROUPS[g]) for _ in range(num_slots)] for g in groups}
        self.slot_names: list[str | None] = [None] * num_slots
        self.nbytes = sum(x.numel() * x.element_size() for x in (*self.a.values(), *self.b.values()))

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
                             f"does not serve (--lora-target-modules)")
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
