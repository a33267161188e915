"""N-gram drafting: the tokens that followed the most recent earlier occurrence of the sequence's last n tokens
(n from MAX_MATCH down to MIN_MATCH) are proposed as the next ones. Output that copies or edits its prompt
(summaries, code edits, "repeat this passage") is drafted well; free text mostly gets no draft at all.

The index is per request (kept on the Req) and incremental: each n-gram is hashed once, when the token after it
arrives, mapping to the position that follows it; later occurrences overwrite earlier ones."""

from __future__ import annotations

from typing import Any

MIN_MATCH = 2
MAX_MATCH = 4


class NgramIndex:
    """Suffix index of one token sequence that only grows."""

    def __init__(self, min_match: int = MIN_MATCH, max_match: int = MAX_MATCH) -> None:
        if not 1 <= min_match <= max_match:
            raise ValueError(f"n-gram match lengths must satisfy 1 <= min <= max; got {min_match}, {max_match}")
        self.sizes = list(range(max_match, min_match - 1, -1))  # longest match first
        self.tables: dict[int, dict[tuple[int, ...], int]] = {n: {} for n in self.sizes}
        self.indexed = 0  # n-grams followed by a token at positions < indexed are in the tables

    def propose(self, seq: list[int], k: int) -> list[int]:
        """Up to k tokens that followed the latest earlier occurrence of seq's longest matching suffix."""
        end = len(seq)
        # index every n-gram whose following token is known: continuation start e in [indexed, end - 1]
        for e in range(self.indexed, end):
            for n in self.sizes:
                if e >= n:
                    self.tables[n][tuple(seq[e - n:e])] = e
        self.indexed = max(self.indexed, end)
        if k <= 0:
            return []
        for n in self.sizes:
            if end < n:
                continue
            e = self.tables[n].get(tuple(seq[end - n:end]))
            if e is not None and e < end:
                return seq[e:e + k]
        return []


class NgramDrafter:
    """--speculative-algorithm ngram."""

    needs_model = False

    def __init__(self, server_args: Any = None, **_: Any) -> None:
        self.min_match, self.max_match = MIN_MATCH, MAX_MATCH

    def propose(self, req: Any, k: int) -> list[int]:
        index = req.spec_state
        if index is None:
            index = req.spec_state = NgramIndex(self.min_match, self.max_match)
        return index.propose(req.origin_input_ids + req.output_ids, k)

    def propose_batch(self, reqs: list[Any], ks: list[int]) -> list[list[int]]:
        return [self.propose(r, k) for r, k in zip(reqs, ks, strict=True)]
