"""--page-size > 1: the paged allocator (whole pages on a CPU free list, extend continuing a request's partly filled
last page, decode taking the next slot or a new page) and the radix cache over whole pages only."""

from __future__ import annotations

import pytest
import torch

from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.mem_cache.radix_cache import RadixCache
from radixserve.server_args import ServerArgs

P = 4


def pool(size: int = 32, page_size: int = P) -> TokenToKVPool:
    return TokenToKVPool(size, torch.float32, num_kv_heads=1, head_dim=2, num_layers=1, device="cpu",
                         page_size=page_size)


def test_pool_is_whole_pages_and_page_zero_is_padding() -> None:
    kv = pool(size=30)
    assert kv.size == 28 and kv.num_pages == 7 and kv.available_size() == 28
    assert kv.k_buffer[0].shape[0] == 128  # page 0 (the padding slot) and 7 pages, rounded up to 128 rows
    slots = kv.alloc(28)
    assert slots is not None and int(slots.min()) == P and int(slots.max()) == 31
    assert kv.alloc(1) is None
    with pytest.raises(ValueError, match="at least one page"):
        pool(size=3)


def test_alloc_extend_continues_the_last_page_then_takes_new_pages() -> None:
    kv = pool()
    first = kv.alloc_extend([0], [6], [0])  # 6 tokens: one full page and 2 slots of a second
    assert first is not None and len(first) == 6
    assert kv.available_size() == 32 - 2 * P
    pages = (first // P).tolist()
    assert pages[:4] == [pages[0]] * 4 and pages[4:] == [pages[4]] * 2 and pages[0] != pages[4]
    assert (first % P).tolist() == [0, 1, 2, 3, 0, 1]
    # 5 more tokens: 2 slots after the last one (same page), then 3 of a new page
    more = kv.alloc_extend([6], [11], [int(first[-1])])
    assert more[:2].tolist() == [int(first[-1]) + 1, int(first[-1]) + 2]
    assert (more[2:] // P).unique().numel() == 1 and (more[2:] % P).tolist() == [0, 1, 2]
    assert kv.extend_tokens_needed([6], [11]) == P
    with pytest.raises(ValueError, match="does not continue"):
        kv.alloc_extend([6], [7], [int(first[2])])  # slot at offset 2, but position 5 sits at offset 1


def test_alloc_decode_takes_the_next_slot_or_a_new_page() -> None:
    kv = pool()
    a = kv.alloc_extend([0, 0], [3, 4], [0, 0])
    last = torch.tensor([int(a[2]), int(a[6])])
    seq_lens = torch.tensor([4, 5])  # positions 3 (same page) and 4 (a new page)
    assert kv.decode_tokens_needed(seq_lens) == P
    out = kv.alloc_decode(seq_lens, last)
    assert int(out[0]) == int(a[2]) + 1
    assert int(out[1]) % P == 0 and int(out[1]) // P not in (a // P).tolist()


def test_free_frees_whole_pages_and_catches_double_frees() -> None:
    kv = pool()
    slots = kv.alloc(6)
    kv.free(slots[4:5])  # one slot of the second page frees that page
    assert kv.available_size() == 32 - P
    with pytest.raises(ValueError, match="freed twice"):
        kv.free(slots[5:6])
    kv.free(slots[:4])
    assert kv.available_size() == 32


def make_cache(size: int = 64) -> tuple[RadixCache, TokenToKVPool, ReqToTokenPool]:
    kv = pool(size)
    r2t = ReqToTokenPool(4, 64, "cpu")
    return RadixCache(r2t, kv), kv, r2t


def test_radix_cache_matches_and_inserts_whole_pages_only() -> None:
    cache, kv, _ = make_cache()
    key = list(range(10, 20))  # 10 tokens: 2 whole pages + 2
    slots = kv.alloc(8)
    with pytest.raises(ValueError, match="whole number"):
        cache.insert(key, kv.alloc(10))
    assert cache.insert(key[:8], slots) == 0
    got, node = cache.match_prefix(key)
    assert got.tolist() == slots.tolist()
    got, _ = cache.match_prefix(key[:7])  # a partial page is never matched
    assert got.tolist() == slots[:4].tolist()
    # a key diverging inside the second page shares the first page only; the split is page aligned
    other = key[:5] + [99, 98, 97]
    assert cache.insert(other, torch.cat([slots[:4], kv.alloc(4)])) == 4
    assert sorted(len(c.key) for c in cache.root.children[tuple(key[:P])].children.values()) == [P, P]
    got, _ = cache.match_prefix(other)
    assert len(got) == 8 and got[:4].tolist() == slots[:4].tolist()


def test_radix_cache_finished_request_frees_its_partial_page_and_idle_invariant_holds() -> None:
    cache, kv, r2t = make_cache()
    row = r2t.alloc(1)[0]
    prompt = list(range(30, 41))  # 11 tokens
    slots = kv.alloc_extend([0], [11], [0])
    r2t.write(row, 0, slots)
    from types import SimpleNamespace
    req = SimpleNamespace(req_pool_idx=row, origin_input_ids=prompt, output_ids=[7], prefix_indices=torch.empty(0),
                          last_node=cache.root, kv_committed_len=11, lora_id=None, fill_ids=prompt)
    cache.inc_lock_ref(cache.root)
    cache.cache_finished_req(req)
    assert cache.evictable_size() == 8 and kv.available_size() == 64 - 8  # the third page went back
    assert kv.available_size() + cache.evictable_size() + cache.protected_size() == kv.size
    assert cache.evict(1) == 8 and kv.available_size() == kv.size


def test_speculative_decoding_refuses_pages() -> None:
    with pytest.raises(ValueError, match="page-size 1"):
        ServerArgs(page_size=16, speculative_algorithm="ngram")
    with pytest.raises(ValueError, match="page-size"):
        ServerArgs(page_size=0)
