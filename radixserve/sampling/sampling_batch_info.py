"""SamplingBatchInfo: the sampling parameters of a batch as device tensors, filtered and merged with the batch.

Built once per new batch (`from_schedule_batch`), then kept in step with the scheduler's batch:
`filter_batch(keep)` when requests leave, `merge_batch(other)` when a prefill batch joins the running one.
Per step: the sampler calls `apply_logits_bias(logits)`; after sampling the scheduler calls
`update_penalties(next_token_ids)` once (penalty counts and the per-request step counter of seeded sampling).

A CPU mirror of the per-row parameters (`rows`) keeps the batch-level flags exact without reading the device.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from radixserve.sampling.penaltylib.base import host_to_device
from radixserve.sampling.penaltylib.orchestrator import BatchedPenalizerOrchestrator, as_index_list


@dataclass(frozen=True, slots=True)
class RowSamplingInfo:
    """What the CPU needs to know about one row to choose the sampler's code path."""

    greedy: bool
    top_k: int  # effective: 1 for greedy, vocab_size for "all"
    top_p: float
    min_p: float
    seeded: bool
    has_logit_bias: bool


def _logit_bias_entries(bias: dict[Any, float] | None, vocab_size: int) -> list[tuple[int, float]]:
    if not bias:
        return []
    entries = []
    for key, value in bias.items():
        tid = int(key)
        if not 0 <= tid < vocab_size:
            raise ValueError(f"logit_bias: token id {key!r} out of range [0, {vocab_size})")
        entries.append((tid, float(value)))
    return entries


@dataclass
class SamplingBatchInfo:
    temperatures: torch.Tensor  # [bs, 1] float32 (1.0 for greedy rows)
    top_ps: torch.Tensor  # [bs] float32
    top_ks: torch.Tensor  # [bs] int64 (vocab_size when disabled, 1 for greedy rows)
    min_ps: torch.Tensor  # [bs] float32
    seeds: torch.Tensor  # [bs] int64, -1 when the request has no seed
    # [bs] int64: tokens each request had produced when last brought up to date; `sampling_steps` adds the steps
    # counted since on the host (only seeded sampling reads the counter, so a batch without a seeded row runs no
    # device op for it each step)
    steps_base: torch.Tensor
    vocab_size: int
    device: torch.device
    rows: list[RowSamplingInfo]
    penalizer_orchestrator: BatchedPenalizerOrchestrator
    logit_bias: torch.Tensor | None = None  # [bs, vocab] float32, only when some row has a bias
    vocab_mask: torch.Tensor | None = None  # [bs, vocab] bool, True = disallowed (grammar); filled per step

    # Batch-level flags, derived from `rows` (never from the device).
    is_all_greedy: bool = field(default=True, init=False)
    has_greedy: bool = field(default=False, init=False)
    need_top_k: bool = field(default=False, init=False)
    need_top_p: bool = field(default=False, init=False)
    need_min_p_sampling: bool = field(default=False, init=False)
    has_seeded: bool = field(default=False, init=False)
    seeded_indices: torch.Tensor | None = field(default=None, init=False)  # rows sampled with their own seed
    steps_behind: int = field(default=0, init=False)  # steps every row took since steps_base was brought up to date

    def __post_init__(self) -> None:
        self._refresh_flags()

    @property
    def sampling_steps(self) -> torch.Tensor:
        """[bs] int64: the tokens each request has produced (the seeded sampler's counter)."""
        if self.steps_behind:
            self.steps_base = self.steps_base + self.steps_behind
            self.steps_behind = 0
        return self.steps_base

    @property
    def batch_size(self) -> int:
        return len(self.rows)

    def __len__(self) -> int:
        return len(self.rows)

    # ------------------------------------------------------------------ construction
    @classmethod
    def from_schedule_batch(cls, batch: Any, vocab_size: int) -> SamplingBatchInfo:
        """batch: `.reqs` (each with `.sampling_params`, `.origin_input_ids`, `.output_ids`, `.eos_token_ids`)
        and `.device`. The sampling parameters are assumed verified."""
        reqs = list(batch.reqs)
        device = torch.device(batch.device)
        vocab_size = int(vocab_size)
        rows: list[RowSamplingInfo] = []
        floats: list[list[float]] = [[], [], []]  # temperature, top_p, min_p
        ints: list[list[int]] = [[], [], []]  # top_k, seed, steps
        bias_rows: list[int] = []
        bias_cols: list[int] = []
        bias_vals: list[float] = []
        for i, req in enumerate(reqs):
            p = req.sampling_params
            greedy = bool(p.is_greedy)
            top_k = 1 if greedy else (vocab_size if p.top_k < 0 else min(int(p.top_k), vocab_size))
            entries = _logit_bias_entries(p.logit_bias, vocab_size)
            for tid, value in entries:
                bias_rows.append(i)
                bias_cols.append(tid)
                bias_vals.append(value)
            rows.append(RowSamplingInfo(greedy=greedy, top_k=top_k, top_p=float(p.top_p), min_p=float(p.min_p),
                                        seeded=p.seed is not None, has_logit_bias=bool(entries)))
            floats[0].append(1.0 if greedy else float(p.temperature))
            floats[1].append(float(p.top_p))
            floats[2].append(float(p.min_p))
            ints[0].append(top_k)
            ints[1].append(-1 if p.seed is None else int(p.seed))
            ints[2].append(len(req.output_ids))
        float_t = host_to_device(floats, torch.float32, device)
        int_t = host_to_device(ints, torch.int64, device)
        logit_bias = None
        if bias_rows:
            logit_bias = torch.zeros((len(reqs), vocab_size), dtype=torch.float32, device=device)
            index = host_to_device([bias_rows, bias_cols], torch.int64, device)
            logit_bias[index[0], index[1]] = host_to_device(bias_vals, torch.float32, device)
        return cls(
            temperatures=float_t[0].contiguous().view(-1, 1),
            top_ps=float_t[1].contiguous(),
            top_ks=int_t[0].contiguous(),
            min_ps=float_t[2].contiguous(),
            seeds=int_t[1].contiguous(),
            steps_base=int_t[2].contiguous(),
            vocab_size=vocab_size,
            device=device,
            rows=rows,
            penalizer_orchestrator=BatchedPenalizerOrchestrator(vocab_size, device, reqs),
            logit_bias=logit_bias,
        )

    def _refresh_flags(self) -> None:
        rows = self.rows
        sampled = [r for r in rows if not r.greedy]
        self.is_all_greedy = not sampled
        self.has_greedy = len(sampled) != len(rows)
        self.need_top_k = any(r.top_k < self.vocab_size for r in sampled)
        self.need_top_p = any(r.top_p < 1.0 for r in sampled)
        self.need_min_p_sampling = any(r.min_p > 0.0 for r in sampled)
        seeded = [i for i, r in enumerate(rows) if r.seeded and not r.greedy]
        self.has_seeded = bool(seeded)
        self.seeded_indices = host_to_device(seeded, torch.int64, self.device) if seeded else None
        if self.logit_bias is not None and not any(r.has_logit_bias for r in rows):
            self.logit_bias = None

    # ------------------------------------------------------------------ batch membership
    def filter_batch(self, keep_indices: Sequence[int] | torch.Tensor) -> None:
        """Keep these rows, in this order (a CPU list; a tensor costs one device sync)."""
        keep = as_index_list(keep_indices, self.batch_size)
        index = host_to_device(keep, torch.int64, self.device)
        self.steps_base = self.sampling_steps
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "seeds", "steps_base"):
            setattr(self, name, getattr(self, name)[index])
        if self.logit_bias is not None:
            self.logit_bias = self.logit_bias[index]
        if self.vocab_mask is not None:
            self.vocab_mask = self.vocab_mask[index]
        self.penalizer_orchestrator.filter(keep)
        self.rows = [self.rows[i] for i in keep]
        self._refresh_flags()

    def merge_batch(self, other: SamplingBatchInfo) -> None:
        """Append other's rows after ours (other is consumed)."""
        if other.vocab_size != self.vocab_size:
            raise ValueError(f"merge_batch: vocab_size {other.vocab_size} != {self.vocab_size}")
        self.steps_base, other.steps_base = self.sampling_steps, other.sampling_steps
        for name in ("temperatures", "top_ps", "top_ks", "min_ps", "seeds", "steps_base"):
            setattr(self, name, torch.cat([getattr(self, name), getattr(other, name)], dim=0))
        self.logit_bias = self._merge_dense(self.logit_bias, other.logit_bias, other.batch_size, torch.float32)
        self.vocab_mask = self._merge_dense(self.vocab_mask, other.vocab_mask, other.batch_size, torch.bool)
        self.penalizer_orchestrator.merge(other.penalizer_orchestrator)
        self.rows = self.rows + other.rows
        self._refresh_flags()

    def _merge_dense(self, mine: torch.Tensor | None, theirs: torch.Tensor | None, their_bs: int,
                     dtype: torch.dtype) -> torch.Tensor | None:
        if mine is None and theirs is None:
            return None
        if mine is None:
            mine = torch.zeros((self.batch_size, self.vocab_size), dtype=dtype, device=self.device)
        if theirs is None:
            theirs = torch.zeros((their_bs, self.vocab_size), dtype=dtype, device=self.device)
        return torch.cat([mine, theirs], dim=0)

    # ------------------------------------------------------------------ per step
    def apply_logits_bias(self, logits: torch.Tensor) -> None:
        """Penalties, then logit_bias, then the grammar mask, in place on float32 logits [bs, vocab]."""
        if logits.dim() != 2 or logits.shape[0] != self.batch_size or logits.shape[1] != self.vocab_size:
            raise ValueError(f"logits: expected shape ({self.batch_size}, {self.vocab_size}), "
                             f"got {tuple(logits.shape)}")
        self.penalizer_orchestrator.apply(logits)
        if self.logit_bias is not None:
            logits.add_(self.logit_bias)
        if self.vocab_mask is not None:
            logits.masked_fill_(self.vocab_mask, float("-inf"))

    def update_penalties(self, next_token_ids: torch.Tensor) -> None:
        """Once per step, after sampling: count the new tokens and advance every row's step counter."""
        self.penalizer_orchestrator.cumulate_output_tokens(next_token_ids)
        # Counted on the host; the tensor is brought up to date out of place when read (a copy of this info handed
        # to another thread keeps its own counter)
        self.steps_behind += 1
