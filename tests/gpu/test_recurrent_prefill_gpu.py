"""The recurrent layers' prefill kernels on CUDA at the real models' head sizes against their torch forms: the Mamba2
scan (`triton_ops/ssd_scan.py`, Nemotron-H's 64 x 128 heads in groups of 16) in TF32 and TF32x3, the gated delta
rule's chunk walk (`triton_ops/delta_chunks.py`, Qwen3.5's 128 x 128 heads). Sequences of unequal lengths, several
chunks and a partial last one. Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.linear_attention import delta_rule_chunked, l2_normalize
from radixserve.layers.mamba2 import ssd_chunked
from radixserve.layers.triton_ops import set_fused_kernels
from radixserve.layers.triton_ops.ssd_scan import ssd_scan

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got - want).abs().max() / want.abs().max())


@pytest.mark.parametrize("exact,tol", [(False, 3e-3), (True, 2e-5)], ids=["tf32", "tf32x3"])
def test_ssd_scan_at_nemotron_h_shape(exact: bool, tol: float) -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    seqs, length, heads, p, groups, n = 3, 300, 32, 64, 2, 128
    x = torch.randn(seqs, length, heads, p, generator=g, device="cuda").bfloat16().float()
    b = torch.randn(seqs, length, groups, n, generator=g, device="cuda").bfloat16().float()
    c = torch.randn(seqs, length, groups, n, generator=g, device="cuda").bfloat16().float()
    lens = torch.tensor([300, 129, 1], device="cuda")
    real = torch.arange(length, device="cuda")[None, :] < lens[:, None]
    dt = torch.rand(seqs, length, heads, generator=g, device="cuda") * 0.1 * real[..., None]
    a = -torch.rand(heads, generator=g, device="cuda") * 4
    s0 = torch.randn(seqs, heads, p, n, generator=g, device="cuda") * 0.1
    want, want_state = ssd_chunked(s0.clone(), x, dt, a, b, c)
    state = s0.clone()
    got = ssd_scan(state, x, dt, a, b, c, lens, exact=exact)
    assert _rel(got[real], want[real]) < tol
    assert _rel(state, want_state) < tol
    assert not got[~real].any()


def test_delta_chunks_at_qwen35_shape() -> None:
    g = torch.Generator(device="cuda").manual_seed(0)
    seqs, length, dk, dv = 8, 200, 128, 128
    q = l2_normalize(torch.randn(seqs, length, dk, generator=g, device="cuda")) * dk ** -0.5
    k = l2_normalize(torch.randn(seqs, length, dk, generator=g, device="cuda"))
    v = torch.randn(seqs, length, dv, generator=g, device="cuda")
    gate = -torch.rand(seqs, length, generator=g, device="cuda") * 0.1
    beta = torch.rand(seqs, length, generator=g, device="cuda")
    s0 = torch.randn(seqs, dk, dv, generator=g, device="cuda") * 0.1
    set_fused_kernels(False)
    try:
        want, want_state = delta_rule_chunked(s0, q, k, v, gate, beta)
    finally:
        set_fused_kernels(None)
    got, state = delta_rule_chunked(s0, q, k, v, gate, beta)  # CUDA tensors: the kernel
    assert _rel(got, want) < 2e-5
    assert _rel(state, want_state) < 2e-5
