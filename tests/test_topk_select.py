"""The histogram-threshold top-k (triton_ops/topk_select.py) against torch.topk: exactly k distinct positions per
row, every kept score at least every dropped one (up to the near-ties its 22 key bits cannot tell apart), exact on
integer scores; +inf / -inf entries, rows of several lengths, k equal to the row length. On the CPU the kernels run
under TRITON_INTERPRET=1 (tests/conftest.py); on CUDA, compiled."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.attention.triton_ops.topk_select import threshold_topk

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def check(scores: torch.Tensor, k: int, exact: bool) -> None:
    top = threshold_topk(scores, k)
    assert top.shape == (*scores.shape[:-1], k) and top.dtype == torch.int32
    flat, idx = scores.reshape(-1, scores.shape[-1]).cpu(), top.reshape(-1, k).long().cpu()
    for row, pos in zip(flat, idx, strict=True):
        assert len(set(pos.tolist())) == k and int(pos.min()) >= 0 and int(pos.max()) < row.numel()
        kept = row[pos]
        want = row.topk(k).values
        if exact:
            assert torch.equal(kept.sort().values, want.sort().values)
        else:
            dropped = torch.ones_like(row, dtype=torch.bool)
            dropped[pos] = False
            kth = float(want[-1])
            tol = abs(kth) * 2.0 ** -12 + 1e-30
            assert float(kept.min()) >= kth - tol
            if bool(dropped.any()):
                assert float(row[dropped].max()) <= kth + tol


@pytest.mark.parametrize("rows,n,k", [(3, 5000, 64), (2, 4096, 1024), (1, 300, 300), (4, 2049, 7)])
def test_threshold_topk_random(rows: int, n: int, k: int) -> None:
    gen = torch.Generator().manual_seed(n + k)
    scores = torch.randn(rows, n, generator=gen).to(DEV)
    check(scores, k, exact=False)


def test_threshold_topk_integer_scores_with_ties_and_infinities() -> None:
    gen = torch.Generator().manual_seed(0)
    scores = torch.randint(-20, 20, (2, 3, 3000), generator=gen).float()
    scores[:, :, :4] = float("inf")  # always-kept positions
    scores[0, 1, 2500:] = float("-inf")  # a shorter request's padding
    scores[1, 2, :] = 5.0  # one value everywhere: any k positions
    check(scores.to(DEV), 100, exact=True)


def test_threshold_topk_rejects_bad_input() -> None:
    with pytest.raises(ValueError, match="k must be"):
        threshold_topk(torch.zeros(2, 10, device=DEV), 11)
    with pytest.raises(ValueError, match="float32"):
        threshold_topk(torch.zeros(2, 10, device=DEV, dtype=torch.float16), 3)



def test_threshold_topk_leaves_its_scratch_clean_for_the_next_call() -> None:
    """One scratch for many calls, as the double-sparsity backend keeps it: no memset between calls."""
    from radixserve.layers.attention.triton_ops.topk_select import new_scratch

    gen = torch.Generator().manual_seed(5)
    scratch = new_scratch(6, DEV)
    for n, k in [(3000, 50), (1500, 1500), (5000, 7)]:
        scores = torch.randn(2, 3, n, generator=gen).to(DEV)
        top = threshold_topk(scores, k, scratch=scratch, block=1024)
        assert int(scratch.abs().sum()) == 0
        want = scores.topk(k, dim=-1).values.sort(-1).values
        torch.testing.assert_close(scores.gather(-1, top.long()).sort(-1).values, want, rtol=0, atol=1e-3)
    with pytest.raises(ValueError, match="scratch"):
        threshold_topk(torch.zeros(8, 10, device=DEV), 3, scratch=scratch)
