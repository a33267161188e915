"""`inference_mode`: torch.inference_mode as a decorator that costs nothing when the caller is already in it.

`@torch.inference_mode()` enters and leaves the mode on every call (a few microseconds each on a fast host, several
times that right after the host waited for the GPU). The forward and the sample run once per decode step, and the
loops that call them (the scheduler's, the overlap thread's, the benchmarks') enter the mode once; then this checks a
flag and calls through."""

from __future__ import annotations

import functools
from collections.abc import Callable
from typing import ParamSpec, TypeVar

import torch

P = ParamSpec("P")
R = TypeVar("R")


def inference_mode(fn: Callable[P, R]) -> Callable[P, R]:
    @functools.wraps(fn)
    def wrapper(*args: P.args, **kwargs: P.kwargs) -> R:
        if torch.is_inference_mode_enabled():
            return fn(*args, **kwargs)
        with torch.inference_mode():
            return fn(*args, **kwargs)

    return wrapper
