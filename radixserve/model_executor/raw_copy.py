"""`RawHostToDevice`: a pinned host array's asynchronous copy to the device as one driver call.

A decode step sends its batch in one small copy (ScheduleBatch.decode_pack → CudaGraphRunner.pack). For those
100-odd bytes `Tensor.copy_` passes the dispatcher, builds a TensorIterator and records an event for the
pinned-memory allocator; here the copy is `cuMemcpyHtoDAsync` on the current stream, called through ctypes (with
the Triton replay hook skipped too, the replay's host time fell by 8-15 µs on a slow host: docs/perf-log.md,
code 126762e). One thing `copy_` did becomes the caller's: a pinned source must not be freed or rewritten before
the copy has run (pageable memory the driver stages before it returns, as `copy_` does). The decode packs keep
it: a ring of two per batch size (ScheduleBatch._pack), and the graph runner holds the last two it sent. Where the
driver library cannot be loaded, or a call fails (no context current in the calling thread, say), the copy goes
through `copy_`."""

from __future__ import annotations

import ctypes
import logging

import torch

logger = logging.getLogger(__name__)


def _driver_memcpy() -> ctypes._CFuncPtr | None:
    try:
        fn = ctypes.CDLL("libcuda.so.1").cuMemcpyHtoDAsync_v2
    except (OSError, AttributeError):
        return None
    fn.argtypes = [ctypes.c_uint64, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p]
    fn.restype = ctypes.c_int
    return fn


class RawHostToDevice:
    """Copies contiguous host tensors into contiguous views of one device tensor, on the current stream."""

    def __init__(self, dst: torch.Tensor) -> None:
        if dst.device.type != "cuda" or not dst.is_contiguous():
            raise ValueError("RawHostToDevice copies into a contiguous CUDA tensor")
        self.dtype = dst.dtype
        self._device = dst.device.index if dst.device.index is not None else torch.cuda.current_device()
        self._memcpy = _driver_memcpy()
        self._stream = torch._C._cuda_getCurrentRawStream
        if self._memcpy is None:
            logger.info("the CUDA driver library is not loadable here: decode inputs go through Tensor.copy_")

    def __call__(self, src: torch.Tensor, dst_view: torch.Tensor) -> None:
        """dst_view (a contiguous view of dst with src's shape and dtype) ← src, a contiguous host tensor."""
        if self._memcpy is not None and src.dtype == self.dtype and src.is_contiguous() \
                and src.device.type == "cpu" and dst_view.numel() == src.numel():
            nbytes = src.numel() * src.element_size()
            if self._memcpy(dst_view.data_ptr(), src.data_ptr(), nbytes, self._stream(self._device)) == 0:
                return
        dst_view.copy_(src, non_blocking=True)
