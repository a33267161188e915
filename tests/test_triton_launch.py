"""The low-overhead Triton launcher (`radixserve.layers.triton_ops.launch`): its cache key must separate every
call Triton would specialise differently, and a cached launch must hand the launcher the same arguments Triton's own
path would (runtime arguments, then constexprs in signature order with their defaults). Checked with a stand-in
kernel object here; the real launcher runs in tests/gpu/test_triton_launch_gpu.py."""

from __future__ import annotations

from typing import Any

import torch

from radixserve.layers.triton_ops import launch as launch_mod
from radixserve.layers.triton_ops.launch import LaunchPlan, _arg_key, _KernelLauncher, _Recorded


class _Compiled:
    function = "cufunction"
    packed_metadata = "metadata"

    def __init__(self) -> None:
        self.runs: list[tuple] = []

    def run(self, *args: Any) -> None:
        self.runs.append(args)


class _Jit:
    """Stands in for a @triton.jit function: `fn` is the Python function, `[grid](...)` is Triton's slow path."""

    def __init__(self) -> None:
        def kernel(X, n, scale, BLOCK, FLAG=True):  # noqa: N803 - the way Triton kernels name their parameters
            pass

        self.fn = kernel
        self.compiled = _Compiled()
        self.slow: list[tuple] = []

    def __getitem__(self, grid: tuple) -> Any:
        def go(*args: Any, **kwargs: Any) -> _Compiled:
            self.slow.append((grid, args, kwargs))
            return self.compiled
        return go


def test_arg_key_separates_what_triton_specialises() -> None:
    base = torch.zeros(64, dtype=torch.float16)
    assert _arg_key(base) != _arg_key(base[1:])  # 16-byte alignment
    assert _arg_key(base) == _arg_key(base[8:])  # 16 bytes further: aligned again
    assert _arg_key(base) != _arg_key(base.float())  # dtype
    assert _arg_key(1) != _arg_key(2)  # the value 1
    assert _arg_key(16) != _arg_key(17) and _arg_key(16) == _arg_key(32)  # multiples of 16
    assert _arg_key(2**31 - 16) != _arg_key(2**31)  # past 32 bits
    assert _arg_key(1) != _arg_key(True) and _arg_key(True) != _arg_key(False)
    assert _arg_key(0.5) == _arg_key(2.0) and _arg_key(0.5) != _arg_key(0)
    assert _arg_key(None) is None


def test_cached_launch_passes_runtime_args_then_constexprs_in_order() -> None:
    fn = _Jit()
    launcher = _KernelLauncher(fn)
    x = torch.zeros(32, dtype=torch.float32)
    launcher((4,), (x, 48, 0.5), {"BLOCK": 64, "num_warps": 4}, 0, 7)
    assert len(fn.slow) == 1 and not fn.compiled.runs  # first sight of this key: Triton's own path
    y = torch.ones(32, dtype=torch.float32)
    launcher((5, 2), (y, 32, 0.25), {"BLOCK": 64, "num_warps": 4}, 0, 7)
    assert len(fn.slow) == 1
    assert fn.compiled.runs == [(5, 2, 1, 7, "cufunction", "metadata", None, None, None, y, 32, 0.25, 64, True)]
    # a new specialisation, a new option, a new constexpr value, another device: each goes through Triton again
    launcher((5,), (y, 17, 0.25), {"BLOCK": 64, "num_warps": 4}, 0, 7)
    launcher((5,), (y, 32, 0.25), {"BLOCK": 64, "num_warps": 8}, 0, 7)
    launcher((5,), (y, 32, 0.25), {"BLOCK": 128, "num_warps": 4}, 0, 7)
    launcher((5,), (y, 32, 0.25), {"BLOCK": 64, "num_warps": 4, "FLAG": False}, 0, 7)
    launcher((5,), (y, 32, 0.25), {"BLOCK": 64, "num_warps": 4}, 1, 7)
    assert len(fn.slow) == 6 and len(fn.compiled.runs) == 1
    launcher((3,), (y, 16, 0.25), {"BLOCK": 64, "num_warps": 4, "FLAG": False}, 0, 9)
    assert fn.compiled.runs[-1] == (3, 1, 1, 9, "cufunction", "metadata", None, None, None, y, 16, 0.25, 64, False)


def test_missing_constexpr_is_never_cached() -> None:
    fn = _Jit()
    launcher = _KernelLauncher(fn)
    x = torch.zeros(8)
    for _ in range(2):  # BLOCK has no default and is not given: Triton's path reports it; we never cache it
        launcher((1,), (x, 16, 1.0), {}, 0, 0)
    assert len(fn.slow) == 2 and not fn.compiled.runs


def test_a_launcher_that_takes_other_arguments_falls_back_for_good() -> None:
    """A Triton whose compiled-kernel launcher has another signature: the first cached launch raises before
    launching; that call and every later one go through Triton's own path instead."""
    fn = _Jit()

    def incompatible(*args: Any) -> None:
        raise TypeError("function takes exactly 12 arguments")

    fn.compiled.run = incompatible  # type: ignore[method-assign]
    launcher = _KernelLauncher(fn)
    x = torch.zeros(8)
    for _ in range(3):
        launcher((1,), (x, 16, 1.0), {"BLOCK": 64}, 0, 0)
    assert len(fn.slow) == 3 and launcher.broken and not launcher.compiled


def test_a_working_launcher_is_checked_once() -> None:
    fn = _Jit()
    launcher = _KernelLauncher(fn)
    x = torch.zeros(8)
    for _ in range(4):
        launcher((1,), (x, 16, 1.0), {"BLOCK": 64}, 0, 0)
    assert launcher.checked and not launcher.broken
    assert len(fn.slow) == 1 and len(fn.compiled.runs) == 3


def test_launch_plan_replays_with_the_named_tensors_in_place(monkeypatch: Any) -> None:
    """A replay substitutes the named tensors (by their position in the recorded call), keeps every other
    argument as recorded, runs the compiled kernel directly while the alignment matches, and goes through `launch`
    (Triton's own path here) when it does not."""
    monkeypatch.setattr(torch._C, "_cuda_getDevice", lambda: 0, raising=False)
    monkeypatch.setattr(torch._C, "_cuda_getCurrentRawStream", lambda device: 9, raising=False)
    fn = _Jit()
    buf = torch.zeros(64, dtype=torch.float16)
    a, meta, out = buf[:16], torch.zeros(4), torch.zeros(8)
    recorded = [_Recorded(fn, (2,), (a, meta, 48, out), {"BLOCK": 64}, (fn.compiled, (64, True))),
                _Recorded(fn, (3,), (meta, out), {"BLOCK": 32}, None)]  # not cached: always Triton's path
    plan = LaunchPlan(recorded, (a, out))
    a2, out2 = buf[16:32], torch.ones(8)
    monkeypatch.setattr(launch_mod, "_launchers", {id(fn): None})  # `launch` takes Triton's own path
    plan.replay((a2, out2))
    assert fn.compiled.runs == [(2, 1, 1, 9, "cufunction", "metadata", None, None, None, a2, meta, 48, out2, 64,
                                 True)]
    assert fn.slow == [((3,), (meta, out2), {"BLOCK": 32})]
    misaligned = buf[1:17]
    plan.replay((misaligned, out2))
    assert len(fn.compiled.runs) == 1 and fn.slow[1] == ((2,), (misaligned, meta, 48, out2), {"BLOCK": 64})


def test_recording_sees_every_launch_in_the_block() -> None:
    fn = _Jit()
    launch_mod._launchers[id(fn)] = None
    try:
        x = torch.zeros(4)
        with launch_mod.recording() as launches:
            launch_mod.launch(fn, (1,), x, 3, BLOCK=16)
            launch_mod.launch(fn, (2,), x, 5, BLOCK=16)
        launch_mod.launch(fn, (3,), x, 7, BLOCK=16)  # after the block: not recorded
        assert [(r.grid, r.args[1], r.hit) for r in launches] == [((1,), 3, None), ((2,), 5, None)]
        assert len(fn.slow) == 3
    finally:
        del launch_mod._launchers[id(fn)]
