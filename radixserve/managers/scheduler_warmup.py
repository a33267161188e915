"""The scheduler's start-up warm-up: a few short requests run to completion before serving. A mixin of Scheduler."""

from __future__ import annotations

from radixserve.managers import io_struct as io
from radixserve.sampling.sampling_params import SamplingParams


class SchedulerWarmupMixin:
    def warmup(self, prompt_len: int = 16, max_new_tokens: int = 4) -> None:
        """Run short greedy requests through the step kinds serving meets before serving, so that the first user
        requests do not pay Triton's compilation of the kernels' specialisations (seconds on a GPU): a prefill and
        decode steps; a longer prompt arriving while the first one decodes (with a step token budget or mixed chunks,
        a prefill with a decode riding along: MLA models attend to such a batch in their latent form); then one
        extending the first's cached prompt by a few tokens (a prefill on a radix hit). Nothing is sent; the cache,
        the pools and the counters are left as they were. Every TP rank runs the same warm-up, so their collectives
        pair up."""
        if not self.is_idle():
            raise RuntimeError("warm-up needs an idle scheduler")
        room = self.context_len - 1 - 2 * max_new_tokens - 2
        n = max(1, min(prompt_len, room))
        ids = [1 + (i * 7919) % (self.vocab_size - 1) for i in range(n)]
        longer = [1 + (i * 104729 + 3) % (self.vocab_size - 1) for i in range(max(1, min(2 * n + 8, room)))]
        sp = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True})
        first = SamplingParams.from_dict({"max_new_tokens": 2 * max_new_tokens, "temperature": 0,
                                          "ignore_eos": True})  # still decoding when the longer prompt comes
        socket, outbox_len = self.send_to_detokenizer, len(self.outbox)
        self.send_to_detokenizer = None  # outputs land in the outbox, dropped below

        def submit(rid: str, prompt: list[int], params: SamplingParams, pooling: str | None = None) -> None:
            self.handle_generate_request(io.TokenizedGenerateReqInput(
                rid=rid, input_text=None, input_ids=prompt, sampling_params=params, pooling=pooling))

        def drain() -> None:
            while self.step() or not self.is_idle():
                pass

        try:
            if getattr(self.model_config, "is_encoder", False):  # prefill only: one batch of two pooled requests
                prefill_only = SamplingParams.from_dict({"max_new_tokens": 0})
                submit("__warmup__", ids, prefill_only, "mean")
                submit("__warmup_mixed__", longer, prefill_only, "mean")
                drain()
            else:
                submit("__warmup__", ids, first)
                self.step()  # its prefill
                self.step()  # its first decode step
                submit("__warmup_mixed__", longer, sp)
                drain()
                submit("__warmup_hit__", ids + ids[:2], sp)
                drain()
        finally:
            self.send_to_detokenizer = socket
            del self.outbox[outbox_len:]
        self.tree_cache.reset()
        self.reset_stats()
        self.last_batch = None
        self.on_idle()  # checks the pools and resets new_token_ratio
