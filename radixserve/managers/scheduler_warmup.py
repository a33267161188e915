"""The scheduler's start-up warm-up: one short request run to completion before serving. A mixin of Scheduler."""

from __future__ import annotations

from radixserve.managers import io_struct as io
from radixserve.sampling.sampling_params import SamplingParams


class SchedulerWarmupMixin:
    def warmup(self, prompt_len: int = 16, max_new_tokens: int = 4) -> None:
        """Run a short greedy request through a prefill and a few decode steps before serving, then one that extends
        its cached prompt by a few tokens (a prefill on a radix hit: MLA models attend to a cached prefix in another
        form than to a fresh prompt), so that the first user requests do not pay Triton's compilation of the
        kernels' specialisations (seconds on a GPU). Nothing is sent; the cache, the pools and the counters are left
        as they were. Every TP rank runs the same warm-up, so their collectives pair up."""
        if not self.is_idle():
            raise RuntimeError("warm-up needs an idle scheduler")
        n = min(prompt_len, self.context_len - 1 - max_new_tokens - 2)
        ids = [1 + (i * 7919) % (self.vocab_size - 1) for i in range(max(1, n))]
        sp = SamplingParams.from_dict({"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True})
        socket, outbox_len = self.send_to_detokenizer, len(self.outbox)
        self.send_to_detokenizer = None  # outputs land in the outbox, dropped below
        try:
            for rid, prompt in (("__warmup__", ids), ("__warmup_hit__", ids + ids[:2])):
                self.handle_generate_request(io.TokenizedGenerateReqInput(
                    rid=rid, input_text=None, input_ids=prompt, sampling_params=sp))
                while self.step() or not self.is_idle():
                    pass
        finally:
            self.send_to_detokenizer = socket
            del self.outbox[outbox_len:]
        self.tree_cache.reset()
        self.reset_stats()
        self.last_batch = None
        self.on_idle()  # checks the pools and resets new_token_ratio
