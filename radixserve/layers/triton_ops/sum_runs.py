"""In-thread partial sums for the decode GEMVs' accumulators."""

import triton
import triton.language as tl


@triton.jit
def sum_runs8(p):
    """The sums of a [rows, cols] tile's runs of 8 columns, [rows, cols / 8]. In the GEMVs' layout (8 contiguous
    columns a thread) each run is one thread's, so nothing is exchanged; an accumulator of these sums holds 8 times
    fewer registers than one of the products, which leaves room for larger tiles and more programs a SM."""
    return tl.sum(tl.reshape(p, (p.shape[0], p.shape[1] // 8, 8)), axis=2)
