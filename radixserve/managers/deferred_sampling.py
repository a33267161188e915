"""DeferredSamplingInfo: the scheduler's handle on a batch's SamplingBatchInfo.

The scheduler decides *what* happens to a batch's sampling state (build it for new requests, drop finished rows,
merge two batches); the worker, which runs the forwards in order, is the only one that touches the device state.
So the scheduler records operations, each ModelWorkerBatch carries the operations recorded since the last one, and
the worker replays them just before sampling. Under overlap scheduling this is what keeps penalties, logit bias and
seeded sampling exact: batch N+1's operations are applied after batch N has sampled and updated its counts."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any

from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

Op = tuple[Any, ...]


class DeferredSamplingInfo:
    def __init__(self, reqs: list[Any], device: str, vocab_size: int) -> None:
        self.real: SamplingBatchInfo | None = None
        self.pending: list[Op] = [("build", list(reqs), device, vocab_size)]

    # ---------------------------------------------------------------- scheduler side (records only)
    def filter_batch(self, keep_indices: list[int]) -> None:
        self.pending.append(("filter", list(keep_indices)))

    def merge_batch(self, other: DeferredSamplingInfo) -> None:
        self.pending.append(("merge", other, other.take_ops()))

    def take_ops(self) -> list[Op]:
        ops, self.pending = self.pending, []
        return ops

    # ---------------------------------------------------------------- worker side
    def apply(self, ops: list[Op]) -> SamplingBatchInfo:
        for op in ops:
            kind = op[0]
            if kind == "build":
                _, reqs, device, vocab = op
                self.real = SamplingBatchInfo.from_schedule_batch(SimpleNamespace(reqs=reqs, device=device), vocab)
            elif kind == "filter":
                self.real.filter_batch(op[1])
            elif kind == "merge":
                _, other, other_ops = op
                other.apply(other_ops)
                self.real.merge_batch(other.real)
            else:
                raise ValueError(f"unknown sampling op {kind!r}")
        if self.real is None:
            raise RuntimeError("sampling info used before it was built")
        return self.real
