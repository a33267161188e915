"""The logits processor's shared output rows (`logits_into`, which the decode CUDA graphs capture with): the same
logits as its own tensor, in the buffer's first rows, for the plain, scaled and soft-capped heads."""

from __future__ import annotations

import pytest
import torch

from radixserve.layers.logits_processor import LogitsProcessor, logits_into
from radixserve.layers.vocab_parallel_embedding import ParallelLMHead


def _head(vocab: int, hidden: int, dtype: torch.dtype) -> ParallelLMHead:
    head = ParallelLMHead(vocab, hidden)
    with torch.no_grad():
        head.weight.copy_(torch.randn(vocab, hidden, generator=torch.Generator().manual_seed(1)))
    return head.to(dtype)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("kwargs", [{}, {"logits_scaling": 4.0, "logit_scale": 0.5}, {"final_logit_softcapping": 3.0}])
def test_shared_rows_hold_the_same_logits(dtype: torch.dtype, kwargs: dict) -> None:
    vocab, hidden = 96, 32
    proc, head = LogitsProcessor(vocab, **kwargs), _head(vocab, hidden, dtype)
    x = torch.randn(5, hidden, generator=torch.Generator().manual_seed(2)).to(dtype)
    own = proc._logits(x, head)
    buf = torch.full((8, vocab), float("nan"))
    with logits_into(buf):
        shared = proc._logits(x, head)
    assert own.dtype == shared.dtype == torch.float32
    assert shared.data_ptr() == buf.data_ptr() and shared.shape == (5, vocab)
    torch.testing.assert_close(shared, own, rtol=0, atol=0)
    assert buf[5:].isnan().all()  # rows past the batch untouched
    expect = (x.float() @ head.weight.float().T) if dtype == torch.float32 else (x @ head.weight.T).float()
    expect = expect / kwargs.get("logits_scaling", 1.0) * kwargs.get("logit_scale", 1.0)
    if "final_logit_softcapping" in kwargs:
        cap = kwargs["final_logit_softcapping"]
        expect = torch.tanh(expect / cap) * cap
    torch.testing.assert_close(own, expect, rtol=1e-5, atol=1e-5)


def test_other_shapes_keep_their_own_tensor_and_the_buffer_is_checked() -> None:
    proc, head = LogitsProcessor(96), _head(96, 32, torch.float32)
    x = torch.randn(5, 32)
    for buf in (torch.zeros(4, 96), torch.zeros(8, 64)):  # too few rows; another vocabulary
        with logits_into(buf):
            out = proc._logits(x, head)
        assert out.data_ptr() != buf.data_ptr() and not buf.any()
        torch.testing.assert_close(out, proc._logits(x, head))
    for bad in (torch.zeros(8, 96, dtype=torch.bfloat16), torch.zeros(96)):
        with pytest.raises(ValueError, match="2-D float32"), logits_into(bad):
            pass
