"""The Mamba2 prefill scan's Triton kernel (`triton_ops/ssd_scan.py`, under TRITON_INTERPRET=1 on the CPU) against
the torch chunked form (`mamba2.ssd_chunked`), and the layer's extend with it against the layer's torch extend."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.mamba2 import ssd_chunked
from radixserve.layers.triton_ops import set_fused_kernels
from radixserve.layers.triton_ops.ssd_scan import ssd_scan


def _inputs(seqs: int, length: int, heads: int, groups: int, p: int, n: int, seed: int = 0) -> tuple:
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(seqs, length, heads, p, generator=gen)
    b, c = torch.randn(seqs, length, groups, n, generator=gen), torch.randn(seqs, length, groups, n, generator=gen)
    dt, a = torch.rand(seqs, length, heads, generator=gen) * 0.5, -torch.rand(heads, generator=gen) * 2
    return torch.randn(seqs, heads, p, n, generator=gen), x, dt, a, b, c


@pytest.mark.parametrize("shape", [(3, 150, 4, 2, 16, 16), (2, 70, 6, 3, 24, 20), (1, 64, 2, 1, 8, 32)],
                         ids=["pow2", "masked-p-n", "one-chunk"])
@pytest.mark.parametrize("config", [None, (16, 16, 4, 1), (64, 64, 8, 3)], ids=["default", "small", "large"])
def test_scan_equals_the_torch_chunked_form(shape: tuple, config: tuple | None) -> None:
    seqs, length, heads, groups, p, n = shape
    s0, x, dt, a, b, c = _inputs(*shape)
    lens = torch.tensor([length, max(1, length // 2), 1][:seqs])
    dt = dt * (torch.arange(length)[None, :] < lens[:, None])[..., None]  # the torch form's padding: dt = 0
    want, want_state = ssd_chunked(s0.clone(), x, dt, a, b, c)
    state = s0.clone()
    got = ssd_scan(state, x, dt, a, b, c, lens, config=config)
    real = torch.arange(length)[None, :] < lens[:, None]
    torch.testing.assert_close(got[real], want[real], atol=2e-4, rtol=2e-4)
    assert not got[~real].any()  # past a length nothing is written
    torch.testing.assert_close(state, want_state, atol=2e-4, rtol=2e-4)


def test_scan_takes_strided_inputs_and_skips_padding_chunks() -> None:
    """x / B / C as the layer passes them (channel slices of a [S, T, C] tensor stored time-major), and padding
    whose dt is not zero: the kernel goes by `lens` only."""
    seqs, length, heads, groups, p, n = 2, 100, 4, 2, 16, 16
    s0, x, dt, a, b, c = _inputs(seqs, length, heads, groups, p, n, seed=1)
    lens = torch.tensor([100, 30])
    conv = torch.cat([x.flatten(2), b.flatten(2), c.flatten(2)], dim=-1).transpose(1, 2).contiguous().transpose(1, 2)
    xs, bs, cs = conv.split([heads * p, groups * n, groups * n], dim=-1)
    xs, bs, cs = xs.reshape(seqs, length, heads, p), bs.reshape(seqs, length, groups, n), \
        cs.reshape(seqs, length, groups, n)
    assert not xs.is_contiguous()
    state = s0.clone()
    got = ssd_scan(state, xs, dt, a, bs, cs, lens)
    padded = dt * (torch.arange(length)[None, :] < lens[:, None])[..., None]
    want, want_state = ssd_chunked(s0.clone(), x, padded, a, b, c)
    torch.testing.assert_close(got[1, :30], want[1, :30], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got[0], want[0], atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(state, want_state, atol=2e-4, rtol=2e-4)


def test_scan_rejects_what_it_cannot_run() -> None:
    s0, x, dt, a, b, c = _inputs(1, 8, 2, 1, 8, 8)
    with pytest.raises(ValueError, match="float32"):
        ssd_scan(s0, x.double(), dt, a, b, c, torch.tensor([8]))
    with pytest.raises(ValueError, match="state"):
        ssd_scan(s0[:, :1], x, dt, a, b, c, torch.tensor([8]))
    with pytest.raises(ValueError, match="groups"):
        ssd_scan(s0, x, dt, a, b[:, :, :1].expand(1, 8, 3, 8), c[:, :, :1].expand(1, 8, 3, 8), torch.tensor([8]))


def test_the_layer_extend_with_the_kernel_equals_its_torch_extend() -> None:
    """Mamba2Mixer's extend of a fresh request, a continuing one and a checkpoint cut (so padded groups of pieces)
    with the kernels on equals it with them off: outputs, states and the snapshot row."""
    from test_granite_hybrid import _extend_batch, random_mixer

    lens, prefixes, rows = [9, 70, 33], [0, 3, 0], [1, 2, 0]
    hidden = torch.randn(sum(lens), 64, generator=torch.Generator().manual_seed(2))
    results = []
    for fused in (False, True):
        mixer = random_mixer(slots=5)
        mixer.states.ssm.normal_(generator=torch.Generator().manual_seed(3))
        mixer.states.conv.normal_(generator=torch.Generator().manual_seed(4))
        set_fused_kernels(fused)
        try:
            out = mixer(hidden, _extend_batch(lens, prefixes, rows, cuts=[(1, 40, 3)]))
        finally:
            set_fused_kernels(None)
        results.append((out, mixer.states.ssm.clone(), mixer.states.conv.clone()))
    (want, want_ssm, want_conv), (got, got_ssm, got_conv) = results
    torch.testing.assert_close(got, want, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_ssm, want_ssm, atol=2e-4, rtol=2e-4)
    torch.testing.assert_close(got_conv, want_conv)
    assert got_ssm[3].abs().sum() > 0  # the snapshot was written
