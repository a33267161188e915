"""On CUDA: the decode pack's driver-call copy (model_executor/raw_copy.py) lands the same bytes as Tensor.copy_,
in stream order, and falls back to copy_ where it cannot be used. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.raw_copy import RawHostToDevice

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def test_copies_pinned_arrays_into_the_prefix_in_stream_order() -> None:
    dst = torch.full((6 * 8,), -7, dtype=torch.int64, device="cuda")
    copy = RawHostToDevice(dst)
    assert copy._memcpy is not None, "libcuda.so.1 should load on a CUDA machine"
    side = torch.cuda.Stream()
    with torch.cuda.stream(side):
        for width in (2, 4, 8, 2):
            src = (torch.arange(6 * width, dtype=torch.int64) + 100 * width).reshape(6, width).pin_memory()
            assert src.is_pinned()
            view = dst[:src.numel()].view(src.shape)
            torch.cuda._sleep(1_000_000)
            view.fill_(-1)  # runs after the sleep; a copy issued on another stream would land first and be lost
            copy(src, view)
            got = view.clone()  # stream-ordered after the copy
            side.synchronize()
            assert torch.equal(got.cpu(), src), width
    assert torch.equal(dst[12:].cpu(), torch.arange(12, 48, dtype=torch.int64) + 800)  # the 8-wide copy's tail
    src = torch.full((6, 2), 5, dtype=torch.int64).pin_memory()
    copy(src, dst[20:32].view(6, 2))  # a view that does not start at dst's first element
    torch.cuda.synchronize()
    assert torch.equal(dst[20:32].cpu(), torch.full((12,), 5, dtype=torch.int64))
    assert torch.equal(dst[12:20].cpu(), torch.arange(12, 20, dtype=torch.int64) + 800)


def test_falls_back_to_copy_for_other_layouts_and_dtypes() -> None:
    dst = torch.zeros(12, dtype=torch.int64, device="cuda")
    copy = RawHostToDevice(dst)
    src = torch.arange(12, dtype=torch.int64).reshape(3, 4).t()  # not contiguous
    copy(src, dst.view(4, 3))
    assert torch.equal(dst.view(4, 3).cpu(), src)
    src32 = torch.arange(6, dtype=torch.int32)  # another dtype: copy_ converts
    copy(src32, dst[:6])
    assert torch.equal(dst[:6].cpu(), src32.long())
    with pytest.raises(ValueError, match="contiguous CUDA tensor"):
        RawHostToDevice(torch.zeros(4, dtype=torch.int64))
