"""MLA's one-launch decode preparation (`mla_prep.py`: q absorption through W_UK, rotary on q_pe and k_pe, the
latent RMSNorm, the key rows into the pool or a tensor) against the torch ops of the unfused path; Triton's
interpreter on the CPU, the GPU when there is one."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.attention.triton_ops import mla_prep
from radixserve.layers.attention.triton_ops.mla_prep import mla_decode_prep
from radixserve.layers.layernorm import RMSNorm
from radixserve.layers.rotary_embedding import RotaryEmbedding

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("neox,into_pool,per_token", [(False, True, False), (True, False, False), (False, True, True),
                                                       (True, False, True)])
def test_mla_prep_matches_the_torch_path(neox: bool, into_pool: bool, per_token: bool,
                                         monkeypatch: pytest.MonkeyPatch) -> None:
    """per_token: the many-token path (absorption as a bmm, a program per token), forced at 3 tokens."""
    if per_token:
        monkeypatch.setattr(mla_prep, "HEAD_PROGRAM_TOKENS", 1)
    t, heads, nope, rope, rank, slots = 3, 2, 16, 8, 40, 10  # rank 40: a partial rank block
    g = torch.Generator().manual_seed(int(neox))
    rot = RotaryEmbedding(rope, 128, 10000.0, is_neox_style=neox)
    norm = RMSNorm(rank, 1e-6)
    norm.weight.data = torch.rand(rank, generator=g) + 0.5
    q = torch.randn(t, heads, nope + rope, generator=g)
    kv_a = torch.randn(t, rank + rope, generator=g) * 2
    w_kc = torch.randn(heads, nope, rank, generator=g) * 0.3
    positions = torch.tensor([0, 17, 127])
    # the unfused path's ops, on the CPU in float32
    q_nope, q_pe = q.split([nope, rope], dim=-1)
    latent, k_pe = kv_a.split([rank, rope], dim=-1)
    latent = norm(latent.contiguous())
    q_pe, k_pe = rot(positions, q_pe.reshape(t, -1), k_pe.contiguous())
    want_q = torch.cat([torch.bmm(q_nope.transpose(0, 1), w_kc).transpose(0, 1), q_pe.reshape(t, heads, rope)], -1)
    want_k = torch.cat([latent, k_pe], dim=-1)
    loc = torch.tensor([7, 2, 9])
    k_out = torch.full((slots if into_pool else t, rank + rope), 5.0, device=DEV)
    got_q = mla_decode_prep(q.to(DEV), kv_a.to(DEV), positions.to(DEV), rot.cos_cache.to(DEV), rot.sin_cache.to(DEV),
                            w_kc.to(DEV), norm.weight.to(DEV), 1e-6, neox, k_out, loc.to(DEV) if into_pool else None,
                            interpreted=DEV == "cpu")
    torch.testing.assert_close(got_q.cpu(), want_q, atol=1e-4, rtol=1e-4)
    got_k = k_out.cpu()[loc] if into_pool else k_out.cpu()
    torch.testing.assert_close(got_k, want_k, atol=1e-5, rtol=1e-5)
    if into_pool:  # no other slot written
        others = torch.ones(slots, dtype=torch.bool)
        others[loc] = False
        assert bool((k_out.cpu()[others] == 5.0).all())
    with pytest.raises(ValueError, match="do not fit"):
        mla_decode_prep(q.to(DEV), kv_a[:, 1:].to(DEV), positions.to(DEV), rot.cos_cache.to(DEV),
                        rot.sin_cache.to(DEV), w_kc.to(DEV), norm.weight.to(DEV), 1e-6, neox, k_out)


@pytest.mark.parametrize("per_token", [False, True])
def test_mla_absorb_out_matches_bmm(per_token: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    from radixserve.layers.attention.triton_ops.mla_prep import mla_absorb_out

    if per_token:
        monkeypatch.setattr(mla_prep, "HEAD_PROGRAM_TOKENS", 1)
    g = torch.Generator().manual_seed(3)
    t, heads, rank, v = 3, 2, 40, 24
    o = torch.randn(t, heads, rank, generator=g)
    w_vc = torch.randn(heads, v + 8, rank, generator=g)[:, :v]  # a strided view, as split from kv_b_proj
    want = torch.bmm(o.transpose(0, 1), w_vc.transpose(1, 2)).transpose(0, 1).reshape(t, heads * v)
    got = mla_absorb_out(o.to(DEV), w_vc.to(DEV), interpreted=DEV == "cpu")
    torch.testing.assert_close(got.cpu(), want, atol=1e-4, rtol=1e-4)
