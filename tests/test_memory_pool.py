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


def test_req_to_token_queued_writes_apply_in_order() -> None:
    """On a GPU the request table's writes are queued and applied by the next forward: a later write to the same
    cell wins, and the device table ends equal to the CPU mirror (simulated here with a separate mirror)."""
    pool = ReqToTokenPool(8, 131072, "cpu")
    pool.req_to_token_cpu = pool.req_to_token.clone()  # as on a GPU: a mirror distinct from the device table
    pool.write(7, 0, torch.tensor([1, 2, 3, 4]))
    pool.write_batch(torch.tensor([7, 7, 3]), torch.tensor([1, 2, 131071]), torch.tensor([9, 8, 5]))
    pool.write(7, 2, torch.tensor([6]))
    writes = pool.take_pending_writes()
    assert len(writes) == 3 and pool.take_pending_writes() == []
    assert pool.req_to_token[7, :4].tolist() == [0, 0, 0, 0]  # nothing reached the "device" yet
    pool.apply_writes(writes)
    assert pool.req_to_token[7, :4].tolist() == [1, 9, 6, 4]
    assert int(pool.req_to_token[3, 131071]) == 5
    assert torch.equal(pool.req_to_token, pool.req_to_token_cpu)


def test_pack_to_device_views_are_aligned() -> None:
    """The batch's host tensors travel as one buffer; each view must start 16-byte aligned whatever the lengths
    (Triton compiles a kernel variant per pointer alignment)."""
    from radixserve.model_executor.forward_batch_info import pack_to_device

    parts = [torch.arange(n, dtype=torch.int64) * (i + 1) for i, n in enumerate([3, 1, 4, 0, 5, 2])]
    views = pack_to_device(parts, "cpu", pin=False)
    assert [len(v) for v in views] == [3, 1, 4, 0, 5, 2]
    for p, v in zip(parts, views, strict=True):
        assert torch.equal(p, v)
        assert v.data_ptr() % 16 == 0


def test_default_decode_graph_limit_follows_the_card_and_the_pool() -> None:
    """On a 70 GiB+ card the decode graphs cover 1,024 or 512 requests where the KV pool holds that many of 1,024
    tokens (the pools an 80 GB H100 gave: DeepSeek-V2-Lite's latents 1,288,616 tokens, Llama-3.1-8B's 423,330),
    else 512 from 120 GiB and 256 from 70 GiB; 160 below 70 GiB whatever the pool."""
    from radixserve.model_executor.model_runner import POOL_TOKENS_PER_REQUEST as per
    from radixserve.model_executor.model_runner import default_cuda_graph_max_bs as limit

    assert limit(139.8) == limit(139.8, 10_000) == limit(139.8, 1024 * per - 1) == 512
    assert limit(139.8, 1024 * per) == limit(79.2, 1_288_616) == 1024
    assert limit(79.2, 423_330) == limit(79.2) == limit(79.2, 512 * per - 1) == 256
    assert limit(79.2, 512 * per) == limit(79.2, 1024 * per - 1) == 512
    assert limit(47.5, 2_000_000) == 160


def test_graph_capture_out_of_memory_names_the_flag() -> None:
    """A graph runner that runs out of GPU memory while capturing raises a ValueError naming the flag that sized
    its graphs and the memory fraction; a runner that fits is returned, other errors pass through unchanged."""
    from radixserve.model_executor.model_runner import graphs_within_memory
    from radixserve.server_args import ServerArgs

    args = ServerArgs(mem_fraction_static=0.8)

    def oom() -> None:
        raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 42.00 MiB.")

    with pytest.raises(ValueError, match=r"capturing the decode CUDA graphs ran out of GPU memory.*lower "
                                         r"--cuda-graph-max-bs \(now 512\) or --mem-fraction-static \(now 0.8\)"):
        graphs_within_memory("decode CUDA graphs", "--cuda-graph-max-bs (now 512)", args, oom)
    assert graphs_within_memory("piecewise CUDA graphs", "--piecewise-cuda-graph-max-tokens", args, lambda: 7) == 7

    def broken() -> None:
        raise RuntimeError("not a memory error")

    with pytest.raises(RuntimeError, match="not a memory error"):
        graphs_within_memory("decode CUDA graphs", "--cuda-graph-max-bs", args, broken)
