"""The scheduler side of the adapter pool: which adapter sits in which device slot, least recently used first out.

Every TP rank's scheduler runs the same batches, so every rank's table makes the same choices. A batch's adapters
must fit the slots at once (admission keeps at most `num_slots` distinct adapters among the running and the new
requests); an adapter not in a slot goes into a free slot or replaces the least recently used one that this batch
does not need, and the load travels with the batch to the worker."""

from __future__ import annotations

from collections import OrderedDict


class LoRASlotTable:
    def __init__(self, num_slots: int) -> None:
        if num_slots <= 0:
            raise ValueError(f"--max-loras-per-batch must be positive; got {num_slots}")
        self.num_slots = num_slots
        self.slot_of: OrderedDict[str, int] = OrderedDict()  # least recently used first
        self.num_loads = 0  # adapters copied into a slot so far (swaps included)

    def assign(self, lora_ids: list[str | None]) -> tuple[list[int], list[tuple[int, str]]]:
        """Slots for a batch's rows (-1: the base model) and the loads needed first, as (slot, adapter)."""
        needed = list(dict.fromkeys(x for x in lora_ids if x is not None))
        if len(needed) > self.num_slots:
            raise RuntimeError(f"a batch needs {len(needed)} LoRA adapters but there are {self.num_slots} slots "
                               f"(admission should have prevented this)")
        loads: list[tuple[int, str]] = []
        need = set(needed)
        for name in needed:
            if name in self.slot_of:
                self.slot_of.move_to_end(name)
                continue
            used = set(self.slot_of.values())
            free = [s for s in range(self.num_slots) if s not in used]
            if free:
                slot = free[0]
            else:
                victim = next(n for n in self.slot_of if n not in need)
                slot = self.slot_of.pop(victim)
            self.slot_of[name] = slot
            loads.append((slot, name))
            self.num_loads += 1
        return [-1 if x is None else self.slot_of[x] for x in lora_ids], loads

    def forget(self, name: str) -> None:
        """An unloaded adapter leaves its slot (a later adapter of the same name is loaded afresh)."""
        self.slot_of.pop(name, None)
