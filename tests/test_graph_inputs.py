"""The kernels that load a decode batch into a CUDA graph's static buffers (`load_graph_inputs`): live rows copied
(int32 or int64 sources), padding rows zeroed with the fill length, rows past the graph's size untouched, the pack
header's batch size set to -1 when given; from the batch's one-copy pack (`load_decode_pack`, whose header row gives
the batch size and row stride) the same, plus the request-table write of the new KV slots and the ids in flight
resolved through the future map, and nothing at all when the header's batch size is -1. Run under TRITON_INTERPRET=1
on the CPU (set in conftest), natively on CUDA."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.graph_inputs import load_decode_pack, load_graph_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("raw,bs", [(3, 8), (8, 8), (1, 1), (290, 300)])
def test_live_rows_copied_padding_filled(raw: int, bs: int) -> None:
    max_bs = bs + 5
    g = torch.Generator().manual_seed(raw)
    src = tuple(torch.randint(0, 1 << 20, (raw,), generator=g, dtype=dt).to(DEV)
                for dt in (torch.int64, torch.int32, torch.int64, torch.int32, torch.int64))
    dst = tuple(torch.full((max_bs,), -7, dtype=torch.int64, device=DEV) for _ in range(5))
    header = torch.tensor([5, 8, 3], dtype=torch.int64, device=DEV)
    load_graph_inputs(dst, src, bs, fill=1, header=header)
    assert header.tolist() == [-1, 8, 3]  # the batch size only
    for i, (d, s) in enumerate(zip(dst, src, strict=True)):
        assert torch.equal(d[:raw].cpu(), s.long().cpu())
        pad = 1 if i == 2 else 0  # seq_lens get the fill value, everything else zero
        assert torch.equal(d[raw:bs].cpu(), torch.full((bs - raw,), pad, dtype=torch.int64))
        assert torch.equal(d[bs:].cpu(), torch.full((max_bs - bs,), -7, dtype=torch.int64))


def test_bad_shapes_raise() -> None:
    src = tuple(torch.zeros(4, dtype=torch.int64, device=DEV) for _ in range(5))
    dst = tuple(torch.zeros(8, dtype=torch.int64, device=DEV) for _ in range(5))
    with pytest.raises(ValueError, match="does not fit"):
        load_graph_inputs(dst, src, 2, fill=1)
    with pytest.raises(ValueError, match="at least 16 rows"):
        load_graph_inputs(dst, src, 16, fill=1)
    with pytest.raises(ValueError, match="one length"):
        load_graph_inputs(dst, (*src[:4], torch.zeros(3, dtype=torch.int64, device=DEV)), 8, fill=1)
    with pytest.raises(ValueError, match="five"):
        load_graph_inputs(dst[:4], src, 8, fill=1)


def make_pack(ids: torch.Tensor, rows: torch.Tensor, lens: torch.Tensor, locs: torch.Tensor, width: int,
              raw: int | None = None) -> torch.Tensor:
    """The layout of ScheduleBatch.decode_pack: header (batch size, row stride), then the five columns."""
    n = len(ids)
    pack = torch.full((6, width), -99, dtype=torch.int64)
    pack[0, :2] = torch.tensor([n if raw is None else raw, width])
    pack[1, :n], pack[2, :n], pack[3, :n], pack[4, :n], pack[5, :n] = ids, rows, lens, locs, lens - 1
    return pack


@pytest.mark.parametrize("raw,bs,width,future", [(3, 8, 4, True), (8, 8, 8, False), (1, 1, 2, True),
                                                 (290, 300, 290, True)])
def test_decode_pack_loads_writes_table_and_resolves_ids(raw: int, bs: int, width: int, future: bool) -> None:
    g = torch.Generator().manual_seed(raw)
    rows_n, cols_n = 400, 64
    rows = torch.randperm(rows_n, generator=g)[:raw]  # one row per request, as the scheduler gives them
    lens = torch.randint(1, cols_n + 1, (raw,), generator=g)
    locs = torch.randint(1, 1 << 20, (raw,), generator=g)
    fmap = torch.randint(0, 50_000, (64,), generator=g)
    ids = torch.randint(0, 50_000, (raw,), generator=g)
    if future:  # every other id is -(slot of the future map)
        slots = torch.randint(1, 64, (raw,), generator=g)
        ids[::2] = -slots[::2]
    pack = make_pack(ids, rows, lens, locs, width)
    table = torch.randint(0, 9, (rows_n, cols_n), generator=g, dtype=torch.int32)
    want_table = table.clone()
    want_table[rows, lens - 1] = locs.to(torch.int32)
    want_ids = torch.where(ids < 0, fmap[(-ids).clamp(min=0)], ids) if future else ids
    max_bs = bs + 3
    dst = tuple(torch.full((max_bs,), -7, dtype=torch.int64, device=DEV) for _ in range(5))
    table_d = table.to(DEV)
    load_decode_pack(dst, pack.to(DEV), bs, 1, table_d, fmap.to(DEV) if future else None)
    for i, (d, want) in enumerate(zip(dst, (want_ids, rows, lens, locs, lens - 1), strict=True)):
        assert torch.equal(d[:raw].cpu(), want)
        pad = 1 if i == 2 else 0
        assert torch.equal(d[raw:bs].cpu(), torch.full((bs - raw,), pad, dtype=torch.int64))
        assert torch.equal(d[bs:].cpu(), torch.full((max_bs - bs,), -7, dtype=torch.int64))
    assert torch.equal(table_d.cpu(), want_table)  # the live rows' cells only: padding rows write nothing


def test_decode_pack_with_batch_size_minus_one_does_nothing() -> None:
    """The header a general-path replay leaves (load_graph_inputs): the graph's own input kernel touches nothing."""
    ids, rows, lens, locs = (torch.tensor([5, 6, 7]), torch.tensor([1, 2, 3]), torch.tensor([4, 5, 6]),
                             torch.tensor([10, 11, 12]))
    pack = make_pack(ids, rows, lens, locs, 4, raw=-1)
    dst = tuple(torch.full((8,), -7, dtype=torch.int64, device=DEV) for _ in range(5))
    table = torch.zeros(8, 16, dtype=torch.int32, device=DEV)
    load_decode_pack(dst, pack.to(DEV), 4, 1, table, torch.zeros(4, dtype=torch.int64, device=DEV))
    assert all(torch.equal(d.cpu(), torch.full((8,), -7, dtype=torch.int64)) for d in dst)
    assert not table.any()


def test_general_load_then_pack_kernel_keeps_the_general_batch() -> None:
    """A graph replayed after load_graph_inputs: its captured pack kernel (run here after it) leaves the loaded
    buffers as they are, even with a stale batch in the pack."""
    stale = make_pack(torch.tensor([1, 2]), torch.tensor([3, 4]), torch.tensor([5, 6]), torch.tensor([7, 8]), 2)
    pack = stale.to(DEV)
    src = tuple(torch.tensor([20, 21, 22], device=DEV) for _ in range(5))
    dst = tuple(torch.zeros(4, dtype=torch.int64, device=DEV) for _ in range(5))
    table = torch.zeros(8, 16, dtype=torch.int32, device=DEV)
    load_graph_inputs(dst, src, 4, fill=1, header=pack)
    load_decode_pack(dst, pack, 4, 1, table)
    assert dst[0].tolist() == [20, 21, 22, 0] and dst[2].tolist() == [20, 21, 22, 1]
    assert not table.any()


def test_decode_pack_bad_shapes_raise() -> None:
    dst = tuple(torch.zeros(8, dtype=torch.int64, device=DEV) for _ in range(5))
    table = torch.zeros(4, 16, dtype=torch.int32, device=DEV)
    pack = torch.zeros(6, 4, dtype=torch.int64, device=DEV)
    with pytest.raises(ValueError, match="int64 \\[6"):
        load_decode_pack(dst, pack[:5], 8, 1, table)
    with pytest.raises(ValueError, match="int64 \\[6"):
        load_decode_pack(dst, pack[:, :3], 8, 1, table)  # rows not contiguous
    with pytest.raises(ValueError, match="int64 \\[6"):
        load_decode_pack(dst, pack.int(), 8, 1, table)
    with pytest.raises(ValueError, match="int32 table"):
        load_decode_pack(dst, pack, 8, 1, table.long())
    with pytest.raises(ValueError, match="at least 16 rows"):
        load_decode_pack(dst, pack, 16, 1, table)
