"""The kernel that loads a decode batch into a CUDA graph's static buffers (`load_graph_inputs`): live rows copied
(int32 or int64 sources), padding rows zeroed with the fill length, rows past the graph's size untouched. Runs under
TRITON_INTERPRET=1 on the CPU (set in conftest), natively on CUDA."""

from __future__ import annotations

import pytest
import torch

from radixserve.model_executor.graph_inputs import load_graph_inputs

DEV = "cuda" if torch.cuda.is_available() else "cpu"


@pytest.mark.parametrize("raw,bs", [(3, 8), (8, 8), (1, 1), (290, 300)])
def test_live_rows_copied_padding_filled(raw: int, bs: int) -> None:
    max_bs = bs + 5
    g = torch.Generator().manual_seed(raw)
    src = tuple(torch.randint(0, 1 << 20, (raw,), generator=g, dtype=dt).to(DEV)
                for dt in (torch.int64, torch.int32, torch.int64, torch.int32, torch.int64))
    dst = tuple(torch.full((max_bs,), -7, dtype=torch.int64, device=DEV) for _ in range(5))
    load_graph_inputs(dst, src, bs, fill=1)
    for i, (d, s) in enumerate(zip(dst, src, strict=True)):
        assert torch.equal(d[:raw].cpu(), s.long().cpu())
        pad = 1 if i == 2 else 0  # seq_lens get the fill value, everything else zero
        assert torch.equal(d[raw:bs].cpu(), torch.full((bs - raw,), pad, dtype=torch.int64))
        assert torch.equal(d[bs:].cpu(), torch.full((max_bs - bs,), -7, dtype=torch.int64))


def test_bad_shapes_raise() -> None:
    src = tuple(torch.zeros(4, dtype=torch.int64, device=DEV) for _ in range(5))
    dst = tuple(torch.zeros(8, dtype=torch.int64, device=DEV) for _ in range(5))
    with pytest.raises(ValueError, match="does not fit"):
        load_graph_inputs(dst, src, 2, fill=1)
    with pytest.raises(ValueError, match="at least 16 rows"):
        load_graph_inputs(dst, src, 16, fill=1)
    with pytest.raises(ValueError, match="one length"):
        load_graph_inputs(dst, (*src[:4], torch.zeros(3, dtype=torch.int64, device=DEV)), 8, fill=1)
    with pytest.raises(ValueError, match="five"):
        load_graph_inputs(dst[:4], src, 8, fill=1)
