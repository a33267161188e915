"""The decode batch's one host array (`ScheduleBatch.decode_pack`) and the check that sends a batch down ForwardBatch's
one-copy path (`_graph_decode_from_pack`). The path itself runs only on CUDA (tests/gpu/test_gpu_engine.py compares
it with the general one); here: the header row holds the batch size and the row stride, the pack's other rows are
the batch's columns, its rows are 16-byte aligned, the batch's own request-table write is the only one queued, and
every change to the batch (filter, merge, mixing with a prefill, a speculative verify) drops the pack so that a
stale one is never sent."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool
from radixserve.model_executor.forward_batch_info import _graph_decode_from_pack
from radixserve.sampling.sampling_params import SamplingParams


def decode_batch(n: int, page_size: int = 1) -> ScheduleBatch:
    req_pool = ReqToTokenPool(32, 256, "cpu")
    req_pool.req_to_token_cpu = req_pool.req_to_token.clone()  # as on a GPU: a mirror apart from the device table
    kv_pool = TokenToKVPool(4096, torch.float32, 1, 8, 1, "cpu", page_size=page_size)
    reqs = []
    for i in range(n):
        r = Req(str(i), list(range(5, 5 + 10 + 3 * i)), SamplingParams.from_dict({"temperature": 0}))
        r.req_pool_idx = req_pool.alloc(1)[0]
        prompt_slots = kv_pool.alloc(len(r.origin_input_ids) + 1)  # the prompt and the first sampled token
        req_pool.write(r.req_pool_idx, 0, prompt_slots)
        r.output_ids = [100 + i]
        reqs.append(r)
    req_pool.take_pending_writes()
    batch = ScheduleBatch(reqs, req_pool, kv_pool, None, "cpu", 1000)
    batch.prepare_for_decode()
    return batch


FUTURE = torch.zeros(8, dtype=torch.int64)


def graph_runner(can_run: bool = True) -> SimpleNamespace:
    return SimpleNamespace(is_cuda=True, cuda_graph_runner=SimpleNamespace(can_run_decode=lambda n, lens: can_run),
                           future_token_ids_map=FUTURE)


@pytest.mark.parametrize("n,page_size", [(1, 1), (4, 1), (5, 1), (3, 16)])
def test_pack_rows_are_the_batch_columns(n: int, page_size: int) -> None:
    batch = decode_batch(n, page_size)
    pack = batch.decode_pack
    m = n + n % 2
    assert pack.shape == (6, m) and pack.dtype == torch.int64 and pack.is_contiguous()
    assert pack[0, :2].tolist() == [n, m]  # the header the graph's input kernel reads: batch size, row stride
    assert pack.stride(0) % 2 == 0  # each row starts 16-byte aligned
    cols = (batch.input_ids, batch.req_pool_indices, batch.seq_lens, batch.out_cache_loc, batch.positions)
    for i, col in enumerate(cols):
        assert torch.equal(pack[i + 1, :n], col)
        assert col.data_ptr() == pack[i + 1].data_ptr()  # views, not copies
    assert batch.input_ids.tolist() == [100 + i for i in range(n)]
    lens = [len(r.origin_input_ids) + 1 for r in batch.reqs]
    assert batch.seq_lens.tolist() == lens and batch.positions.tolist() == [n_ - 1 for n_ in lens]
    # the mirror holds the new slots at the new positions; the device table waits for the forward
    pool = batch.req_to_token_pool
    rows, pos = batch.req_pool_indices, batch.positions
    assert torch.equal(pool.req_to_token_cpu[rows, pos].long(), batch.out_cache_loc)
    assert not pool.req_to_token[rows, pos].any()


def test_one_copy_path_taken_only_for_an_unchanged_decode_batch() -> None:
    batch = decode_batch(3)
    mwb = batch.get_model_worker_batch()
    writes = mwb.req_to_token_writes
    assert mwb.decode_pack is batch.decode_pack and len(writes) == 1
    assert _graph_decode_from_pack(mwb, graph_runner(), writes)
    assert not _graph_decode_from_pack(mwb, graph_runner(can_run=False), writes)  # eager decode: general path
    assert not _graph_decode_from_pack(mwb, SimpleNamespace(is_cuda=False, cuda_graph_runner=None), writes)
    other = (torch.tensor([0]), torch.tensor([7]), torch.tensor([9]))  # another queued write: general path
    assert not _graph_decode_from_pack(mwb, graph_runner(), [other, *writes])
    assert not _graph_decode_from_pack(mwb, graph_runner(), [])
    # ids in flight resolve through the runner's future map, which the graphs read: another map, general path
    assert _graph_decode_from_pack(mwb, graph_runner(), writes, FUTURE)
    mwb.num_future_refs = 1
    assert _graph_decode_from_pack(mwb, graph_runner(), writes, FUTURE)
    assert not _graph_decode_from_pack(mwb, graph_runner(), writes, FUTURE.clone())


def test_changes_to_the_batch_drop_the_pack() -> None:
    batch = decode_batch(4)
    batch.filter_batch([0, 2])
    assert batch.decode_pack is None and batch.get_model_worker_batch().decode_pack is None
    batch.prepare_for_decode()
    assert batch.decode_pack is not None and batch.decode_pack.shape == (6, 2)
    batch.merge_batch(decode_batch(1))
    assert batch.decode_pack is None


def test_packs_alternate_and_keep_the_step_before() -> None:
    """Two host arrays per batch size, taken in turn: preparing a step leaves the previous step's array (which may
    still be in flight under overlap) as it was, and the columns are the new step's."""
    batch = decode_batch(3)
    first = batch.decode_pack
    before = first.clone()
    for r in batch.reqs:
        r.output_ids.append(7)
    batch.prepare_for_decode()
    second = batch.decode_pack
    assert second.data_ptr() != first.data_ptr() and torch.equal(first, before)
    lens = [len(r.origin_input_ids) + 2 for r in batch.reqs]
    assert batch.input_ids.tolist() == [7, 7, 7] and batch.seq_lens.tolist() == lens
    assert batch.positions.tolist() == [n - 1 for n in lens]
    assert len(set(batch.out_cache_loc.tolist()) | set(before[4, :3].tolist())) == 6  # new slots each step
    for r in batch.reqs:
        r.output_ids.append(8)
    batch.prepare_for_decode()
    assert batch.decode_pack.data_ptr() == first.data_ptr() and batch.input_ids.tolist() == [8, 8, 8]
    assert batch.decode_pack[0, :2].tolist() == [3, 4]
    batch.filter_batch([0, 2])  # another size: its own pair, with its own header
    batch.prepare_for_decode()
    assert batch.decode_pack.shape == (6, 2) and batch.decode_pack[0, :2].tolist() == [2, 2]
