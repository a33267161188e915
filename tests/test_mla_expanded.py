"""MLA prefill in the expanded form (`triton_ops/mla_expanded.py`): the kernel against its torch reference (Triton's
interpreter on the CPU) with prefixes, strided key / value views and uneven lengths; the rule that picks the form;
and a DeepSeek model whose prefills take it, greedy equal to transformers and to the latent form."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from radixserve.layers.attention.triton_ops.mla_expanded import (  # noqa: E402
    expanded_pays,
    mla_expanded_extend,
    mla_expanded_extend_torch,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("ext,pre", [([7, 3, 20], [0, 5, 0]), ([1], [33]), ([16, 17], [16, 0])])
def test_expanded_kernel_matches_reference(ext: list[int], pre: list[int]) -> None:
    g = torch.Generator().manual_seed(len(ext) + sum(pre))
    heads, d, r, dv = 2, 16, 8, 12
    kv_lens = [e + p for e, p in zip(ext, pre, strict=True)]
    t, s = sum(ext), sum(kv_lens)
    q = torch.randn(t, heads, d + r, generator=g).to(DEVICE)
    kv = torch.randn(s, heads, d + dv, generator=g).to(DEVICE)  # k_nope and v as views of one tensor
    rows = torch.randn(s, 24 + r, generator=g).to(DEVICE)  # k_pe as the tail of wider rows (a latent's)
    k_nope, v, k_pe = kv[..., :d], kv[..., d:], rows[:, 24:]
    q_start = [sum(ext[:i]) for i in range(len(ext))]
    kv_start = [sum(kv_lens[:i]) for i in range(len(ext))]
    as_int = [torch.tensor(x, dtype=torch.int32, device=DEVICE) for x in (q_start, kv_start, ext, kv_lens)]
    o = torch.full((t, heads, dv), float("nan"), device=DEVICE)
    mla_expanded_extend(q, k_nope, v, k_pe, o, *as_int, max(ext), 0.3)
    ref = mla_expanded_extend_torch(q, k_nope, v, k_pe, q_start, kv_start, ext, kv_lens, 0.3)
    torch.testing.assert_close(o, ref, atol=1e-5, rtol=1e-5)


def test_expanded_kernel_rejects_mismatched_shapes() -> None:
    q = torch.zeros(3, 2, 24)
    with pytest.raises(ValueError, match="do not fit"):
        mla_expanded_extend(q, torch.zeros(3, 2, 16), torch.zeros(3, 2, 16), torch.zeros(3, 4), torch.zeros(3, 2, 16),
                            *[torch.zeros(1, dtype=torch.int32)] * 4, 3, 1.0)


def test_expanded_form_chosen_for_prefills_not_for_short_extends_on_long_prefixes() -> None:
    shape = dict(heads=16, latent=512, rope=64, nope=128, v_dim=128)  # DeepSeek-V2-Lite
    assert expanded_pays([1024] * 16, [0] * 16, **shape)
    assert expanded_pays([512], [512], **shape)
    assert not expanded_pays([1], [4096], **shape)
    assert not expanded_pays([4] * 8, [2048] * 8, **shape)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_deepseek_prefill_in_expanded_form_matches_transformers(kind: str, tmp_path,
                                                                monkeypatch: pytest.MonkeyPatch) -> None:
    """Greedy through StaticBatch with the expanded prefill (counted) equals transformers' and the latent form's;
    a second prompt on the first's cached rows is not needed here: test_mla_models' scheduler runs cover radix hits
    and chunked prefills on this path."""
    from model_utils import hf_greedy, make_runner, make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.models import deepseek_v2 as ds

    hf = make_tiny_model(kind, str(tmp_path), initializer_range=0.08)
    prompts = [[5, 17, 42, 99, 3, 250, 7], [200, 100, 50, 25, 12, 6, 3, 1, 9, 10, 11, 12, 13]]
    calls = []
    real = ds.DeepseekMLAAttention._attend_expanded

    def counted(self, *a, **k):  # noqa: ANN001, ANN002, ANN003, ANN202
        calls.append(1)
        return real(self, *a, **k)

    monkeypatch.setattr(ds.DeepseekMLAAttention, "_attend_expanded", counted)
    runner = make_runner(str(tmp_path), device=DEVICE, disable_cuda_graph=True)
    expanded = StaticBatch(runner).generate(prompts, 6)
    assert calls, "the prefill did not take the expanded form"
    monkeypatch.setattr(ds, "EXPANDED_PREFILL", False)
    calls.clear()
    latent = StaticBatch(runner).generate(prompts, 6)
    assert not calls
    assert expanded == latent
    for prompt, got in zip(prompts, expanded, strict=True):
        assert got == hf_greedy(hf, prompt, 6)
