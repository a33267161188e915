"""ForwardMode and ForwardBatch: the device tensors of one forward pass."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum, auto
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from radixserve.layers.attention.base_attn_backend import AttentionBackend
    from radixserve.managers.schedule_batch import ModelWorkerBatch
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.sampling.sampling_batch_info import SamplingBatchInfo

_PAD = torch.zeros(1, dtype=torch.int64)  # one int64: pads a part of the host buffer to 16 bytes


def pack_to_device(parts: list[torch.Tensor], device: torch.device | str, pin: bool = True) -> list[torch.Tensor]:
    """Move 1-D int64 host tensors to `device` as one (pinned, asynchronous) copy; returns views, one per part.

    Each view starts 16-byte aligned (parts of odd length are padded by one): Triton specialises kernels on the
    alignment of their pointer arguments, so unaligned views would compile a new variant of a kernel the first time
    a batch size or token count of the other parity comes (seconds, in the middle of serving)."""
    sizes = [len(t) for t in parts]
    padded: list[torch.Tensor] = []
    for t, n in zip(parts, sizes, strict=True):
        padded.append(t)
        if n % 2:
            padded.append(_PAD)
    host = torch.cat(padded)
    if pin:  # a pageable copy would wait for the stream
        host = host.pin_memory()
    chunks = host.to(device, non_blocking=pin).split([n + n % 2 for n in sizes])
    return [c[:n] if n % 2 else c for c, n in zip(chunks, sizes, strict=True)]


class ForwardMode(IntEnum):
    """What one forward pass computes; the scheduler produces every value (ScheduleBatch, and the speculative step
    for TARGET_VERIFY). TP ranks all run the batches rank 0 broadcasts and DP replicas step independently, so
    without DP attention no rank ever runs a forward without work. With --enable-dp-attention each rank schedules
    its own requests but the MoE/MLP layers are shared by all ranks: a rank with nothing to run while another runs
    a batch runs an IDLE forward (no tokens of its own) so that the collectives of those layers stay in step."""

    EXTEND = auto()  # prefill, possibly on top of a cached prefix
    DECODE = auto()  # one new token per request
    MIXED = auto()  # a prefill chunk together with decode requests (all run as extend)
    # speculative decoding: the target checks each request's last token plus its drafted tokens in one pass, an
    # extend on top of the request's KV that keeps the logits of every position (radixserve/speculative/)
    TARGET_VERIFY = auto()
    IDLE = auto()  # DP attention: no tokens on this rank; it joins the other ranks' MoE/MLP collectives

    def is_extend(self) -> bool:
        return self in (ForwardMode.EXTEND, ForwardMode.MIXED, ForwardMode.TARGET_VERIFY)

    def is_target_verify(self) -> bool:
        return self == ForwardMode.TARGET_VERIFY

    def is_decode(self) -> bool:
        return self == ForwardMode.DECODE

    def is_mixed(self) -> bool:
        return self == ForwardMode.MIXED

    def is_idle(self) -> bool:
        return self == ForwardMode.IDLE


@dataclass
class ForwardBatch:
    forward_mode: ForwardMode
    batch_size: int
    input_ids: torch.Tensor  # [num_tokens] int64
    req_pool_indices: torch.Tensor  # [bs] int64
    seq_lens: torch.Tensor  # [bs] int64 — total length after this forward (prefix + new)
    out_cache_loc: torch.Tensor  # [num_tokens] int64 — KV slots written by this forward
    seq_lens_sum: int
    positions: torch.Tensor  # [num_tokens] int64
    req_to_token_pool: ReqToTokenPool
    token_to_kv_pool: TokenToKVPool
    attn_backend: AttentionBackend
    # extend only (device tensors and their CPU lists)
    extend_seq_lens: torch.Tensor | None = None  # [bs] new tokens per request
    extend_prefix_lens: torch.Tensor | None = None  # [bs] cached tokens per request
    extend_start_loc: torch.Tensor | None = None  # [bs] offset of each request in input_ids
    extend_seq_lens_cpu: list[int] | None = None
    extend_prefix_lens_cpu: list[int] | None = None
    seq_lens_cpu: list[int] | None = None
    # logits of more than the last token (prompt logprobs): positions in input_ids, per request start
    extend_logprob_start_lens_cpu: list[int] | None = None
    return_logprob: bool = False
    top_logprobs_nums: list[int] | None = None
    sampling_info: SamplingBatchInfo | None = None
    # LoRA: the batch's rows grouped by adapter slot (radixserve.lora.batch_info.LoRABatchInfo), None without LoRA
    lora_info: Any = None
    # extend: per request "last" / "mean" / None when the batch holds embedding requests (their pooled hidden
    # states are returned next to the logits)
    pooling: list[str | None] | None = None
    # DP attention: every rank's token count in this forward (the same list on all ranks; None without it). The
    # MoE/MLP layers gather max(dp_num_tokens) rows from every rank.
    dp_num_tokens: list[int] | None = None
    dp_all_decode: bool = False  # every rank decodes or idles: all of them can replay the same CUDA graph
    # MIXED: how many requests at the end are decodes riding along with the prefill (one token each)
    num_mixed_decodes: int = 0
    # extend, hybrid models: (request index, tokens into its extend, snapshot row): after those tokens the
    # linear-attention layers copy the request's state into the snapshot row (the radix cache keeps it)
    state_checkpoints: list[tuple[int, int, int]] | None = None
    # a decode that replays a CUDA graph from its one-copy pack (init_new's fast path): the batch's [6, n] host
    # array (ScheduleBatch.decode_pack), which the replay copies to the graph runner's device pack. The replay also
    # writes the batch's new KV slots into the request table and resolves ids in flight through the model runner's
    # future map; the tensor fields are the graph's buffers, which hold this batch from the replay on.
    decode_pack: torch.Tensor | None = None
    # MLA's expanded prefill on cached prefixes: (pool slots of every request's keys, each request's first key row,
    # its key count), built by the first layer and read by the others (models/deepseek_v2.py)
    mla_key_layout: tuple[torch.Tensor, torch.Tensor, torch.Tensor] | None = None

    @classmethod
    def _init_graph_decode(cls, batch: ModelWorkerBatch, model_runner: ModelRunner,
                           sampling_info: SamplingBatchInfo | None) -> ForwardBatch:
        """A decode batch that will replay a CUDA graph: nothing runs on the device here. The replay copies its
        pack into the graph runner's static device pack and the graph's input kernel does the rest (the graph's
        buffers, the request-table write of the new slots, ids in flight); the tensor fields are views of the graph's
        buffers, which hold this batch from the replay on."""
        n = len(batch.seq_lens_cpu)
        ids, rows, lens, locs, pos = model_runner.cuda_graph_runner.input_views(n)
        fb = cls(
            forward_mode=batch.forward_mode, batch_size=n, input_ids=ids, req_pool_indices=rows,
            seq_lens=lens, out_cache_loc=locs, seq_lens_sum=batch.seq_lens_sum, positions=pos,
            req_to_token_pool=model_runner.req_to_token_pool, token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend, seq_lens_cpu=batch.seq_lens_cpu,
            return_logprob=batch.return_logprob, top_logprobs_nums=batch.top_logprobs_nums,
            sampling_info=sampling_info, decode_pack=batch.decode_pack)
        lora = model_runner.lora_manager
        if lora is not None:
            lora.prepare(fb, batch.lora_slots)
        return fb

    @classmethod
    def init_new(cls, batch: ModelWorkerBatch, model_runner: ModelRunner,
                 sampling_info: SamplingBatchInfo | None = None,
                 future_map: torch.Tensor | None = None,
                 req_to_token_writes: list | None = None) -> ForwardBatch:
        """The device tensors of `batch`. `req_to_token_writes`: queued request-table writes to apply first (on
        CUDA they ride in the batch's one host-to-device copy)."""
        device = model_runner.device
        pool = model_runner.req_to_token_pool
        if batch.decode_pack is not None and _graph_decode_from_pack(batch, model_runner, req_to_token_writes,
                                                                     future_map):
            return cls._init_graph_decode(batch, model_runner, sampling_info)
        if req_to_token_writes and not model_runner.is_cuda:
            pool.apply_writes(req_to_token_writes)
            req_to_token_writes = None
        mode = batch.forward_mode
        is_decode = mode.is_decode()
        input_ids = batch.input_ids
        # Every host tensor this batch needs on the device, in one list: on CUDA they travel as one pinned buffer
        # and one copy (then split into views), instead of a pinned buffer and a copy each.
        parts = [input_ids, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc]
        n_refs = 0
        if future_map is not None and (is_decode or mode.is_mixed()):
            # ids of tokens still in flight are -(slot in the future map): resolve them on the device
            n_refs = batch.num_future_refs
            if n_refs is None:  # unknown: count them
                refs = input_ids.neg().clamp_(min=0)  # the slot, 0 for ids already known
                n_refs = int(refs.count_nonzero())
            elif n_refs == len(input_ids):
                refs = input_ids.neg()
            elif n_refs:
                refs = input_ids.neg().clamp_(min=0)
            if n_refs:
                parts.append(refs)
        positions = None
        ext = pre = start = None
        if is_decode:
            positions = batch.positions
            if positions is None:
                positions = (batch.seq_lens - 1).clamp_(min=0)
            parts.append(positions)
        elif mode.is_extend():
            ext = torch.tensor(batch.extend_seq_lens, dtype=torch.int64)
            pre = torch.tensor(batch.extend_prefix_lens, dtype=torch.int64)
            start = torch.zeros_like(ext)
            if len(ext) > 1:
                start[1:] = torch.cumsum(ext[:-1], 0)
            # positions: prefix_len .. prefix_len + extend_len - 1 for each request
            total = int(ext.sum())
            offs = torch.arange(total, dtype=torch.int64) - torch.repeat_interleave(start, ext)
            positions = offs + torch.repeat_interleave(pre, ext)
            parts += [ext, pre, start, positions]
        if req_to_token_writes:
            parts.append(pool.flatten_writes(req_to_token_writes))
        if model_runner.is_cuda:
            on_dev = pack_to_device(parts, device)
        else:
            on_dev = parts
        if req_to_token_writes:
            pool.apply_device_writes(req_to_token_writes, on_dev.pop())
        d_ids, d_rpi, d_seq_lens, d_out_loc = on_dev[:4]
        rest = list(on_dev[4:])
        if n_refs:
            d_refs = rest.pop(0)
            if n_refs == len(input_ids):  # every id is in flight (steady-state decode under overlap)
                d_ids = future_map[d_refs]
            else:
                d_ids = torch.where(d_ids < 0, future_map[d_refs], d_ids)
        fb = cls(
            forward_mode=mode,
            batch_size=len(batch.seq_lens),
            input_ids=d_ids,
            req_pool_indices=d_rpi,
            seq_lens=d_seq_lens,
            out_cache_loc=d_out_loc,
            seq_lens_sum=batch.seq_lens_sum,
            positions=rest[-1] if positions is not None else None,  # type: ignore[arg-type]
            req_to_token_pool=model_runner.req_to_token_pool,
            token_to_kv_pool=model_runner.token_to_kv_pool,
            attn_backend=model_runner.attn_backend,
            seq_lens_cpu=batch.seq_lens_cpu,
            return_logprob=batch.return_logprob,
            top_logprobs_nums=batch.top_logprobs_nums,
            extend_logprob_start_lens_cpu=batch.extend_logprob_start_lens_cpu,
            sampling_info=sampling_info,
            pooling=batch.pooling,
            dp_num_tokens=batch.dp_num_tokens,
            dp_all_decode=batch.dp_all_decode,
            num_mixed_decodes=batch.num_mixed_decodes,
            state_checkpoints=batch.state_checkpoints,
        )
        if ext is not None:
            fb.extend_seq_lens, fb.extend_prefix_lens, fb.extend_start_loc = rest[0], rest[1], rest[2]
            fb.extend_seq_lens_cpu = list(batch.extend_seq_lens)
            fb.extend_prefix_lens_cpu = list(batch.extend_prefix_lens)
        lora = getattr(model_runner, "lora_manager", None)
        if lora is not None:  # per-row adapter slots, grouped by adapter for the LoRA kernels
            lora.prepare(fb, batch.lora_slots)
        graphs = getattr(model_runner, "cuda_graph_runner", None)
        if not (is_decode and graphs is not None and graphs.can_run(fb)):
            # a decode that replays a CUDA graph gets the graph's metadata at replay: building the eager one too
            # would be host time in every step
            model_runner.attn_backend.init_forward_metadata(fb)
        return fb


def _graph_decode_from_pack(batch: ModelWorkerBatch, model_runner: ModelRunner, writes: list | None,
                            future_map: torch.Tensor | None = None) -> bool:
    """Whether `batch` (a decode with its pack) takes ForwardBatch's one-copy path: on CUDA, a decode graph runs
    it, the pack's rows are still the batch's columns, the only queued request-table write is the batch's own (its
    new slots at its positions, which the graph's input kernel writes), and ids in flight, if any, refer to the
    future map the graphs read (the model runner's)."""
    pack = batch.decode_pack
    if not (model_runner.is_cuda and batch.forward_mode.is_decode() and batch.dp_num_tokens is None):
        return False
    graphs = getattr(model_runner, "cuda_graph_runner", None)
    if graphs is None or not graphs.can_run_decode(len(batch.seq_lens_cpu), batch.seq_lens_cpu):
        return False
    if future_map is not None and batch.num_future_refs != 0 \
            and future_map is not getattr(model_runner, "future_token_ids_map", None):
        return False
    row = pack.stride(0) * pack.element_size()
    if batch.input_ids.data_ptr() != pack.data_ptr() + row or batch.positions is None \
            or batch.positions.data_ptr() != pack.data_ptr() + 5 * row:
        return False
    return writes is not None and len(writes) == 1 and writes[0][0] is batch.req_pool_indices \
        and writes[0][1] is batch.positions


def idle_forward_batch(model_runner: ModelRunner, dp_num_tokens: list[int], all_decode: bool) -> ForwardBatch:
    """DP attention: the forward of a rank without tokens while other ranks run theirs."""
    empty = torch.empty(0, dtype=torch.int64, device=model_runner.device)
    return ForwardBatch(forward_mode=ForwardMode.IDLE, batch_size=0, input_ids=empty, req_pool_indices=empty,
                        seq_lens=empty, out_cache_loc=empty, seq_lens_sum=0, positions=empty,
                        req_to_token_pool=model_runner.req_to_token_pool,
                        token_to_kv_pool=model_runner.token_to_kv_pool, attn_backend=model_runner.attn_backend,
                        dp_num_tokens=list(dp_num_tokens), dp_all_decode=all_decode)
