"""Drafting with a small model (--speculative-algorithm draft_model --speculative-draft-model-path PATH): the draft
model, with the target's tokenizer, greedily proposes k tokens per request and round.

The draft has its own ModelRunner and its own KV pool and request table (sized like the target's), so nothing of
it touches the target's accounting. Per request it keeps the KV of the committed sequence only: a round first runs
the tokens committed since the last round as one extend (the whole prompt the first time), whose last logits give
the first draft, then k - 1 one-token decodes; the slots of those speculative decodes are freed at the end of the
round. A catch-up of at most CATCHUP_AS_DECODE tokens per request (every round after a request's first: the tokens the
last verify kept) runs as decode rows (`verify.as_decode_rows`), so on a GPU all of a round's draft forwards replay
the draft's decode CUDA graphs; only a request's first round (its prompt) is a real extend.
Greedy proposals are point masses, so the target's verify keeps exact semantics for sampling too.
A request's draft state is released when it finishes (and found and released lazily if it finished elsewhere).
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any

import torch

from radixserve.managers.schedule_batch import ModelWorkerBatch
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from radixserve.speculative.verify import as_decode_rows

logger = logging.getLogger(__name__)

CATCHUP_AS_DECODE = 16  # catch-up extends with at most this many tokens per request run as decode rows


class DraftState:
    def __init__(self, row: int) -> None:
        self.row = row  # the draft request table's row
        self.slots = torch.empty(0, dtype=torch.int64)  # draft KV of the committed sequence, in order


class DraftModelDrafter:
    needs_model = True

    def __init__(self, server_args: Any, pool_size: int | None = None, max_running_requests: int | None = None) -> None:
        from radixserve.configs.model_config import ModelConfig
        from radixserve.model_executor.model_runner import ModelRunner

        path = server_args.speculative_draft_model_path
        if path is None:
            raise ValueError("--speculative-algorithm draft_model needs --speculative-draft-model-path")
        if server_args.tp_size > 1:
            raise ValueError("--speculative-algorithm draft_model runs with --tp-size 1 only")
        args = dataclasses.replace(server_args, model_path=path, tokenizer_path=None, speculative_algorithm=None,
                                   speculative_draft_model_path=None, enable_lora=False, lora_paths=None,
                                   quantization=None,
                                   # as many tokens as the target's pool (the draft's cells are far smaller); on
                                   # a GPU it takes them from what the target left, not another fraction of it
                                   max_total_tokens=pool_size or server_args.max_total_tokens,
                                   max_running_requests=max_running_requests or server_args.max_running_requests,
                                   mem_fraction_static=0.99 if server_args.resolved_device() == "cuda" else None)
        self.config = ModelConfig(path, context_length=server_args.context_length, load_format=args.load_format,
                                  trust_remote_code=args.trust_remote_code)
        # its catch-up runs up to 1 + k decode rows per request (the tokens the last verify kept)
        self.runner = ModelRunner(self.config, args, tp_rank=0, tp_size=1,
                                  decode_rows_per_request=1 + server_args.speculative_num_draft_tokens)
        self.req_to_token_pool = self.runner.req_to_token_pool
        self.token_to_kv_pool = self.runner.token_to_kv_pool
        self.states: dict[int, tuple[Any, DraftState]] = {}  # id(req) -> (req, state)
        logger.info("draft model %s: %d layers, KV pool of %d tokens", path, self.config.num_hidden_layers,
                    self.token_to_kv_pool.size)

    def check_target(self, vocab_size: int) -> None:
        if self.config.vocab_size != vocab_size:
            raise ValueError(f"the draft model's vocabulary ({self.config.vocab_size}) differs from the target's "
                             f"({vocab_size}): it must use the same tokenizer")

    # ---------------------------------------------------------------- state
    def release(self, req: Any) -> None:
        item = self.states.pop(id(req), None)
        if item is not None:
            st = item[1]
            if len(st.slots):
                self.token_to_kv_pool.free(st.slots)
            self.req_to_token_pool.free(st.row)

    def gc(self) -> None:
        """Release the state of every request that finished."""
        for req, _ in list(self.states.values()):
            if req.finished():
                self.release(req)

    # ---------------------------------------------------------------- drafting
    def _forward(self, mode: ForwardMode, ids: list[int], rows: list[int], seq_lens: list[int], loc: torch.Tensor,
                 ext: list[int] | None = None, pre: list[int] | None = None) -> torch.Tensor:
        mwb = ModelWorkerBatch(
            forward_mode=mode, input_ids=torch.tensor(ids, dtype=torch.int64),
            req_pool_indices=torch.tensor(rows, dtype=torch.int64),
            seq_lens=torch.tensor(seq_lens, dtype=torch.int64), seq_lens_cpu=seq_lens, out_cache_loc=loc,
            seq_lens_sum=sum(seq_lens), extend_seq_lens=ext, extend_prefix_lens=pre, return_logprob=False,
            top_logprobs_nums=None, extend_logprob_start_lens_cpu=None, sampling_info=None, sampling_ops=[],
            req_to_token_writes=self.req_to_token_pool.take_pending_writes(),
            positions=torch.tensor(seq_lens, dtype=torch.int64) - 1 if mode.is_decode() else None)
        self.req_to_token_pool.apply_writes(mwb.req_to_token_writes)
        last = None
        if ext is not None and max(ext) <= CATCHUP_AS_DECODE:
            mwb = as_decode_rows(mwb)  # one decode row per token: the decode CUDA graphs, no eager extend
            last = torch.tensor(ext, dtype=torch.int64).cumsum(0) - 1
        logits = self.runner.forward(ForwardBatch.init_new(mwb, self.runner)).next_token_logits
        if last is not None:
            logits = logits[last.to(logits.device)]
        return torch.argmax(logits, dim=-1).cpu()

    def _alloc(self, n: int) -> torch.Tensor | None:
        return self.token_to_kv_pool.alloc(n) if n else torch.empty(0, dtype=torch.int64)

    @torch.inference_mode()
    def propose_batch(self, reqs: list[Any], ks: list[int]) -> list[list[int]]:
        self.gc()
        out: list[list[int]] = [[] for _ in reqs]
        todo = [i for i, k in enumerate(ks) if k > 0]
        if not todo:
            return out
        states, seqs = [], []
        for i in todo:
            req = reqs[i]
            item = self.states.get(id(req))
            if item is None:
                row = self.req_to_token_pool.alloc(1)
                if row is None:
                    return out
                item = self.states[id(req)] = (req, DraftState(row[0]))
            states.append(item[1])
            seqs.append(req.origin_input_ids + req.output_ids)
        # catch up: the tokens committed since the last round, as one extend; its last logits give draft 0
        pre = [len(st.slots) for st in states]
        ext = [len(s) - p for s, p in zip(seqs, pre, strict=True)]
        new = self._alloc(sum(ext))
        if new is None:
            return out
        rows = [st.row for st in states]
        for st, p, piece in zip(states, pre, torch.split(new, ext), strict=True):
            self.req_to_token_pool.write_batch(torch.full((len(piece),), st.row, dtype=torch.int64),
                                               torch.arange(p, p + len(piece), dtype=torch.int64), piece)
            st.slots = torch.cat([st.slots, piece])
        ids = [t for s, p in zip(seqs, pre, strict=True) for t in s[p:]]
        lens = [len(s) for s in seqs]
        tok = self._forward(ForwardMode.EXTEND, ids, rows, lens, new, ext, pre)
        drafts = [[int(t)] for t in tok]
        # k - 1 greedy decodes on speculative slots, freed at the end; a request decodes only while it still wants
        # drafts (its k is capped by its context length: a step past it would write past its request table's row)
        spec_slots = []
        for step in range(1, max(ks[i] for i in todo)):
            live = [j for j, i in enumerate(todo) if ks[i] > step]
            loc = self._alloc(len(live))
            if loc is None:
                break
            spec_slots.append(loc)
            live_rows = [rows[j] for j in live]
            pos = torch.tensor([lens[j] + step - 1 for j in live], dtype=torch.int64)
            self.req_to_token_pool.write_batch(torch.tensor(live_rows, dtype=torch.int64), pos, loc)
            tok = self._forward(ForwardMode.DECODE, [drafts[j][-1] for j in live], live_rows,
                                [lens[j] + step for j in live], loc)
            for j, t in zip(live, tok.tolist(), strict=True):
                drafts[j].append(t)
        if spec_slots:
            self.token_to_kv_pool.free(torch.cat(spec_slots))
        for j, i in enumerate(todo):
            out[i] = drafts[j][:ks[i]]
        return out
