"""The grammar-backend interface: compile a constraint once, then one matcher per request.

A constraint is a `(kind, text)` pair, kind one of `GRAMMAR_KINDS` ("json_schema", "regex", "ebnf"). The backend
compiles it off the scheduler's thread (a small thread pool) and caches the result by `(kind, text)`, so the
scheduler only ever looks at a future: a request waits in the scheduler's grammar queue until its future is done,
without blocking anyone else. The compiled result is a template `BaseGrammarObject`; each request gets its own
`copy()` (a fresh matcher over the same compiled grammar).

Per step, the scheduler asks each constrained request's matcher to fill its row of a packed token bitmask
(`allocate_vocab_mask`: int32 `[bs, ceil(vocab / 32)]`, bit `t % 32` of word `t // 32` set = token `t` allowed;
rows of unconstrained requests stay all-allowed). The worker turns it into the sampler's `vocab_mask`
(`[bs, vocab]` bool, True = disallowed) on the device with `bitmask_to_vocab_mask`: the packed form is 8 times
smaller to copy to the device. After each sampled token the scheduler calls `accept_token`; a terminated matcher
ends the request.
"""

from __future__ import annotations

import logging
import threading
import time
from abc import ABC, abstractmethod
from collections import OrderedDict
from concurrent.futures import Future, ThreadPoolExecutor
from typing import Any

import torch

logger = logging.getLogger(__name__)

GRAMMAR_KINDS = ("json_schema", "regex", "ebnf")
DEFAULT_CACHE_ENTRIES = 1024
DEFAULT_COMPILE_THREADS = 2


class GrammarError(ValueError):
    """An invalid constraint. The message starts with the kind ("json_schema: ...") and says what is wrong; the
    request that carried it gets a 400, nobody else notices."""


def check_kind(kind: str) -> None:
    if kind not in GRAMMAR_KINDS:
        raise GrammarError(f"unknown grammar kind {kind!r}; expected one of {', '.join(GRAMMAR_KINDS)}")


def bitmask_width(vocab_size: int) -> int:
    """int32 words per row of a packed token bitmask."""
    return (int(vocab_size) + 31) // 32


def bitmask_to_vocab_mask(bitmask: torch.Tensor, vocab_size: int, device: torch.device | str) -> torch.Tensor:
    """A packed int32 bitmask `[bs, ceil(vocab/32)]` (bit set = allowed) -> bool `[bs, vocab_size]` on `device`,
    True = disallowed (the sampler's `vocab_mask`). The copy to the device is of the packed form."""
    if bitmask.dim() != 2 or bitmask.dtype != torch.int32:
        raise ValueError(f"bitmask: expected a 2-D int32 tensor, got {tuple(bitmask.shape)} {bitmask.dtype}")
    if bitmask.shape[1] != bitmask_width(vocab_size):
        raise ValueError(f"bitmask: expected {bitmask_width(vocab_size)} words per row for a vocabulary of "
                         f"{vocab_size}, got {bitmask.shape[1]}")
    packed = bitmask.to(device, non_blocking=True)
    shifts = torch.arange(32, dtype=torch.int32, device=packed.device)
    bits = (packed.unsqueeze(-1) >> shifts) & 1  # [bs, words, 32], bit j of word w is token 32 * w + j
    return (bits == 0).reshape(packed.shape[0], -1)[:, :vocab_size]


class BaseGrammarObject(ABC):
    """One request's matcher: its position in the grammar after the tokens it accepted."""

    def __init__(self) -> None:
        self.num_accepted = 0  # tokens accepted (and not rolled back) so far

    @abstractmethod
    def accept_token(self, token_id: int) -> bool:
        """Advance by one sampled token; False (state unchanged) when the grammar does not allow it."""

    @abstractmethod
    def fill_vocab_mask(self, mask: torch.Tensor, row: int) -> None:
        """Write the tokens allowed next into row `row` of a mask from `BaseGrammarBackend.allocate_vocab_mask`."""

    @abstractmethod
    def is_terminated(self) -> bool:
        """True once the grammar is complete and its stop token was accepted: the request is done."""

    @abstractmethod
    def rollback(self, num_tokens: int) -> None:
        """Undo the last `num_tokens` accepted tokens."""

    @abstractmethod
    def copy(self) -> BaseGrammarObject:
        """A fresh matcher (at the start of the grammar) over the same compiled grammar."""

    def sync_to(self, output_ids: list[int]) -> bool:
        """Bring the matcher in line with a request's output tokens (a rollback when it is ahead, accepting the
        missing tokens when it is behind). False when a token does not match the grammar."""
        n = len(output_ids)
        if self.num_accepted > n:
            self.rollback(self.num_accepted - n)
        for tok in output_ids[self.num_accepted:]:
            if not self.accept_token(tok):
                return False
        return True


class BaseGrammarBackend(ABC):
    """Compiles constraints in a thread pool, caching the futures by (kind, text)."""

    def __init__(self, vocab_size: int, num_threads: int = DEFAULT_COMPILE_THREADS,
                 cache_entries: int = DEFAULT_CACHE_ENTRIES) -> None:
        if vocab_size <= 0:
            raise ValueError(f"vocab_size must be positive, got {vocab_size}")
        self.vocab_size = int(vocab_size)
        self.cache_entries = max(1, int(cache_entries))
        self._executor = ThreadPoolExecutor(max(1, int(num_threads)), thread_name_prefix="radixserve-grammar")
        self._cache: OrderedDict[tuple[str, str], Future] = OrderedDict()
        self._lock = threading.Lock()
        # statistics (read by the scheduler's internal state, tests and benchmarks)
        self.num_compiles = 0  # compilations started (cache misses)
        self.num_cache_hits = 0
        self.num_errors = 0
        self.compile_time_s = 0.0  # summed over finished compilations

    # ---------------------------------------------------------------- what a backend provides
    @abstractmethod
    def compile(self, kind: str, text: str) -> BaseGrammarObject:
        """Compile `text` (runs in the thread pool); the template matcher, or GrammarError."""

    @classmethod
    @abstractmethod
    def validate(cls, kind: str, text: str) -> None:
        """A cheap check (no tokenizer) that `text` is a valid constraint of `kind`; GrammarError if not."""

    # ---------------------------------------------------------------- cache and thread pool
    def get_future(self, kind: str, text: str) -> Future:
        """The (possibly already done) future of this constraint's template matcher. Never raises for a bad
        constraint: the future holds the GrammarError."""
        key = (kind, text)
        with self._lock:
            fut = self._cache.get(key)
            if fut is not None:
                self._cache.move_to_end(key)
                self.num_cache_hits += 1
                return fut
            self.num_compiles += 1
            fut = self._executor.submit(self._compile_timed, kind, text)
            self._cache[key] = fut
            while len(self._cache) > self.cache_entries:
                self._cache.popitem(last=False)  # holders of an evicted future keep it alive
            return fut

    def _compile_timed(self, kind: str, text: str) -> BaseGrammarObject:
        start = time.perf_counter()
        try:
            check_kind(kind)
            return self.compile(kind, text)
        except GrammarError:
            with self._lock:
                self.num_errors += 1
            raise
        except Exception as e:  # a backend failure on odd input is still that request's problem alone
            with self._lock:
                self.num_errors += 1
            logger.warning("grammar compilation failed (%s): %s: %s", kind, type(e).__name__, e)
            raise GrammarError(f"{kind}: could not be compiled: {e}") from e
        finally:
            with self._lock:
                self.compile_time_s += time.perf_counter() - start

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"grammar_compiles": self.num_compiles, "grammar_cache_hits": self.num_cache_hits,
                    "grammar_errors": self.num_errors, "grammar_compile_time_s": self.compile_time_s,
                    "grammar_cache_entries": len(self._cache)}

    # ---------------------------------------------------------------- masks
    def allocate_vocab_mask(self, batch_size: int) -> torch.Tensor:
        """A CPU packed bitmask `[batch_size, ceil(vocab/32)]`, every token allowed."""
        return torch.full((batch_size, bitmask_width(self.vocab_size)), -1, dtype=torch.int32)

    def shutdown(self) -> None:
        self._executor.shutdown(wait=False, cancel_futures=True)
