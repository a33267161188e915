"""On CUDA: MLA's expanded-form prefill kernel at DeepSeek-V2-Lite's head shape (16 heads, 128 + 64 score dims, 128
value dims) against its torch reference, in float32 and bfloat16, fresh prompts and prompts on a cached prefix, at
the default tiles and at each tile of the benchmark's sweep, and at GLM-4.7-Flash's (192 + 64, 256) at the default
tiles; and the fused MoE kernel's two grid orders equal.
Skipped without a GPU."""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")


def _case(ext: list[int], pre: list[int], dtype: torch.dtype, heads: int = 16, d: int = 128,  # noqa: ANN202
          dv: int = 128):
    g = torch.Generator(device="cuda").manual_seed(sum(ext) + sum(pre))
    r = 64
    kv_lens = [e + p for e, p in zip(ext, pre, strict=True)]
    t, s = sum(ext), sum(kv_lens)
    q = torch.randn(t, heads, d + r, device="cuda", generator=g).to(dtype)
    kv = torch.randn(s, heads, d + dv, device="cuda", generator=g).to(dtype)
    rows = torch.randn(s, 512 + r, device="cuda", generator=g).to(dtype)
    q_start = [sum(ext[:i]) for i in range(len(ext))]
    kv_start = [sum(kv_lens[:i]) for i in range(len(ext))]
    return q, kv[..., :d], kv[..., d:], rows[:, 512:], q_start, kv_start, kv_lens


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("ext,pre", [([1024, 300, 77], [0, 0, 0]), ([200, 1], [900, 2047])])
def test_expanded_kernel_at_deepseek_v2_lite_heads(dtype: torch.dtype, ext: list[int], pre: list[int]) -> None:
    import sys
    from pathlib import Path

    sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "benchmarks"))
    from bench_mla_prefill import TILES

    from radixserve.layers.attention.triton_ops.mla_expanded import mla_expanded_extend, mla_expanded_extend_torch

    q, k_nope, v, k_pe, q_start, kv_start, kv_lens = _case(ext, pre, dtype)
    ref = mla_expanded_extend_torch(q.float(), k_nope.float(), v.float(), k_pe.float(), q_start, kv_start, ext,
                                    kv_lens, 0.07)
    ints = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in (q_start, kv_start, ext, kv_lens)]
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    for tiles in [None] + (TILES if dtype == torch.bfloat16 else []):
        o = torch.full((q.shape[0], 16, 128), float("nan"), device="cuda", dtype=dtype)
        mla_expanded_extend(q, k_nope, v, k_pe, o, *ints, max(ext), 0.07, blocks=tiles)
        torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol, msg=f"tiles {tiles}")


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_expanded_kernel_at_glm_4_7_flash_heads(dtype: torch.dtype) -> None:
    """GLM-4.7-Flash's heads (20 of 192 + 64 score dims, 256 value dims: key part padded to 256) at the default
    tiles (narrower in float32 there: `default_blocks`), fresh prompts and one on a cached prefix."""
    from radixserve.layers.attention.triton_ops.mla_expanded import mla_expanded_extend, mla_expanded_extend_torch

    ext, pre = [700, 77, 300], [0, 0, 900]
    q, k_nope, v, k_pe, q_start, kv_start, kv_lens = _case(ext, pre, dtype, heads=20, d=192, dv=256)
    ref = mla_expanded_extend_torch(q.float(), k_nope.float(), v.float(), k_pe.float(), q_start, kv_start, ext,
                                    kv_lens, 0.0625)
    ints = [torch.tensor(x, dtype=torch.int32, device="cuda") for x in (q_start, kv_start, ext, kv_lens)]
    o = torch.full((q.shape[0], 20, 256), float("nan"), device="cuda", dtype=dtype)
    mla_expanded_extend(q, k_nope, v, k_pe, o, *ints, max(ext), 0.0625)
    tol = 2e-3 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(o.float(), ref, atol=tol, rtol=tol)


@pytest.mark.parametrize("tokens", [64, 3000])
def test_fused_moe_grid_orders_agree(tokens: int) -> None:
    from radixserve.layers.moe.fused_moe import MoEConfig, fused_moe, moe_config

    g = torch.Generator(device="cuda").manual_seed(1)
    e, h, i, k = 64, 2048, 1408, 6
    w13 = torch.randn(e, 2 * i, h, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    w2 = torch.randn(e, h, i, device="cuda", generator=g, dtype=torch.bfloat16) * 0.02
    x = torch.randn(tokens, h, device="cuda", generator=g, dtype=torch.bfloat16)
    ids = torch.rand(tokens, e, device="cuda", generator=g).topk(k, dim=1).indices.to(torch.int32)
    w = torch.rand(tokens, k, device="cuda", generator=g).softmax(dim=1)
    cfg = moe_config(tokens, k, e, i, h)
    outs = [fused_moe(x, w13, w2, w, ids, config=MoEConfig(*[getattr(cfg, f) for f in (
        "block_m", "block_n_gate_up", "block_n_down", "block_k", "num_warps", "num_stages")], n_first=o))
        for o in (True, False)]
    torch.testing.assert_close(outs[0], outs[1], atol=0, rtol=0)
