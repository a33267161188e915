"""Messages between the processes (pickled over ZMQ). One dataclass per message kind."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from radixserve.sampling.sampling_params import SamplingParams


@dataclass
class TokenizedGenerateReqInput:
    """TokenizerManager → Scheduler: one request, already tokenized and validated."""

    rid: str
    input_text: str | None
    input_ids: list[int]
    sampling_params: SamplingParams
    stream: bool = False
    return_logprob: bool = False
    logprob_start_len: int = -1  # -1: no prompt logprobs
    top_logprobs_num: int = 0
    lora_id: str | None = None  # the LoRA adapter's name (None: the base model)
    pooling: str | None = None  # an embedding request ("last" / "mean"): prefill only, the pooled hidden state out
    log_metrics: bool = True  # False: left out of /metrics and /stats (health probes, n > 1's shared prefill)


@dataclass
class AbortReq:
    rid: str
    message: str = "aborted"


@dataclass
class BatchTokenIDOut:
    """Scheduler → Detokenizer: what each request produced since the last message."""

    rids: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta_infos: list[dict[str, Any]]  # prompt/completion/cached token counts and logprob deltas
    skip_special_tokens: list[bool]
    spaces_between_special_tokens: list[bool]
    no_stop_trim: list[bool]
    stop_strs: list[list[str]] = field(default_factory=list)


@dataclass
class BatchStrOut:
    """Detokenizer → TokenizerManager: new text per request."""

    rids: list[str]
    text_deltas: list[str]
    new_token_ids: list[list[int]]
    finished_reasons: list[dict[str, Any] | None]
    meta_infos: list[dict[str, Any]]


@dataclass
class FlushCacheReq:
    seq: int = 0  # the tokenizer manager's number for the request; its reply carries it back


@dataclass
class FlushCacheReqOutput:
    success: bool
    message: str = ""
    seq: int = 0


@dataclass
class GetInternalStateReq:
    seq: int = 0  # the tokenizer manager's number for the request; its reply carries it back


@dataclass
class GetInternalStateReqOutput:
    state: dict[str, Any] = field(default_factory=dict)
    seq: int = 0


@dataclass
class LoadLoRAAdapterReq:
    """Read a PEFT adapter folder on every TP rank and serve it under `name`."""

    name: str
    path: str
    seq: int = 0


@dataclass
class LoadLoRAAdapterReqOutput:
    success: bool
    message: str = ""
    seq: int = 0
    name: str = ""


@dataclass
class UnloadLoRAAdapterReq:
    """Stop serving adapter `name`: new requests for it fail at once, running ones finish first, then its cache
    entries and host copy are dropped."""

    name: str
    seq: int = 0


@dataclass
class UnloadLoRAAdapterReqOutput:
    success: bool
    message: str = ""
    seq: int = 0  # replies come when each unload is done, not in the order asked: matched by seq
    name: str = ""


@dataclass
class SchedulerLoadReport:
    """A DP replica's scheduler (rank 0) → the data-parallel controller, when it changed: the requests it holds
    (waiting, running, being prefilled) after taking in `num_received` generate requests in all."""

    num_reqs: int
    num_received: int


@dataclass
class SchedulerInfo:
    """Sent by the scheduler once at start-up, through the readiness pipe."""

    max_total_num_tokens: int
    max_running_requests: int
    context_len: int
    vocab_size: int
    device: str
    dtype: str
    attention_backend: str


@dataclass
class GenerateReqInput:
    """What a caller (HTTP or Engine) asks for; normalised into one or many TokenizedGenerateReqInputs."""

    text: str | list[str] | None = None
    input_ids: list[int] | list[list[int]] | None = None
    sampling_params: dict[str, Any] | list[dict[str, Any]] | None = None
    rid: str | list[str] | None = None
    stream: bool = False
    return_logprob: bool | list[bool] = False
    logprob_start_len: int | list[int] = -1
    top_logprobs_num: int | list[int] = 0
    lora_path: str | list[str | None] | None = None  # LoRA adapter name(s); None: the base model
    pooling: str | None = None  # embeddings: "last" / "mean" (sampling_params are then ignored: prefill only)
    log_metrics: bool = True  # False: a request of the server's own (a health probe), not counted in /metrics

    def is_batch(self) -> bool:
        if self.text is not None:
            return isinstance(self.text, list)
        return bool(self.input_ids) and isinstance(self.input_ids[0], list)
