"""The batched LoRA Triton kernels (shrink + expand over rows grouped by adapter) against the torch reference: on the
CPU under TRITON_INTERPRET=1 (set in conftest), natively on CUDA. Mixed adapters, ranks, sub-projections, base
rows, split-K, and a model run with the kernels forced on."""

from __future__ import annotations

import pytest
import torch

from radixserve.lora.batch_info import LoRABatchInfo, group_rows
from radixserve.lora.ops import lora_delta_torch
from radixserve.lora.triton_ops import lora_shrink_expand

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def make_case(K: int, out_slices: list[tuple[int, int]], R: int, ranks: list[int], seed: int, dtype=torch.float32):
    g = torch.Generator().manual_seed(seed)
    S, n_sub = len(ranks), len(out_slices)
    out_total = sum(n for _, n in out_slices)
    a = torch.zeros(S, n_sub * R, K)
    b = torch.zeros(S, out_total, R)
    for s, r in enumerate(ranks):  # zero padding past each slot's rank, as the pool keeps it
        for j, (off, n) in enumerate(out_slices):
            a[s, j * R:j * R + r] = torch.randn(r, K, generator=g) / K ** 0.5
            b[s, off:off + n, :r] = torch.randn(n, r, generator=g)
    scal = [0.5 + s for s in range(S)]
    return a.to(dtype), b.to(dtype), scal


@pytest.mark.parametrize("K,out_slices,R,req_slots,counts", [
    (64, [(0, 32), (32, 16), (48, 16)], 16, [0, -1, 2, 1, 0], [3, 2, 1, 4, 2]),  # qkv-like, prefill rows
    (96, [(0, 40), (40, 40)], 8, [1, 1, -1, 0], None),  # gate/up-like, decode rows, rank < 16
    (2304, [(0, 24)], 16, [2, 0, -1, 2, 2], None),  # down-like: split-K over the input
    (64, [(0, 16)], 16, [-1, -1], None),  # only base rows: nothing changes
])
def test_kernels_match_torch_reference(K, out_slices, R, req_slots, counts) -> None:
    ranks = [R, max(1, R // 2), 4]
    a, b, scal = make_case(K, out_slices, R, ranks, seed=K)
    packed, groups, max_len = group_rows(req_slots, counts, num_slots=3)
    T = sum(counts) if counts else len(req_slots)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(T, K, generator=g)
    base = torch.randn(T, sum(n for _, n in out_slices), generator=g)
    ref = base.clone()
    lora_delta_torch(x, ref, a, b, out_slices, groups, ranks, scal)
    out = base.to(DEV).clone()
    info = LoRABatchInfo(3, num_groups=len(groups), max_group_len=max_len, packed=packed.to(DEV))
    lora_shrink_expand(x.to(DEV), out, a.to(DEV), b.to(DEV), torch.tensor(scal, device=DEV), out_slices,
                       info.views(), info.num_groups, info.max_group_len)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    if all(s < 0 for s in req_slots):
        assert torch.equal(out.cpu(), base)
    else:
        assert not torch.allclose(ref, base)


def test_kernels_in_bfloat16() -> None:
    out_slices = [(0, 32), (32, 32)]
    a, b, scal = make_case(128, out_slices, 16, [16, 8], seed=7, dtype=torch.bfloat16)
    packed, groups, max_len = group_rows([1, 0, 1, -1], [2, 3, 1, 2], num_slots=2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 128, generator=g).to(torch.bfloat16)
    base = torch.randn(8, 64, generator=g).to(torch.bfloat16)
    ref = base.float().clone()
    lora_delta_torch(x.float(), ref, a.float(), b.float(), out_slices, groups, [16, 8], scal)
    out = base.to(DEV).clone()
    lora_shrink_expand(x.to(DEV), out, a.to(DEV), b.to(DEV), torch.tensor(scal, device=DEV), out_slices,
                       LoRABatchInfo(2, packed=packed.to(DEV)).views(), len(groups), max_len)
    torch.testing.assert_close(out.cpu().float(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model under TRITON_INTERPRET; tests/gpu has the CUDA run")
@pytest.mark.parametrize("stack", [False, True])
def test_model_with_kernels_forced_equals_torch_path(tmp_path, stack) -> None:
    """A mixed batch through the whole model: Triton LoRA kernels (forced on the CPU) == the torch path; with the
    shrink in separate kernels, and stacked into the base GEMM (one expand kernel a layer)."""
    from lora_utils import make_adapters
    from model_utils import make_tiny_model
    from test_scheduler import drain, make_scheduler

    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.lora.pool import set_lora_stacking
    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    base = str(tmp_path / "base")
    make_tiny_model("llama", base, seed=3, vocab_size=512)
    paths = make_adapters(base, str(tmp_path))
    prompts = [[5, 17, 42, 99, 3], [300, 2, 3]]

    def run(warmup: bool = False) -> dict:
        s = make_scheduler(base, lora_paths=[f"{n}={p}" for n, p in paths.items()], enable_overlap_schedule=True)
        if warmup:  # what a CUDA server does at start (every kind of layer, small and large batches): no trace left
            s.worker.model_runner.lora_manager.warmup()
        for i, p in enumerate(prompts):
            for name in (None, "a4", "b8", "c16"):
                params = SamplingParams.from_dict({"max_new_tokens": 4, "temperature": 0, "ignore_eos": True})
                s.process_input_requests([io.TokenizedGenerateReqInput(
                    rid=f"{name}-{i}", input_text=None, input_ids=p, sampling_params=params, lora_id=name)])
        pool = s.worker.model_runner.lora_manager.pool
        stacked.append(len(pool.stacked) == len(pool.targets))
        return {k: v["ids"] for k, v in drain(s).items()}

    stacked: list[bool] = []
    ref = run()
    set_fused_kernels(True)
    set_lora_stacking(stack)
    try:
        got = run(warmup=True)
    finally:
        set_fused_kernels(None)
        set_lora_stacking(None)
    assert stacked == [False, stack]  # the tiny model's layers are too small to stack by default
    assert got == ref


@pytest.mark.skipif(torch.cuda.is_available(), reason="CPU model under TRITON_INTERPRET; tests/gpu has the CUDA run")
def test_one_request_with_stacked_kernels_equals_torch_path(tmp_path) -> None:
    """Batch-1 decode with an adapter on the stacked path: the one-row expand on every projection, fused with
    SiLU * up on gate_up (forced Triton kernels on the CPU) gives the torch path's tokens."""
    from lora_utils import make_adapters
    from model_utils import make_tiny_model
    from test_scheduler import drain, make_scheduler

    from radixserve.layers.triton_ops import set_fused_kernels
    from radixserve.lora.pool import set_lora_stacking
    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    base = str(tmp_path / "base")
    make_tiny_model("llama", base, seed=4, vocab_size=512)
    paths = make_adapters(base, str(tmp_path))

    def run() -> list[int]:
        s = make_scheduler(base, lora_paths=[f"{n}={p}" for n, p in paths.items()])
        params = SamplingParams.from_dict({"max_new_tokens": 6, "temperature": 0, "ignore_eos": True})
        s.process_input_requests([io.TokenizedGenerateReqInput(rid="r", input_text=None, input_ids=[7, 19, 300, 4],
                                                               sampling_params=params, lora_id="c16")])
        return drain(s)["r"]["ids"]

    ref = run()
    set_fused_kernels(True)
    set_lora_stacking(True)
    try:
        got = run()
    finally:
        set_fused_kernels(None)
        set_lora_stacking(None)
    assert got == ref


@pytest.mark.parametrize("graph_bs,req_slots", [(1, [2]), (4, [1, -1, 1]), (8, [0, 2, 1, 2, -1])])
def test_graph_grid_over_a_static_buffer_equals_eager(graph_bs, req_slots) -> None:
    """What a captured decode graph runs: the grid sized for the graph's batch (min(S, bs) groups, bs rows) over a
    static buffer into which the grouping of the batch padded to the graph's rows was copied."""
    out_slices = [(0, 32), (32, 16), (48, 16)]
    a, b, scal = make_case(64, out_slices, 16, [16, 8, 4], seed=graph_bs)
    packed, groups, max_len = group_rows(req_slots, None, num_slots=3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(graph_bs, 64, generator=g)  # the graph's static input: rows past the batch are padding
    base = torch.randn(graph_bs, 64, generator=g)
    args = (a.to(DEV), b.to(DEV), torch.tensor(scal, device=DEV), out_slices)
    eager = base.to(DEV).clone()
    raw = len(req_slots)
    lora_shrink_expand(x[:raw].to(DEV), eager[:raw], *args, LoRABatchInfo(3, packed=packed.to(DEV)).views(),
                       len(groups), max_len)
    # the graph's static buffer holds the grouping of the graph's batch, padding rows as base rows
    static, _, _ = group_rows(req_slots + [-1] * (graph_bs - raw), None, num_slots=3)
    info = LoRABatchInfo(3, num_groups=min(3, graph_bs), max_group_len=graph_bs, packed=static.to(DEV),
                         capturing=True)
    graph = base.to(DEV).clone()
    lora_shrink_expand(x.to(DEV), graph, *args, info.views(), info.num_groups, info.max_group_len)
    torch.testing.assert_close(graph, eager)


@pytest.mark.parametrize("K,out_slices,R,req_slots,counts", [
    (64, [(0, 48), (48, 16), (64, 16)], 16, [0, -1, 2, 1, 0], [3, 2, 1, 4, 2]),  # qkv-like: blocks straddle slices
    (96, [(0, 40), (40, 40)], 8, [1, 1, -1, 0], None),  # gate/up-like, rank < 16
    (32, [(0, 24)], 16, [2, 0, -1, 2, 2] * 5, None),  # 25 rows: two blocks, each of several adapters
    (32, [(0, 24), (24, 40)], 16, [2, 0, -1, 1] * 20, None),  # 80 rows: the large-batch blocks, slot by slot
    (64, [(0, 48), (48, 16), (64, 16)], 8, [0, -1, 2, 1], [30, 10, 25, 20]),  # an 85-token prefill
    (64, [(0, 16)], 16, [-1, -1], None),  # only base rows: a copy
])
@pytest.mark.parametrize("mixed_dot", [True, False], ids=["one-dot", "slot-loop"])
def test_stacked_expand_matches_torch_reference(K, out_slices, R, req_slots, counts, mixed_dot, monkeypatch) -> None:
    """The stacked path: one GEMM over [W; A_0; A_1; A_2] then one expand kernel == the base output + the torch
    reference's deltas, for every row (base rows copied); blocks of several adapters in one dot, or slot by slot."""
    from radixserve.lora import triton_ops
    from radixserve.lora.triton_ops import lora_expand_stacked

    if not mixed_dot:
        monkeypatch.setattr(triton_ops, "_MIXED_DOT_K", 0)

    ranks = [R, max(1, R // 2), 4]
    a, b, scal = make_case(K, out_slices, R, ranks, seed=K + 1)
    N = sum(n for _, n in out_slices)
    packed, groups, _ = group_rows(req_slots, counts, num_slots=3)
    T = sum(counts) if counts else len(req_slots)
    g = torch.Generator().manual_seed(5)
    x = torch.randn(T, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    ref = x @ w.T
    lora_delta_torch(x, ref, a, b, out_slices, groups, ranks, scal)
    y = x @ torch.cat([w, a.reshape(-1, K)]).T
    info = LoRABatchInfo(3, packed=packed.to(DEV))
    _, _, _, order, sorted_slots = info.views()
    out = lora_expand_stacked(y.to(DEV), b.to(DEV), torch.tensor(scal, device=DEV), out_slices, order, sorted_slots,
                              info.num_rows)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    if all(s < 0 for s in req_slots):
        assert torch.equal(out.cpu(), y[:, :N])


@pytest.mark.parametrize("slot", [-1, 0, 2])
@pytest.mark.parametrize("out_slices,R", [([(0, 48), (48, 16), (64, 16)], 16), ([(0, 40), (40, 40)], 8)])
def test_one_row_gemv_of_the_active_slot_then_expand(slot, out_slices, R) -> None:
    """Decode at batch 1 on the stacked path: the one-row GEMV over [W; A_0; A_1; A_2] computes the base rows and
    only the row's slot's A rows (the other slots' outputs are never read), then the expand == the reference; a
    base row (-1) computes no A row at all."""
    from radixserve.layers.quantization.gemv_configs import GemvConfig
    from radixserve.layers.triton_ops.gemv import gemv_row
    from radixserve.lora.triton_ops import lora_expand_row, lora_expand_stacked

    K = 64
    ranks = [R, max(1, R // 2), 4]
    a, b, scal = make_case(K, out_slices, R, ranks, seed=11)
    N = sum(n for _, n in out_slices)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1, K, generator=g)
    w = torch.randn(N, K, generator=g) / K ** 0.5
    stacked = torch.cat([w, a.reshape(-1, K)]).to(DEV)
    packed, groups, _ = group_rows([slot], None, num_slots=3)
    info = LoRABatchInfo(3, packed=packed.to(DEV))
    _, _, _, order, sorted_slots = info.views()
    cfg = None if DEV == "cuda" else GemvConfig("ew", 4, 32)
    y = gemv_row(x.to(DEV), stacked, None, cfg, slots=(sorted_slots, N, a.shape[1]))
    ref_y = x @ stacked.cpu().T
    mine = slice(N + slot * a.shape[1], N + (slot + 1) * a.shape[1]) if slot >= 0 else slice(0, 0)
    torch.testing.assert_close(y[:, :N].cpu(), ref_y[:, :N], rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(y[:, mine].cpu(), ref_y[:, mine], rtol=1e-5, atol=1e-5)
    out = lora_expand_stacked(y, b.to(DEV), torch.tensor(scal, device=DEV), out_slices, order, sorted_slots,
                              info.num_rows)
    ref = x @ w.T
    lora_delta_torch(x, ref, a, b, out_slices, groups, ranks, scal)
    torch.testing.assert_close(out.cpu(), ref, rtol=1e-5, atol=1e-5)
    # the one-row expand (what the hook runs at one row), and for [gate; up] with SiLU(gate) * up fused
    row = lora_expand_row(y, b.to(DEV), torch.tensor(scal, device=DEV), out_slices, sorted_slots)
    torch.testing.assert_close(row.cpu(), ref, rtol=1e-5, atol=1e-5)
    if len(out_slices) == 2:
        act = lora_expand_row(y, b.to(DEV), torch.tensor(scal, device=DEV), out_slices, sorted_slots, silu_mul=True)
        half = N // 2
        torch.testing.assert_close(act.cpu(), torch.nn.functional.silu(ref[:, :half]) * ref[:, half:], rtol=1e-5,
                                   atol=1e-5)
    else:
        with pytest.raises(ValueError, match="gate; up"):
            lora_expand_row(y, b.to(DEV), torch.tensor(scal, device=DEV), out_slices, sorted_slots, silu_mul=True)


def test_one_row_gemv_slots_are_checked() -> None:
    from radixserve.layers.triton_ops.gemv import gemv_row

    slot = torch.zeros(1, dtype=torch.int64)
    with pytest.raises(ValueError, match="do not tile"):
        gemv_row(torch.randn(1, 16), torch.randn(40, 16), slots=(slot, 32, 6))
    with pytest.raises(ValueError, match="no slots"):
        gemv_row(torch.randn(1, 16), torch.randn(40, 16), silu_mul=True, slots=(slot, 32, 8))


def test_stacked_expand_in_bfloat16() -> None:
    from radixserve.lora.triton_ops import lora_expand_stacked

    out_slices = [(0, 32), (32, 32)]
    a, b, scal = make_case(128, out_slices, 16, [16, 8], seed=9, dtype=torch.bfloat16)
    packed, groups, _ = group_rows([1, 0, 1, -1], [2, 3, 1, 2], num_slots=2)
    g = torch.Generator().manual_seed(2)
    x = torch.randn(8, 128, generator=g).to(torch.bfloat16)
    w = (torch.randn(64, 128, generator=g) / 8).to(torch.bfloat16)
    y = x @ torch.cat([w, a.reshape(-1, 128)]).T
    ref = y[:, :64].float()
    lora_delta_torch(x.float(), ref, a.float(), b.float(), out_slices, groups, [16, 8], scal)
    info = LoRABatchInfo(2, packed=packed.to(DEV))
    out = lora_expand_stacked(y.to(DEV), b.to(DEV), torch.tensor(scal, device=DEV), out_slices, *info.views()[3:],
                              info.num_rows)
    torch.testing.assert_close(out.cpu().float(), ref, rtol=3e-2, atol=3e-2)


@pytest.mark.parametrize("graph_bs,req_slots", [(1, [2]), (4, [1, -1, 1]), (8, [0, 2, 1, 2, -1]), (4, [-1, -1])])
def test_stacked_expand_over_a_graph_buffer_equals_eager(graph_bs, req_slots) -> None:
    """What a captured decode graph runs on the stacked path: the manager's static buffer, captured for the graph's
    batch, then loaded with a smaller batch's grouping (padding rows as base rows): the real rows equal eager."""
    from types import SimpleNamespace

    from radixserve.lora.manager import LoRAManager
    from radixserve.lora.triton_ops import lora_expand_stacked

    S, K, out_slices = 3, 64, [(0, 48), (48, 16), (64, 16)]
    a, b, scal = make_case(K, out_slices, 16, [16, 8, 4], seed=graph_bs)
    m = LoRAManager.__new__(LoRAManager)  # the grouping state alone: no model
    m.num_slots, m.device, m.is_cuda, m.info = S, DEV, DEV == "cuda", LoRABatchInfo(S)
    m.init_cuda_graph_state(8)
    m.begin_capture(graph_bs)
    captured = m.info.views()  # the kernels' arguments, fixed at capture
    m.end_capture()
    raw = len(req_slots)
    packed, groups, max_len = group_rows(req_slots, None, S)
    info = LoRABatchInfo(S, num_groups=len(groups), max_group_len=max_len, packed=packed.to(DEV),
                         req_slots=req_slots)
    if not groups:
        info.packed = None
    m.load_graph_inputs(SimpleNamespace(lora_info=info, batch_size=raw), graph_bs)
    g = torch.Generator().manual_seed(4)
    y = torch.randn(graph_bs, 80 + S * 3 * 16, generator=g).to(DEV)
    args = (b.to(DEV), torch.tensor(scal, device=DEV), out_slices)
    graph = lora_expand_stacked(y, *args, captured[3], captured[4], graph_bs)
    eager_packed = group_rows(req_slots, None, S)[0].to(DEV)
    eager_info = LoRABatchInfo(S, packed=eager_packed)
    eager = lora_expand_stacked(y[:raw], *args, *eager_info.views()[3:], raw)
    torch.testing.assert_close(graph[:raw], eager)
    torch.testing.assert_close(graph[raw:], y[raw:, :80])  # padding rows: copied as base rows
