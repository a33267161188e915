"""Req, ScheduleBatch and ModelWorkerBatch.

ScheduleBatch is the scheduler's view: Python Req objects, prefix matches, memory decisions. get_model_worker_batch()
copies out only what a forward pass needs (ModelWorkerBatch: plain tensors and lists, safe to hand to another
thread); the model runner then turns that into a ForwardBatch on the device.
"""

from __future__ import annotations

import time
from concurrent.futures import Future
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from radixserve.managers.deferred_sampling import DeferredSamplingInfo
from radixserve.managers.finish_reason import (
    FinishAbort,
    FinishLength,
    FinishMatchedStr,
    FinishMatchedToken,
    FinishReason,
)
from radixserve.model_executor.forward_batch_info import ForwardMode

if TYPE_CHECKING:
    from radixserve.lora.slots import LoRASlotTable
    from radixserve.managers.tp_worker import GenerationBatchResult
    from radixserve.mem_cache.base_prefix_cache import BasePrefixCache
    from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
    from radixserve.mem_cache.radix_cache import TreeNode
    from radixserve.sampling.sampling_params import SamplingParams


class Req:
    """One request's life in the scheduler."""

    def __init__(self, rid: str, origin_input_ids: list[int], sampling_params: SamplingParams,
                 eos_token_ids: set[int] | None = None, return_logprob: bool = False, logprob_start_len: int = -1,
                 top_logprobs_num: int = 0, stream: bool = False, lora_id: str | None = None) -> None:
        self.rid = rid
        self.lora_id = lora_id  # the LoRA adapter's name (None: the base model); part of the radix cache key
        self.origin_input_ids = list(origin_input_ids)
        self.sampling_params = sampling_params
        self.output_ids: list[int] = []
        self.eos_token_ids = set(eos_token_ids or ())
        self.stream = stream
        self.finished_reason: FinishReason | None = None
        self.to_abort: str | None = None
        # memory
        self.req_pool_idx: int | None = None
        self.prefix_indices = torch.empty(0, dtype=torch.int64)
        self.last_node: TreeNode | None = None
        self.fill_ids: list[int] = []
        self.extend_input_len = 0
        self.kv_committed_len: int | None = None  # tokens whose KV is written (set after each forward)
        # a hybrid model's planned state snapshots inside its next forward: (tokens, snapshot row) (HybridRadixCache)
        self.state_checkpoints: list[tuple[int, int]] = []
        self.chunk_snapshot: TreeNode | None = None  # ... and the node of the snapshot after its last chunk
        # a request admitted after this one will share its first shared_len tokens (set at admission): a hybrid
        # model's cache leaves a state snapshot there
        self.shared_len = 0
        # Overlap scheduling: (batch id, future slot) of a sampled token not yet copied back to the CPU.
        # Its id is referred to as -(future slot) in the next batch's input_ids and resolved on the device.
        self.pending_token: tuple[int, int] | None = None
        # wall-clock stamps (time.time(), comparable across the server's processes): received by the scheduler,
        # first admitted to a prefill batch, first token (or pooled output) produced; sent with its first output
        self.time_recv = time.time()
        self.time_prefill: float | None = None
        self.time_first_token: float | None = None
        self.is_chunked = 0  # > 0 while the prompt is being prefilled in chunks
        self.cached_tokens = 0  # prompt tokens served from the radix cache (first admission)
        self._admitted = False
        self.num_retractions = 0
        # logprobs
        self.return_logprob = return_logprob
        self.logprob_start_len = logprob_start_len
        self.top_logprobs_num = top_logprobs_num
        self.output_token_logprobs: list[tuple[float, int]] = []
        self.output_top_logprobs: list[list[tuple[float, int]]] = []
        self.input_token_logprobs: list[tuple[float | None, int]] | None = None
        self.input_top_logprobs: list[list[tuple[float, int]] | None] | None = None
        self.sent_offset = 0  # output tokens already streamed out
        self.sent_logprob_offset = 0
        # stop strings are checked on decoded text (the scheduler holds a tokenizer for that)
        self.stop_strs: list[str] = list(sampling_params.stop or [])
        # structured output: the compile future while in the grammar queue, then this request's own matcher
        # (a radixserve.constrained BaseGrammarObject that has accepted exactly output_ids)
        self.grammar_future: Any = None
        self.grammar: Any = None
        # embeddings: a prefill-only request whose output is its pooled last hidden state ("last" / "mean"); the
        # sum of a mean accumulates over prefill chunks
        self.pooling: str | None = None
        self.pool_sum: torch.Tensor | None = None
        self.pool_count = 0
        self.embedding: list[float] | None = None
        # speculative decoding: the drafter's per-request state, verify steps taken and the tokens they produced,
        # and the adaptive back-off's recent accepted-draft counts, pause length and steps left to pause
        self.spec_state: Any = None
        self.spec_verify_ct = 0
        self.spec_tokens = 0
        self.spec_history: list[int] = []
        self.spec_backoff = 0
        self.spec_pause = 0

    # ---------------------------------------------------------------- prefix and fill
    def init_next_round_input(self, tree_cache: BasePrefixCache | None) -> None:
        self.fill_ids = self.origin_input_ids + self.output_ids
        if tree_cache is not None:
            # at least one token must run through the model, and prompt logprobs need their tokens computed
            max_prefix = len(self.fill_ids) - 1
            if self.return_logprob and self.logprob_start_len >= 0:
                max_prefix = min(max_prefix, self.logprob_start_len)
            if self.pooling == "mean":
                max_prefix = 0  # every token's hidden state is needed (the cache holds KV, not hidden states)
            self.prefix_indices, self.last_node = tree_cache.match_prefix(self.fill_ids[:max(0, max_prefix)],
                                                                          self.lora_id)
        self.extend_input_len = len(self.fill_ids) - len(self.prefix_indices)

    @property
    def seqlen(self) -> int:
        """Tokens in the sequence, counting a sampled token still in flight."""
        return len(self.origin_input_ids) + len(self.output_ids) + (self.pending_token is not None)

    def finished(self) -> bool:
        return self.finished_reason is not None

    # ---------------------------------------------------------------- finishing
    def check_finished(self, tokenizer: Any = None) -> None:
        if self.finished_reason is not None:
            return
        if self.to_abort is not None:
            self.finished_reason = FinishAbort(self.to_abort)
            return
        sp = self.sampling_params
        out = self.output_ids
        n = len(out)
        # an end-of-sequence or stop token, or a stop string, on the last allowed token is a stop (as OpenAI and
        # vLLM report it, the stop string trimmed), not a length finish
        if n and n >= sp.min_new_tokens:
            last = out[-1]
            if (not sp.ignore_eos and last in self.eos_token_ids) or \
                    (sp.stop_token_ids and last in sp.stop_token_ids):
                self.finished_reason = FinishMatchedToken(last)
                return
            if self.stop_strs and tokenizer is not None:
                m = max(1, getattr(sp, "stop_str_max_len", 8)) + 2
                tail = tokenizer.decode(out[-m:], skip_special_tokens=sp.skip_special_tokens)
                for s in self.stop_strs:
                    if s in tail:
                        self.finished_reason = FinishMatchedStr(s)
                        return
        if n >= sp.max_new_tokens:
            self.finished_reason = FinishLength(sp.max_new_tokens)

    def __repr__(self) -> str:
        return f"Req(rid={self.rid}, input={len(self.origin_input_ids)}, output={len(self.output_ids)})"


@dataclass
class LaunchedBatch:
    """What the scheduler keeps of a batch it launched until it processes the batch's results: the batch itself
    changes (filtered, merged) before that under overlap scheduling."""

    bid: int  # the forward count when it was launched
    reqs: list[Req]
    forward_mode: ForwardMode
    n_prefill: int  # MIXED: the requests after the first n_prefill ride along as one-token decodes
    return_logprob: bool
    chunked_req: Req | None  # a request of this batch whose prompt is still being prefilled in chunks
    result: GenerationBatchResult | None = None  # None under overlap: the forward thread holds it
    spec: Any = None  # a speculative verify step: its drafts' slots (radixserve/speculative/scheduler_mixin.py)


@dataclass
class ModelWorkerBatch:
    forward_mode: ForwardMode
    input_ids: torch.Tensor
    req_pool_indices: torch.Tensor
    seq_lens: torch.Tensor
    seq_lens_cpu: list[int]
    out_cache_loc: torch.Tensor
    seq_lens_sum: int
    extend_seq_lens: list[int] | None
    extend_prefix_lens: list[int] | None
    return_logprob: bool
    top_logprobs_nums: list[int] | None
    extend_logprob_start_lens_cpu: list[int | None] | None
    sampling_info: DeferredSamplingInfo | None
    sampling_ops: list  # operations on sampling_info recorded since the last batch (replayed by the worker)
    req_to_token_writes: list  # queued writes to the device request table (applied by the worker)
    # decode: the positions (seq_lens - 1) when the scheduler already has them (the worker computes them otherwise)
    positions: torch.Tensor | None = None
    # decode: the host array of a header row and the rows input_ids .. positions (ScheduleBatch.decode_pack), or None
    decode_pack: torch.Tensor | None = None
    # decode: how many input ids are -(future slot) (None: unknown, the worker counts them)
    num_future_refs: int | None = None
    # structured output: packed int32 token bitmask [bs, ceil(vocab/32)] (bit set = allowed), rows in batch order;
    # set by the scheduler for batches with constrained requests, unpacked into sampling_info.vocab_mask
    grammar_bitmask: torch.Tensor | Future | None = None  # a Future under overlap (set once the batch in flight
    # before it has been processed; the worker waits for it after the forward, before sampling)
    # LoRA: each request's adapter slot (-1: the base model), and the (slot, adapter) loads to apply first
    lora_slots: list[int] | None = None
    lora_loads: list[tuple[int, str]] | None = None
    # extend: each request's pooling ("last" / "mean" / None) when the batch holds embedding requests
    pooling: list[str | None] | None = None
    # DP attention: every rank's token count in this forward (set by the scheduler after the ranks synced)
    dp_num_tokens: list[int] | None = None
    dp_all_decode: bool = False  # ... and every rank decodes (or idles): a CUDA graph may run
    # MIXED: how many requests at the end ride along as one-token decodes (after the n_prefill prefill requests)
    num_mixed_decodes: int = 0
    # extend, hybrid models: (request index, tokens into its extend, snapshot row) where the forward copies a
    # request's recurrent state (HybridRadixCache.prepare_extend)
    state_checkpoints: list[tuple[int, int, int]] | None = None
    # hybrid models: (src row, dst row) state copies the cache queued (snapshots taken, snapshots loaded into new
    # requests' rows), applied in order before this forward (mem_cache/state_pool.py)
    state_copies: list[tuple[int, int]] | None = None


class ScheduleBatch:
    def __init__(self, reqs: list[Req], req_to_token_pool: ReqToTokenPool, token_to_kv_pool: TokenToKVPool,
                 tree_cache: BasePrefixCache | None, device: str, vocab_size: int) -> None:
        self.reqs = reqs
        self.req_to_token_pool = req_to_token_pool
        self.token_to_kv_pool = token_to_kv_pool
        self.tree_cache = tree_cache
        self.device = device
        self.vocab_size = vocab_size
        self.forward_mode = ForwardMode.EXTEND
        self.input_ids = torch.empty(0, dtype=torch.int64)
        self.dp_num_tokens: list[int] | None = None  # DP attention: every rank's token count (set each step)
        self.dp_all_decode = False  # DP attention: every rank decodes or idles this step
        self.req_pool_indices = torch.empty(0, dtype=torch.int64)
        self.seq_lens = torch.empty(0, dtype=torch.int64)
        self.out_cache_loc = torch.empty(0, dtype=torch.int64)
        self.prefix_lens: list[int] = []
        self.extend_lens: list[int] = []
        self.state_checkpoints: list[tuple[int, int, int]] = []  # extend: see ModelWorkerBatch
        self.n_prefill = len(reqs)  # for MIXED: the first n_prefill requests are the prefill, the rest decode
        self.sampling_info: DeferredSamplingInfo | None = None
        # host-side copies of what prepare_for_* computed (None once filter/merge changed the batch)
        self.seq_lens_list: list[int] | None = None
        self.positions: torch.Tensor | None = None  # decode only
        # decode only: the [6, n rounded up to even] host array of prepare_for_decode: a header row (batch size, row
        # stride), then rows viewed as input_ids, req_pool_indices, seq_lens, out_cache_loc and positions; moved to
        # the device in one copy (pinned on CUDA)
        self.decode_pack: torch.Tensor | None = None
        self._pin_pack = torch.device(device).type == "cuda"
        self._packs: dict[tuple[int, int], tuple] = {}  # (batch size, turn) -> a host array and its views (`_pack`)
        self._pack_turn = 0
        self.num_future_refs: int | None = None  # decode only: input ids that refer to a token still in flight
        self.lora_table: LoRASlotTable | None = None  # the scheduler's adapter slots (None: LoRA is off)

    def __len__(self) -> int:
        return len(self.reqs)

    def is_empty(self) -> bool:
        return not self.reqs

    @property
    def return_logprob(self) -> bool:
        return any(r.return_logprob for r in self.reqs)

    # ---------------------------------------------------------------- memory
    def _alloc(self, need: int, alloc: Any) -> torch.Tensor:
        """Run `alloc` (a pool allocation taking `need` tokens of pages), evicting from the cache if it fails."""
        out = alloc()
        if out is None and self.tree_cache is not None:
            self.tree_cache.evict(need - self.token_to_kv_pool.available_size())
            out = alloc()
        if out is None:
            raise RuntimeError(f"out of KV memory: need {need} slots, {self.token_to_kv_pool.available_size()} free "
                               f"(admission should have prevented this)")
        return out

    def _write_req_to_token(self, rows: list[int], starts: list[int], lens: list[int], values: torch.Tensor) -> None:
        """One batched write of new KV slots into the request table (the mirror now, the device at the forward)."""
        if not rows:
            return
        if all(n == 1 for n in lens):  # decode: one slot per request
            row_idx, col_idx = torch.tensor(rows, dtype=torch.int64), torch.tensor(starts, dtype=torch.int64)
        else:
            lens_np = np.asarray(lens, dtype=np.int64)
            row_np = np.repeat(np.asarray(rows, dtype=np.int64), lens_np)
            seg_start = np.cumsum(lens_np) - lens_np
            col_np = np.arange(int(lens_np.sum()), dtype=np.int64) - np.repeat(seg_start - np.asarray(
                starts, dtype=np.int64), lens_np)
            row_idx, col_idx = torch.from_numpy(row_np), torch.from_numpy(col_np)
        self.req_to_token_pool.write_batch(row_idx, col_idx, values)

    # ---------------------------------------------------------------- prefill
    def prepare_for_extend(self) -> None:
        self.forward_mode = ForwardMode.EXTEND
        reqs = self.reqs
        new_rows = [r for r in reqs if r.req_pool_idx is None]
        if new_rows:
            slots = self.req_to_token_pool.alloc(len(new_rows))
            if slots is None:
                raise RuntimeError("out of request slots (admission should have prevented this)")
            for r, s in zip(new_rows, slots, strict=True):
                r.req_pool_idx = s
        if self.tree_cache is not None:  # (a hybrid model: the cached prefixes' recurrent states, checkpoints)
            self.state_checkpoints = self.tree_cache.prepare_extend(reqs, new_rows)
        self.prefix_lens = [len(r.prefix_indices) for r in reqs]
        self.extend_lens = [r.extend_input_len for r in reqs]
        for r, pre in zip(reqs, self.prefix_lens, strict=True):
            if (r.kv_committed_len or 0) > pre:
                # the next chunk of a paged request: the tokens of its partly filled last page (its own slots past
                # the cached whole pages) are recomputed, so their page goes back first
                self.token_to_kv_pool.free(self.req_to_token_pool.read(r.req_pool_idx, pre, r.kv_committed_len))
        input_ids = [tok for r, pre in zip(reqs, self.prefix_lens, strict=True) for tok in r.fill_ids[pre:]]
        # rows: the cached prefix (from the tree) then the newly allocated slots
        pre_rows = [(r.req_pool_idx, r.prefix_indices) for r in reqs if len(r.prefix_indices)]
        if pre_rows:
            self._write_req_to_token([p[0] for p in pre_rows], [0] * len(pre_rows), [len(p[1]) for p in pre_rows],
                                     torch.cat([p[1] for p in pre_rows]))
        pool = self.token_to_kv_pool
        seq_lens = [pre + n for pre, n in zip(self.prefix_lens, self.extend_lens, strict=True)]
        last_locs = [int(r.prefix_indices[-1]) if len(r.prefix_indices) else 0 for r in reqs] \
            if pool.page_size > 1 else [0] * len(reqs)
        self.out_cache_loc = self._alloc(pool.extend_tokens_needed(self.prefix_lens, seq_lens),
                                         lambda: pool.alloc_extend(self.prefix_lens, seq_lens, last_locs))
        self._write_req_to_token([r.req_pool_idx for r in reqs], self.prefix_lens, self.extend_lens,
                                 self.out_cache_loc)
        now = time.time()
        for r in reqs:
            r.kv_committed_len = len(r.fill_ids)
            if not r._admitted:
                r.cached_tokens = len(r.prefix_indices)
                r._admitted = True
                r.time_prefill = now
        self.input_ids = torch.tensor(input_ids, dtype=torch.int64)
        self.req_pool_indices = torch.tensor([r.req_pool_idx for r in reqs], dtype=torch.int64)
        self.seq_lens_list = [len(r.fill_ids) for r in reqs]
        self.seq_lens = torch.tensor(self.seq_lens_list, dtype=torch.int64)
        self.positions = None
        self.decode_pack = None
        self.sampling_info = DeferredSamplingInfo(reqs, self.device, self.vocab_size)

    def mix_with_running(self, running: ScheduleBatch) -> None:
        """Append the running decode requests to this prefill batch as one-token extends (ForwardMode.MIXED)."""
        running.prepare_for_decode()
        n_prefill = len(self.reqs)
        self.input_ids = torch.cat([self.input_ids, running.input_ids])
        self.out_cache_loc = torch.cat([self.out_cache_loc, running.out_cache_loc])
        self.req_pool_indices = torch.cat([self.req_pool_indices, running.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens, running.seq_lens])
        self.prefix_lens += [r.seqlen - 1 for r in running.reqs]
        self.extend_lens += [1] * len(running.reqs)
        self.reqs = self.reqs + running.reqs
        self.seq_lens_list = None
        self.positions = None
        self.decode_pack = None
        self.num_future_refs = None
        self.sampling_info.merge_batch(running.sampling_info)
        self.forward_mode = ForwardMode.MIXED
        self.n_prefill = n_prefill

    # ---------------------------------------------------------------- decode
    def prepare_for_decode(self) -> None:
        """One new token per request: its input is the last sampled token (or -(future slot) while in flight)."""
        self.forward_mode = ForwardMode.DECODE
        reqs = self.reqs
        # one pass over the requests, one tensor for the three per-request columns (this runs every step)
        ids: list[int] = []
        rows: list[int] = []
        lens: list[int] = []
        num_pending = 0
        for r in reqs:
            out = r.output_ids
            n = len(r.origin_input_ids) + len(out)  # == r.seqlen
            pending = r.pending_token
            if pending is None:
                ids.append(out[-1])
            else:
                ids.append(-pending[1])
                n += 1
                num_pending += 1
            rows.append(r.req_pool_idx)
            lens.append(n)
            r.kv_committed_len = n
        self.seq_lens_list = lens
        self.num_future_refs = num_pending
        # One host array holds the batch: a header row (the batch size and the row stride, read on the device by
        # the graph's input kernel) and the five columns (ids, rows, lengths, KV slots, positions), each row
        # 16-byte aligned. On CUDA it is pinned: the worker sends it in one asynchronous copy (ForwardBatch.init_new,
        # CudaGraphRunner.replay). It comes from a ring of two per batch size with its views made once (`_pack`);
        # the work here is numpy's: on arrays this small a numpy op costs a fraction of a torch op, and this runs
        # before every decode step.
        n = len(reqs)
        if n % 2:
            ids, rows, lens = ids + [0], rows + [0], lens + [0]
        host, pack, cols, (np_rows, np_pos, np_locs) = self._pack(n)
        pack[1] = ids
        pack[2] = rows
        pack[3] = pack[5] = lens  # row 4, the KV slots, is filled below (its padding column stays 0)
        pack[5] -= 1  # the new token's KV slot goes at position seq_len - 1 of its row; that is its position too
        self.decode_pack = host
        self.input_ids, self.req_pool_indices, self.seq_lens, self.out_cache_loc, self.positions = cols
        pool = self.token_to_kv_pool
        if pool.page_size == 1:
            np_locs[:] = self._alloc(n, lambda: pool.take_pages_np(n))
        else:  # the next slot of each request's last page, or a new page (numpy too: a torch op per step costs more)
            lens_np = pack[3, :n]
            last = self.req_to_token_pool.req_to_token_cpu.numpy()[np_rows, np.maximum(lens_np - 2, 0)]
            np_locs[:] = self._alloc(pool.decode_tokens_needed(lens_np), lambda: pool.alloc_decode_np(lens_np, last))
        self.req_to_token_pool.write_batch(self.req_pool_indices, self.positions, self.out_cache_loc,
                                           host=(np_rows, np_pos, np_locs))

    def _pack(self, n: int) -> tuple[torch.Tensor, np.ndarray, tuple[torch.Tensor, ...], tuple[np.ndarray, ...]]:
        """The host array for a decode step of `n` requests (the header row written), its numpy view, the five
        column views and numpy views of rows, positions and KV slots. Two per size, taken in turn: the one handed
        out now was last handed out two decode steps ago or earlier, and every caller has by now waited for that
        step (the scheduler processes a batch's results before preparing the batch after next; without overlap
        and in the benchmarks each step waits for its sampled tokens), so its copy to the device is done and no
        batch in flight reads it."""
        self._pack_turn ^= 1
        key = (n, self._pack_turn)
        entry = self._packs.get(key)
        if entry is None:
            if len(self._packs) >= 64:  # batch sizes come and go: keep a bounded set (in-flight ones stay alive)
                self._packs.clear()
            m = n + n % 2
            host = torch.zeros((6, m), dtype=torch.int64, pin_memory=self._pin_pack)
            pack = host.numpy()
            pack[0, :2] = (n, m)
            cols = (host[1:] if n == m else host[1:, :n]).unbind(0)
            entry = self._packs[key] = (host, pack, cols, (pack[2, :n], pack[5, :n], pack[4, :n]))
        return entry

    def check_decode_mem(self) -> bool:
        pool = self.token_to_kv_pool
        if pool.page_size == 1:
            need = len(self.reqs)
        else:  # a new page for each request whose next token starts one
            need = pool.decode_tokens_needed(np.fromiter((r.seqlen for r in self.reqs), np.int64, len(self.reqs)))
        cache = self.tree_cache
        avail = self.token_to_kv_pool.available_size() + (cache.evictable_size() if cache is not None else 0)
        return avail >= need

    def retract_decode(self) -> tuple[list[Req], float]:
        """Free requests (fewest decoded tokens first) until the rest can decode a while; return them and a new
        new_token_ratio estimate."""
        order = sorted(range(len(self.reqs)), key=lambda i: (len(self.reqs[i].output_ids),
                                                             -len(self.reqs[i].origin_input_ids)))
        retracted: list[Req] = []
        keep = set(range(len(self.reqs)))
        cache = self.tree_cache

        def avail() -> int:
            return self.token_to_kv_pool.available_size() + (cache.evictable_size() if cache is not None else 0)

        per_req = max(4, self.token_to_kv_pool.page_size)  # a few tokens each, or a new page each
        while order and (avail() < len(keep) * per_req or not retracted):
            if len(keep) == 1:
                break
            i = order.pop(0)
            req = self.reqs[i]
            keep.discard(i)
            retracted.append(req)
            self._release(req)
        self.filter_batch(keep_indices=sorted(keep))
        total_decoded = sum(len(r.output_ids) for r in self.reqs)
        total_max = sum(r.sampling_params.max_new_tokens for r in self.reqs)
        ratio = (total_decoded + 0.03 * len(self.reqs) * 10) / max(total_max, 1)
        return retracted, min(1.0, ratio)

    def _release(self, req: Req) -> None:
        """Give a request's memory back (its prefix stays shareable in the tree); it will be prefilled again."""
        if self.tree_cache is None:
            raise RuntimeError("retraction needs the prefix cache that owns the requests' KV")
        self.tree_cache.release_req(req)
        req.num_retractions += 1

    # ---------------------------------------------------------------- batch surgery
    def filter_batch(self, keep_indices: list[int] | None = None, chunked_req: Req | None = None) -> None:
        if keep_indices is None:
            keep_indices = [i for i, r in enumerate(self.reqs)
                            if r.finished_reason is None and r is not chunked_req]  # not r.finished()
        if len(keep_indices) == len(self.reqs):
            return
        self.reqs = [self.reqs[i] for i in keep_indices]
        self.seq_lens_list = None
        self.positions = None
        self.decode_pack = None
        self.num_future_refs = None
        idx = torch.tensor(keep_indices, dtype=torch.int64)
        if len(self.req_pool_indices):
            self.req_pool_indices = self.req_pool_indices[idx]
            self.seq_lens = self.seq_lens[idx]
        if self.sampling_info is not None:
            self.sampling_info.filter_batch(keep_indices)

    def merge_batch(self, other: ScheduleBatch) -> None:
        if self.sampling_info is not None and other.sampling_info is not None:
            self.sampling_info.merge_batch(other.sampling_info)
        self.reqs = self.reqs + other.reqs
        self.seq_lens_list = None
        self.positions = None
        self.decode_pack = None
        self.num_future_refs = None
        self.req_pool_indices = torch.cat([self.req_pool_indices, other.req_pool_indices])
        self.seq_lens = torch.cat([self.seq_lens, other.seq_lens])

    # ---------------------------------------------------------------- hand-off to the worker
    def get_model_worker_batch(self) -> ModelWorkerBatch:
        extend = self.forward_mode.is_extend()
        return_logprob = self.return_logprob
        logprob_starts = None
        if extend and return_logprob:
            logprob_starts = []
            # a MIXED batch's decodes riding along (after its first n_prefill requests) have no prompt logprobs to
            # give, though under overlap their prefill's result (which records them) may not be processed yet
            prefill = self.reqs[:self.n_prefill] if self.forward_mode.is_mixed() else self.reqs
            for r, pre in zip(prefill, self.prefix_lens, strict=False):
                if r.return_logprob and r.logprob_start_len >= 0 and r.input_token_logprobs is None \
                        and r.is_chunked == 0 and not r.output_ids:
                    logprob_starts.append(max(0, r.logprob_start_len - pre))
                else:
                    logprob_starts.append(None)
            logprob_starts += [None] * (len(self.reqs) - len(logprob_starts))
        seq_lens_cpu = self.seq_lens_list if self.seq_lens_list is not None else self.seq_lens.tolist()
        lora_slots = lora_loads = None
        if self.lora_table is not None:
            lora_slots, lora_loads = self.lora_table.assign([r.lora_id for r in self.reqs])
        return ModelWorkerBatch(
            forward_mode=self.forward_mode,
            input_ids=self.input_ids,
            req_pool_indices=self.req_pool_indices,
            seq_lens=self.seq_lens,
            seq_lens_cpu=seq_lens_cpu,
            out_cache_loc=self.out_cache_loc,
            seq_lens_sum=sum(seq_lens_cpu),
            extend_seq_lens=list(self.extend_lens) if extend else None,
            extend_prefix_lens=list(self.prefix_lens) if extend else None,
            return_logprob=return_logprob,
            # only read when logprobs are asked for (None: zeros)
            top_logprobs_nums=[r.top_logprobs_num if r.return_logprob else 0 for r in self.reqs] if return_logprob
            else None,
            extend_logprob_start_lens_cpu=logprob_starts,
            sampling_info=self.sampling_info,
            sampling_ops=self.sampling_info.take_ops() if self.sampling_info is not None else [],
            req_to_token_writes=self.req_to_token_pool.take_pending_writes(),
            positions=self.positions if self.forward_mode.is_decode() else None,
            num_future_refs=self.num_future_refs if self.forward_mode.is_decode() else None,
            decode_pack=self.decode_pack if self.forward_mode.is_decode() else None,
            lora_slots=lora_slots,
            lora_loads=lora_loads,
            pooling=[r.pooling for r in self.reqs] if extend and any(r.pooling for r in self.reqs) else None,
            num_mixed_decodes=len(self.reqs) - self.n_prefill if self.forward_mode.is_mixed() else 0,
            state_checkpoints=self.state_checkpoints if extend and self.state_checkpoints else None,
            state_copies=(self.tree_cache.take_state_copies() or None) if self.tree_cache is not None else None,
        )
