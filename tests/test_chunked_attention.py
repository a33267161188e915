"""Chunked local attention (Llama 4's rope layers): a query at position p sees only the keys of its own chunk of C
positions, (p // C) * C .. p. Each backend that supports it (torch_native, cpu, flex, triton: its kernels under
TRITON_INTERPRET=1 on the CPU) against a float32 reference written out one query at a time, through real pools and
a ForwardBatch: extends whose prefixes and new tokens cross chunk boundaries, a mixed batch's decode tail, decode
through every split-KV output path, GQA; chunks change the output (the comparisons could fail); the backends
without it (flashinfer, double sparsity) are refused by the model runner; the layer and the kernels check the size."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from test_triton_attention import LAYER_ID, make_batch, make_runner  # noqa: E402

from radixserve.layers.attention import create_attention_backend  # noqa: E402
from radixserve.layers.attention.base_attn_backend import first_key, local_window  # noqa: E402
from radixserve.layers.attention.triton_ops.common import kernel_window  # noqa: E402
from radixserve.layers.radix_attention import RadixAttention  # noqa: E402
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402
from radixserve.model_executor.model_runner import check_attention_features  # noqa: E402

H, HKV, D = 4, 2, 16  # GQA 2
SMALL_SPLITS = {"min_split_len": 16, "decode_block_n": 16, "decode_one_launch": True}
CASES = {  # mode, prefix lengths, extend lengths, chunk
    # new tokens that start mid-chunk, one that starts on a boundary (16), one crossing two boundaries
    "extend": (ForwardMode.EXTEND, [0, 5, 16, 21], [19, 1, 9, 30], 8),
    "extend-long-chunk": (ForwardMode.EXTEND, [0, 40], [70, 33], 48),  # chunks wider than a kernel block
    "mixed": (ForwardMode.MIXED, [0, 20, 33], [11, 1, 1], 8),  # triton: the tail goes to the decode kernel
    "decode": (ForwardMode.DECODE, [2, 15, 16, 40, 70], [1, 1, 1, 1, 1], 16),  # 16: the new token opens a chunk
    "decode-wide": (ForwardMode.DECODE, [30, 61, 95], [1, 1, 1], 40),
}


def reference(q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch, prefix_lens: list[int],
              extend_lens: list[int]) -> torch.Tensor:
    """softmax(q.k * scaling over the keys (p // C) * C .. p) @ v in float32, one query at a time, over the pool."""
    h, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    table = fb.req_to_token_pool.req_to_token
    queries = q.view(-1, h, d).float().cpu()
    chunk = layer.attention_chunk_size
    outs, t = [], 0
    for row, pre, ext in zip(fb.req_pool_indices.tolist(), prefix_lens, extend_lens, strict=True):
        slots = table[row, :pre + ext].long()
        keys = k_buf[slots].float().cpu().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        vals = v_buf[slots].float().cpu().repeat_interleave(h // hkv, dim=1)
        for j in range(ext):
            pos = pre + j
            lo = pos // chunk * chunk if chunk > 0 else 0
            probs = torch.softmax(torch.einsum("hd,nhd->hn", queries[t], keys[lo:pos + 1]) * layer.scaling, dim=-1)
            outs.append(torch.einsum("hn,nhd->hd", probs, vals[lo:pos + 1]))
            t += 1
    return torch.stack(outs).reshape(-1, h * d)


def run(name: str, case: str, chunked: bool = True, tune: dict | None = None, seed: int = 0, h: int = H,
        hkv: int = HKV) -> tuple[torch.Tensor, torch.Tensor]:
    """(the backend's output, the reference's) for one batch of CASES[case] on a fresh pool."""
    mode, prefix_lens, extend_lens, chunk = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    runner = make_runner(h, hkv, D, torch.float32)
    if name == "flex":  # eager flex multiplies every slot's V by its (zero) weight: no NaN in the pool
        for buf in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer:
            buf.zero_()
    backend = create_attention_backend(name, runner)
    assert backend.supports_chunked_attention
    for attr, value in (tune or {}).items():
        setattr(backend, attr, value)
    layer = RadixAttention(h, D, D ** -0.5, hkv, LAYER_ID, attention_chunk_size=chunk if chunked else -1)
    fb, q, k, v = make_batch(runner, backend, prefix_lens, extend_lens, mode, gen)
    if name == "flex":  # flex reads which position each slot holds (its prefill would have recorded them)
        fb.positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens, strict=True)])
        for row, pre in zip(fb.req_pool_indices.tolist(), prefix_lens, strict=True):
            backend.slot_pos[fb.req_to_token_pool.req_to_token[row, :pre].long()] = torch.arange(pre)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)
    return out.cpu(), reference(q, layer, fb, prefix_lens, extend_lens)


BACKENDS = ["torch_native", "cpu", "flex", "triton"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_the_chunked_reference(name: str, case: str) -> None:
    out, ref = run(name, case, tune=SMALL_SPLITS if name == "triton" else None)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", BACKENDS)
def test_chunks_change_the_output(name: str) -> None:
    """The same batch with full attention differs from the chunked one (so the cases above could fail)."""
    tune = SMALL_SPLITS if name == "triton" else None
    for case in ("extend", "decode"):
        chunked, _ = run(name, case, True, tune)
        full, full_ref = run(name, case, False, tune)
        torch.testing.assert_close(full, full_ref, rtol=1e-4, atol=1e-4)
        assert (chunked - full).abs().max() > 0.05


@pytest.mark.parametrize("case,tune,heads", [
    ("decode", {**SMALL_SPLITS, "decode_one_launch": False}, (H, HKV)),  # stage 2 merges the splits
    ("decode", {**SMALL_SPLITS, "num_sms": 1, "programs_per_sm": 1}, (H, HKV)),  # one split: stage 1 writes
    ("decode-wide", {**SMALL_SPLITS, "decode_use_dot": False}, (2, 2)),  # MHA, elementwise products
    ("mixed", {**SMALL_SPLITS, "decode_one_launch": False}, (H, HKV)),
], ids=["stage2", "one-split", "elementwise", "mixed-stage2"])
def test_triton_decode_output_paths(case: str, tune: dict, heads: tuple[int, int]) -> None:
    """Stage 1 and stage 2 cut the chunk's keys into the same splits, whichever path writes the output."""
    h, hkv = heads
    out, ref = run("triton", case, tune=tune, h=h, hkv=hkv)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_window_encoding_and_checks() -> None:
    """One `window` number carries a sliding window (W), chunks (-C) or neither (0) to the kernels and masks."""
    chunked = RadixAttention(4, 16, 0.25, 2, 0, attention_chunk_size=8)
    sliding = RadixAttention(4, 16, 0.25, 2, 0, sliding_window_size=8)
    assert local_window(chunked) == -8 and local_window(sliding) == 8
    assert local_window(RadixAttention(4, 16, 0.25, 2, 0)) == 0 and local_window(SimpleNamespace()) == 0
    assert [first_key(p, -8) for p in (0, 7, 8, 17)] == [0, 0, 8, 16]
    assert [first_key(p, 8) for p in (0, 7, 8, 17)] == [-7, 0, 1, 10]
    assert first_key(torch.tensor([5, 23]), -8).tolist() == [0, 16] and first_key(9, 0) == 0
    assert kernel_window(-1, 8) == -8 and kernel_window(8, -1) == 8 and kernel_window(-1, -1) == 0
    for bad in ({"attention_chunk_size": 0}, {"attention_chunk_size": -3},
                {"attention_chunk_size": 8, "sliding_window_size": 4}):
        with pytest.raises(ValueError, match="chunk"):
            RadixAttention(4, 16, 0.25, 2, 0, **bad)
    with pytest.raises(ValueError, match="attention_chunk"):
        kernel_window(-1, 0)
    with pytest.raises(ValueError, match="cannot both"):
        kernel_window(4, 8)


def test_model_runner_refuses_chunks_on_a_backend_without_them() -> None:
    """Double sparsity (and flashinfer, which needs CUDA to import) does not take chunked layers: a model with them
    is refused there, naming the backends that do; a model without them is not."""
    from radixserve.layers.attention.double_sparsity_backend import DoubleSparseAttnBackend

    model = torch.nn.ModuleList([RadixAttention(4, 16, 0.25, 2, 0, attention_chunk_size=8)])
    assert not DoubleSparseAttnBackend.supports_chunked_attention
    with pytest.raises(ValueError, match="attention_chunk_size.*use triton, torch_native, flex"):
        check_attention_features(model, DoubleSparseAttnBackend, "double_sparsity")
    check_attention_features(torch.nn.ModuleList([RadixAttention(4, 16, 0.25, 2, 0)]), DoubleSparseAttnBackend, "x")
