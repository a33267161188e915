"""Batched penalties: one file per penalty, combined by BatchedPenalizerOrchestrator."""

from radixserve.sampling.penaltylib.base import BatchedPenalizer
from radixserve.sampling.penaltylib.frequency_penalty import BatchedFrequencyPenalizer
from radixserve.sampling.penaltylib.min_new_tokens import BatchedMinNewTokensPenalizer
from radixserve.sampling.penaltylib.orchestrator import DEFAULT_PENALIZERS, BatchedPenalizerOrchestrator
from radixserve.sampling.penaltylib.presence_penalty import BatchedPresencePenalizer
from radixserve.sampling.penaltylib.repetition_penalty import BatchedRepetitionPenalizer

__all__ = [
    "DEFAULT_PENALIZERS",
    "BatchedFrequencyPenalizer",
    "BatchedMinNewTokensPenalizer",
    "BatchedPenalizer",
    "BatchedPenalizerOrchestrator",
    "BatchedPresencePenalizer",
    "BatchedRepetitionPenalizer",
]
