"""Speculative decoding: guess a few next tokens per request cheaply (a drafter), then let the model check them all in
one forward (ForwardMode.TARGET_VERIFY) and keep the longest run it agrees with, plus one token of its own.

- `ngram.py`: the n-gram drafter (a per-request suffix index over the prompt and the output so far).
- `draft_model.py`: a small draft model with its own KV pool, greedy, k steps per round.
- `verify.py`: the worker side: the verify forward, then the target's own choice at every drafted position.
- `scheduler_mixin.py`: the scheduler side: drafting, extra KV slots, committing accepted tokens and freeing the
  rejected ones' slots in the same step, adaptive back-off, acceptance statistics.

`DRAFTERS` is the registry behind `--speculative-algorithm` (lazy import paths: importing this module loads none).
"""

DRAFTERS: dict[str, str] = {
    "ngram": "radixserve.speculative.ngram:NgramDrafter",
    "draft_model": "radixserve.speculative.draft_model:DraftModelDrafter",
}


def create_drafter(name: str, server_args: object, **kw: object) -> object:
    import importlib

    if name not in DRAFTERS:
        raise ValueError(f"--speculative-algorithm must be one of {', '.join(DRAFTERS)}; got {name!r}")
    module, cls = DRAFTERS[name].split(":")
    return getattr(importlib.import_module(module), cls)(server_args, **kw)
