"""The FlashInfer backend's page table (kv_indptr / kv_indices / last_page_len from the request table), on the CPU:
the module is imported with a stand-in for the flashinfer package, which only the backend class needs."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import sys
import types

import pytest
import torch


@pytest.fixture()
def backend_module(monkeypatch):
    name = "radixserve.layers.attention.flashinfer_backend"
    stubbed = importlib.util.find_spec("flashinfer") is None
    if stubbed:
        stub = types.ModuleType("flashinfer")
        stub.__spec__ = importlib.machinery.ModuleSpec("flashinfer", None)
        monkeypatch.setitem(sys.modules, "flashinfer", stub)
        monkeypatch.delitem(sys.modules, name, raising=False)
    yield importlib.import_module(name)
    if stubbed:  # leave no module built on the stand-in behind (the registry must still see no flashinfer)
        sys.modules.pop(name, None)
        package = sys.modules["radixserve.layers.attention"]
        if hasattr(package, "flashinfer_backend"):
            delattr(package, "flashinfer_backend")


@pytest.fixture()
def page_table(backend_module):
    return backend_module.page_table


def test_ragged_threshold_setting(backend_module, monkeypatch) -> None:
    """RADIXSERVE_FLASHINFER_RAGGED_MIN_TOKENS: unset the module's default, a count as given, anything else refused."""
    env = backend_module.RAGGED_ENV
    monkeypatch.delenv(env, raising=False)
    assert backend_module.ragged_min_tokens() == backend_module.RAGGED_MIN_TOKENS
    monkeypatch.setenv(env, " 0 ")
    assert backend_module.ragged_min_tokens() == 0
    monkeypatch.setenv(env, "4096")
    assert backend_module.ragged_min_tokens() == 4096
    for bad in ("-1", "1e3", "many"):
        monkeypatch.setenv(env, bad)
        with pytest.raises(ValueError, match=env):
            backend_module.ragged_min_tokens()


@pytest.mark.parametrize("page_size", [1, 16])
def test_page_table_lists_each_requests_pages(page_table, page_size: int) -> None:
    lens = [1, 37, 0, 16]
    rows = torch.tensor([3, 1, 2, 0])
    r2t = torch.zeros(4, 64, dtype=torch.int32)
    for row in range(4):  # row r's token i sits in slot (8 * r + i // page_size) * page_size + i % page_size
        i = torch.arange(64)
        r2t[row] = ((8 * row + i // page_size) * page_size + i % page_size).to(torch.int32)
    indptr, indices, last = page_table(r2t, rows, lens, page_size)
    pages = [(n + page_size - 1) // page_size for n in lens]
    assert indptr.tolist() == [0] + torch.cumsum(torch.tensor(pages), 0).tolist()
    want = [8 * int(row) + p for row, n in zip(rows, pages, strict=True) for p in range(n)]
    assert indices.tolist() == want
    assert last.tolist() == [n - (p - 1) * page_size if p else 0 for n, p in zip(lens, pages, strict=True)]
    out = torch.full((80,), -1, dtype=torch.int32)
    _, into, _ = page_table(r2t, rows, lens, page_size, out_indices=out)
    assert into is out and out[:len(want)].tolist() == want


@pytest.mark.parametrize("programs", [512, 5])
@pytest.mark.parametrize("page_size", [1, 16])
def test_page_indices_kernel_matches_page_table(page_table, page_size: int, programs: int,
                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """The replay's one-launch page ids (Triton; the interpreter here) equal page_table's, requests of several
    lengths (past one block of pages, a request of one page, padding rows of length 1) written at their offsets;
    with 5 programs for 5 requests (one split each) a request's program loops over its blocks of pages."""
    from radixserve.layers.attention.triton_ops import page_indices
    from radixserve.layers.attention.triton_ops.page_indices import BLOCK_PAGES, fill_page_indices

    monkeypatch.setattr(page_indices, "PROGRAMS", programs)
    assert page_indices.page_index_splits(5) == (32 if programs == 512 else 1)
    dev = "cuda" if torch.cuda.is_available() else "cpu"  # compiled on a GPU, interpreted on the CPU
    gen = torch.Generator().manual_seed(page_size)
    width = (2 * BLOCK_PAGES + 40) * page_size
    r2t = torch.zeros(5, width, dtype=torch.int32)
    for row in range(5):  # each row's pages in a shuffled order of page ids
        perm = torch.randperm(width // page_size, generator=gen) + 1000 * row
        i = torch.arange(width)
        r2t[row] = (perm[i // page_size] * page_size + i % page_size).to(torch.int32)
    rows = torch.tensor([4, 0, 2, 1, 1])
    lens = [(2 * BLOCK_PAGES + 3) * page_size - 1, 1, 37, 1, page_size]
    indptr, want, _ = page_table(r2t, rows, lens, page_size)
    out = torch.full((want.numel() + 8,), -1, dtype=torch.int32, device=dev)
    fill_page_indices(r2t.to(dev), rows.to(dev), indptr.to(dev), out, page_size)
    assert out[:want.numel()].tolist() == want.tolist()
    assert out[want.numel():].tolist() == [-1] * 8  # nothing written past the last request's pages
    with pytest.raises(ValueError, match="indptr"):
        fill_page_indices(r2t.to(dev), rows.to(dev), indptr[:3].to(dev), out, page_size)


def test_ragged_plan_merges_only_with_cached_prefixes(backend_module) -> None:
    """A ragged extend attends to the paged wrappers too exactly when they were planned (over cached prefixes)."""
    plan = backend_module._Plan
    assert plan(False, {-1: "paged"}, ragged="ragged").prefix
    assert not plan(False, {}, ragged="ragged").prefix
    assert not plan(False, {-1: "paged"}).prefix
