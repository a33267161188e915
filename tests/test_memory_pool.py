"""Exact accounting of the two memory pools."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool


def make_pool(size: int = 16) -> TokenToKVPool:
    return TokenToKVPool(size, torch.float32, num_kv_heads=2, head_dim=4, num_layers=2, device="cpu")


def test_alloc_free_round_trip() -> None:
    pool = make_pool()
    a = pool.alloc(5)
    b = pool.alloc(11)
    assert pool.available_size() == 0
    assert sorted(torch.cat([a, b]).tolist()) == list(range(1, 17))  # slot 0 is padding, never handed out
    assert pool.alloc(1) is None  # exhaustion is reported, not raised
    pool.free(a)
    assert pool.available_size() == 5
    pool.free(b)
    assert pool.available_size() == 16
    assert pool.alloc(0).numel() == 0


def test_double_free_and_out_of_range_raise() -> None:
    pool = make_pool()
    a = pool.alloc(3)
    pool.free(a)
    with pytest.raises(ValueError, match="twice"):
        pool.free(a)
    with pytest.raises(ValueError, match="out of range"):
        pool.free(torch.tensor([0]))
    with pytest.raises(ValueError, match="out of range"):
        pool.free(torch.tensor([17]))
    c = pool.alloc(2)
    with pytest.raises(ValueError, match="twice"):
        pool.free(torch.cat([c, c]))
    assert pool.available_size() == 14  # a failed free changes nothing


def test_kv_buffers_written_at_slots() -> None:
    pool = make_pool()
    loc = pool.alloc(3)
    k = torch.randn(3, 2, 4)
    pool.set_kv_buffer(1, loc, k, -k)
    kb, vb = pool.get_kv_buffer(1)
    torch.testing.assert_close(kb[loc], k)
    torch.testing.assert_close(vb[loc], -k)
    assert pool.bytes_per_token() == 2 * 2 * 2 * 4 * 4


def test_req_to_token_pool() -> None:
    pool = ReqToTokenPool(4, 32, "cpu")
    rows = pool.alloc(3)
    assert pool.available_size() == 1 and pool.alloc(2) is None
    pool.write(rows[0], 2, torch.tensor([7, 8, 9]))
    assert pool.read(rows[0], 2, 5).tolist() == [7, 8, 9]
    with pytest.raises(ValueError, match="context length"):
        pool.write(rows[0], 30, torch.tensor([1, 2, 3]))
    pool.free(rows)
    with pytest.raises(ValueError, match="twice"):
        pool.free(rows[0])
    with pytest.raises(ValueError, match="out of range"):
        pool.free(9)
    assert pool.available_size() == 4
