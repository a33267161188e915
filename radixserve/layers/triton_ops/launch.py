"""Launch our Triton kernels with less host time than `kernel[grid](...)`.

`kernel[grid](*args)` works out the kernel's specialisation from every argument on every call (the dtype and
16-byte alignment of each tensor, whether each integer is 1, a multiple of 16, or past 32 bits), hashes it and looks
the compiled kernel up; the cost grows with the argument count. An eager decode step launches 7 of our kernels per
layer, and above the largest CUDA graph it is host-bound, so the launch's own host time counts (docs/perf-log.md
has the measurement).

`launch` keeps, per kernel, the compiled kernels it has seen under a key of its own that is at least as fine as
Triton's (the same facts plus each value's Python type, so two calls with one key always get the same compiled
kernel), and calls the compiled kernel's launcher directly. A key seen for the first time goes through
`kernel[grid]` (which compiles if needed) and is remembered. Should a Triton version's launcher take other
arguments, the first cached launch fails before launching anything and that kernel falls back to `kernel[grid]`.
Under TRITON_INTERPRET=1 and with RADIXSERVE_TRITON_FAST_LAUNCH=0 every call goes through `kernel[grid]`. Launch
hooks (`knobs.runtime.launch_*_hook`) are not called on the fast path.
"""

from __future__ import annotations

import contextlib
import inspect
import logging
import os
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

import torch

logger = logging.getLogger(__name__)
_INT32 = 1 << 31
_enabled = os.environ.get("RADIXSERVE_TRITON_FAST_LAUNCH", "1") not in ("0", "")


def _tensor_key(a: torch.Tensor) -> tuple:
    return a.dtype, a.data_ptr() & 15 == 0


def _int_key(a: int) -> tuple:
    return a == 1, a & 15 == 0, -_INT32 <= a < _INT32, a >= 1 << 63


def _same(a: Any) -> Any:
    return a


def _float_key(a: float) -> type:
    return float


_KEYS: dict[type, Any] = {torch.Tensor: _tensor_key, torch.nn.Parameter: _tensor_key, int: _int_key,
                          bool: _same, type(None): _same, float: _float_key}


def _arg_key(a: Any) -> Any:
    """What of `a` Triton specialises on (or finer): dtype and 16-byte alignment of a tensor; for an integer whether
    it is 1, a multiple of 16, in 32 bits, past 63 bits; bools and None by value; other values by type."""
    key = _KEYS.get(type(a))
    if key is not None:
        return key(a)
    if isinstance(a, torch.Tensor):
        return _tensor_key(a)
    if isinstance(a, int):  # a subclass of int (bool cannot be subclassed, and is in _KEYS)
        return type(a), _int_key(a)
    return type(a)


def _run(kernel: Any, grid: tuple[int, ...], stream: int, args: tuple, tail: tuple) -> None:
    """What `JITFunction.run` does once it has found the compiled kernel (no launch hooks)."""
    n = len(grid)
    kernel.run(grid[0], grid[1] if n > 1 else 1, grid[2] if n > 2 else 1, stream, kernel.function,
               kernel.packed_metadata, None, None, None, *args, *tail)


class _KernelLauncher:
    """The compiled kernels of one @triton.jit function, by our key."""

    def __init__(self, fn: Any) -> None:
        self.fn = fn
        params = list(inspect.signature(fn.fn).parameters.values())
        self.names = [p.name for p in params]
        self.defaults = {p.name: p.default for p in params if p.default is not inspect.Parameter.empty}
        self.compiled: dict[tuple, tuple[Any, tuple]] = {}  # key → (compiled kernel, constexpr values)
        self.checked = False  # a cached launch has gone through once
        self.broken = False  # this Triton's launcher takes other arguments: always use kernel[grid]

    def __call__(self, grid: tuple[int, ...], args: tuple, kwargs: dict[str, Any], device: int,
                 stream: int) -> tuple[Any, tuple] | None:
        """Launch; returns the (compiled kernel, constexpr tail) that a later `_run` with arguments of the same key
        may use directly, once the fast path has worked for this kernel (else None)."""
        # kwargs keep their call-site order: a call site that orders them differently only adds cache entries
        key = (device, tuple(map(_arg_key, args)), tuple(kwargs.items()))
        hit = None if self.broken else self.compiled.get(key)
        if hit is None:
            kernel = self.fn[grid](*args, **kwargs)
            # the parameters after the positional ones, in signature order: constexprs given by name or defaulted
            rest = self.names[len(args):]
            if kernel is None or self.broken or any(n not in kwargs and n not in self.defaults for n in rest):
                return None
            self.compiled[key] = (kernel, tuple(kwargs[n] if n in kwargs else self.defaults[n] for n in rest))
            return None
        kernel, tail = hit
        if self.checked:
            _run(kernel, grid, stream, args, tail)
            return hit
        try:  # the launcher is Triton's internal API: a version that changed it fails here, before launching
            _run(kernel, grid, stream, args, tail)
        except (TypeError, AttributeError) as e:
            logger.warning("cached Triton launch unavailable for %s (%s); using kernel[grid]", self.fn, e)
            self.broken = True
            self.compiled.clear()
            self.fn[grid](*args, **kwargs)
            return None
        self.checked = True
        return hit


_launchers: dict[int, _KernelLauncher | None] = {}  # None: this kernel always goes through kernel[grid]


def set_fast_launch(enabled: bool) -> None:
    """Turn the fast path on or off for every kernel (for comparisons; the default comes from the environment)."""
    global _enabled
    _enabled = enabled
    _launchers.clear()


def launch(fn: Any, grid: tuple[int, ...], *args: Any, **kwargs: Any) -> None:
    """`fn[grid](*args, **kwargs)` for a @triton.jit `fn`: positional arguments are the kernel's runtime
    parameters in order; constexprs and launch options (num_warps, num_stages) by name."""
    key = id(fn)
    if key not in _launchers:
        import triton

        # under TRITON_INTERPRET=1 the decorator gives an InterpretedFunction, not a JITFunction
        fast = _enabled and isinstance(fn, triton.runtime.JITFunction) and torch.cuda.is_available()
        _launchers[key] = _KernelLauncher(fn) if fast else None
    launcher = _launchers[key]
    hit = None
    if launcher is None:
        fn[grid](*args, **kwargs)
    else:
        device = torch._C._cuda_getDevice()  # what triton's own launch path asks torch for, without the wrappers
        hit = launcher(grid, args, kwargs, device, torch._C._cuda_getCurrentRawStream(device))
    if _recording is not None:
        _recording.append(_Recorded(fn, grid, args, kwargs, hit))


@dataclass
class _Recorded:
    fn: Any
    grid: tuple[int, ...]
    args: tuple
    kwargs: dict[str, Any]
    hit: tuple[Any, tuple] | None  # the compiled kernel and constexpr tail it ran with (fast path), else None


_recording: list[_Recorded] | None = None


@contextlib.contextmanager
def recording() -> Iterator[list[_Recorded]]:
    """Record every `launch` made inside the block (they still run), for a `LaunchPlan`."""
    global _recording
    outer, _recording = _recording, []
    try:
        yield _recording
    finally:
        _recording = outer


class LaunchPlan:
    """A block of launches recorded once, run again with other tensors in the place of some of its arguments.

    A caller with the same computation on other data (an attention layer after the first of a forward: the same
    batch metadata, grid and scalars, other q/k/v/output and KV-pool tensors) records the first and replays the
    rest, skipping the work each launch does on the host to find its grid, check its inputs and pick its compiled
    kernel. `tensors` names the arguments that change: each replay passes the same number, in the same order, each
    of the recorded one's dtype, shape and strides (the caller keys its plans on whatever decides those); arguments
    not among them are reused as recorded. The block must launch nothing but through `launch`. A replayed tensor
    whose 16-byte alignment differs from the recorded one's goes through `launch` (its own compiled kernel)."""

    def __init__(self, launches: list[_Recorded], tensors: tuple[torch.Tensor, ...]) -> None:
        self.launches = []
        for rec in launches:
            slots = [(pos, i) for pos, a in enumerate(rec.args) for i, t in enumerate(tensors) if a is t]
            aligned = tuple(tensors[i].data_ptr() & 15 == 0 for _, i in slots)
            self.launches.append((rec, slots, aligned))

    def replay(self, tensors: tuple[torch.Tensor, ...]) -> None:
        stream = None
        for rec, slots, aligned in self.launches:
            args = list(rec.args)
            for pos, i in slots:
                args[pos] = tensors[i]
            if rec.hit is not None and tuple(tensors[i].data_ptr() & 15 == 0 for _, i in slots) == aligned:
                if stream is None:
                    stream = torch._C._cuda_getCurrentRawStream(torch._C._cuda_getDevice())
                _run(rec.hit[0], rec.grid, stream, tuple(args), rec.hit[1])
            else:
                launch(rec.fn, rec.grid, *args, **rec.kwargs)
