"""Attention sinks (GPT-OSS): a learned logit per query head that joins every query's softmax and whose column is
dropped after it. Each backend that supports them (torch_native, cpu, flex, triton: its kernels under
TRITON_INTERPRET=1 on the CPU) against a float32 reference that writes transformers' formula out literally
(concatenate the sink column to the scaled, masked scores, softmax, drop it), through real pools and a
ForwardBatch: extend over a cached prefix plus new tokens, a mixed batch's decode tail, decode through every
split-KV output path, GQA, a sliding window and soft-capping; very negative sinks give the attention without them;
the model runner refuses sinks on a backend without them."""

from __future__ import annotations

from types import SimpleNamespace

import pytest
import torch

pytest.importorskip("triton")

from test_triton_attention import LAYER_ID, make_batch, make_runner  # noqa: E402

from radixserve.layers.attention import create_attention_backend  # noqa: E402
from radixserve.layers.attention.base_attn_backend import sinks  # noqa: E402
from radixserve.layers.attention.triton_backend import TritonAttnBackend  # noqa: E402
from radixserve.layers.attention.triton_ops import decode_attention  # noqa: E402
from radixserve.layers.radix_attention import RadixAttention  # noqa: E402
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

H, HKV, D = 4, 2, 16  # GQA 2
SMALL_SPLITS = {"min_split_len": 16, "decode_block_n": 16, "decode_one_launch": True}
CASES = {  # mode, prefix lengths, extend lengths, sliding window, logit cap
    "extend": (ForwardMode.EXTEND, [0, 5, 21], [9, 1, 14], -1, 0.0),
    "extend-window-cap": (ForwardMode.EXTEND, [3, 18], [12, 7], 6, 2.0),
    "mixed": (ForwardMode.MIXED, [0, 20, 33], [11, 1, 1], -1, 0.0),  # triton: the tail goes to the decode kernel
    "decode": (ForwardMode.DECODE, [2, 19, 40, 70], [1, 1, 1, 1], -1, 0.0),  # (flex: a decode row has 2+ tokens)
    "decode-window-cap": (ForwardMode.DECODE, [5, 30, 61], [1, 1, 1], 12, 2.0),
}


def sink_values(h: int = H, seed: int = 1) -> torch.Tensor:
    """Around the log-sum-exps of these scores (a few units), so that each head keeps a different share."""
    return torch.randn(h, generator=torch.Generator().manual_seed(seed)) * 2.0 + 2.0


def make_layer(window: int, cap: float, values: torch.Tensor | None, h: int = H, hkv: int = HKV,
               d: int = D) -> RadixAttention:
    layer = RadixAttention(h, d, d ** -0.5, hkv, LAYER_ID, sliding_window_size=window, logit_cap=cap,
                           sinks=values is not None)
    if values is not None:
        with torch.no_grad():
            layer.sinks.copy_(values)
    return layer


def reference(q: torch.Tensor, layer: RadixAttention, fb: ForwardBatch, prefix_lens: list[int],
              extend_lens: list[int]) -> torch.Tensor:
    """transformers' eager GPT-OSS attention in float32, one query at a time, over the KV the pool holds:
    softmax(cat([scores * scaling (soft-capped) over the visible keys, sink]))[:-1] @ v."""
    h, hkv, d = layer.tp_q_head_num, layer.tp_k_head_num, layer.head_dim
    k_buf, v_buf = fb.token_to_kv_pool.get_kv_buffer(layer.layer_id)
    table = fb.req_to_token_pool.req_to_token
    queries = q.view(-1, h, d).float().cpu()
    window, cap = layer.sliding_window_size, layer.logit_cap
    outs, t = [], 0
    for row, pre, ext in zip(fb.req_pool_indices.tolist(), prefix_lens, extend_lens, strict=True):
        slots = table[row, :pre + ext].long()
        keys = k_buf[slots].float().cpu().repeat_interleave(h // hkv, dim=1)  # [L, H, D]
        vals = v_buf[slots].float().cpu().repeat_interleave(h // hkv, dim=1)
        for j in range(ext):
            pos = pre + j
            lo = max(0, pos - window + 1) if window > 0 else 0
            scores = torch.einsum("hd,nhd->hn", queries[t], keys[lo:pos + 1]) * layer.scaling
            if cap > 0:
                scores = cap * torch.tanh(scores / cap)
            if layer.sinks is not None:
                combined = torch.cat([scores, layer.sinks.detach().float().cpu()[:, None]], dim=-1)
                probs = torch.softmax(combined, dim=-1)[:, :-1]
            else:
                probs = torch.softmax(scores, dim=-1)
            outs.append(torch.einsum("hn,nhd->hd", probs, vals[lo:pos + 1]))
            t += 1
    return torch.stack(outs).reshape(-1, h * d)


def run(name: str, case: str, values: torch.Tensor | None, tune: dict | None = None, seed: int = 0,
        h: int = H, hkv: int = HKV) -> tuple[torch.Tensor, torch.Tensor]:
    """(the backend's output, the reference's) for one batch of CASES[case] on a fresh pool."""
    mode, prefix_lens, extend_lens, window, cap = CASES[case]
    gen = torch.Generator().manual_seed(seed)
    runner = make_runner(h, hkv, D, torch.float32)
    if name == "flex":  # eager flex multiplies every slot's V by its (zero) weight: no NaN in the pool
        for buf in runner.token_to_kv_pool.k_buffer + runner.token_to_kv_pool.v_buffer:
            buf.zero_()
    backend = create_attention_backend(name, runner)
    assert backend.supports_sinks
    for attr, value in (tune or {}).items():
        setattr(backend, attr, value)
    layer = make_layer(window, cap, values, h, hkv)
    fb, q, k, v = make_batch(runner, backend, prefix_lens, extend_lens, mode, gen)
    if name == "flex":  # flex reads which position each slot holds (its prefill would have recorded them)
        fb.positions = torch.cat([torch.arange(p, p + e) for p, e in zip(prefix_lens, extend_lens, strict=True)])
        for row, pre in zip(fb.req_pool_indices.tolist(), prefix_lens, strict=True):
            backend.slot_pos[fb.req_to_token_pool.req_to_token[row, :pre].long()] = torch.arange(pre)
    backend.init_forward_metadata(fb)
    out = backend.forward(q, k, v, layer, fb)
    assert out.dtype == q.dtype
    return out.cpu(), reference(q, layer, fb, prefix_lens, extend_lens)


BACKENDS = ["torch_native", "cpu", "flex", "triton"]


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("name", BACKENDS)
def test_backend_matches_the_literal_sink_softmax(name: str, case: str) -> None:
    tune = SMALL_SPLITS if name == "triton" else None
    out, ref = run(name, case, sink_values(), tune)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


@pytest.mark.parametrize("name", BACKENDS)
def test_very_negative_sinks_are_no_sinks_and_real_ones_change_the_output(name: str) -> None:
    """A sink of -1e4 takes no probability: the output of the layer without sinks. The sinks above take a visible
    share (so the comparisons above could fail)."""
    tune = SMALL_SPLITS if name == "triton" else None
    for case in ("extend", "decode"):
        plain, plain_ref = run(name, case, None, tune)
        off, _ = run(name, case, torch.full((H,), -1e4), tune)
        torch.testing.assert_close(plain, plain_ref, rtol=1e-4, atol=1e-4)
        torch.testing.assert_close(off, plain, rtol=1e-5, atol=1e-5)
        with_sinks, _ = run(name, case, sink_values(), tune)
        assert (with_sinks - plain).abs().max() > 0.05


@pytest.mark.parametrize("case,tune,heads", [
    ("decode", {**SMALL_SPLITS, "decode_one_launch": False}, (H, HKV)),  # stage 2 merges the splits
    ("decode", {**SMALL_SPLITS, "num_sms": 1, "programs_per_sm": 1}, (H, HKV)),  # one split: stage 1 writes
    ("decode", {**SMALL_SPLITS, "decode_use_dot": False}, (2, 2)),  # MHA, elementwise products
    ("decode-window-cap", {**SMALL_SPLITS, "decode_one_launch": False}, (H, HKV)),
    ("mixed", {**SMALL_SPLITS, "num_sms": 1, "programs_per_sm": 1}, (H, HKV)),
], ids=["stage2", "one-split", "elementwise", "stage2-window-cap", "mixed-one-split"])
def test_triton_decode_output_paths(case: str, tune: dict, heads: tuple[int, int]) -> None:
    """Every place the split-KV decode writes an output adds the sink once: the one-launch merge (above), stage 2,
    stage 1 alone with one split, the elementwise path."""
    h, hkv = heads
    out, ref = run("triton", case, sink_values(h), tune, h=h, hkv=hkv)
    torch.testing.assert_close(out, ref, rtol=1e-4, atol=1e-4)


def test_triton_replayed_launches_read_each_layers_sinks() -> None:
    """A later layer of a batch replays the first layer's recorded launches (extend kernel and the decode tail's)
    with its own tensors, its sinks among them; a layer without sinks records its own plan."""
    mode, prefix_lens, extend_lens, window, cap = CASES["mixed"]
    gen = torch.Generator().manual_seed(4)
    runner = make_runner(H, HKV, D, torch.float32)
    backend = TritonAttnBackend(runner)
    for attr, value in SMALL_SPLITS.items():
        setattr(backend, attr, value)
    fb, q, k, v = make_batch(runner, backend, prefix_lens, extend_lens, mode, gen)
    backend.init_forward_metadata(fb)
    for i, values in enumerate((sink_values(seed=1), sink_values(seed=2), None)):
        layer = make_layer(window, cap, values)
        qi = q * (1.0 + 0.5 * i)  # another query per layer; the same K/V (the pool is layer 1's for all three)
        out = backend.forward(qi, k, v, layer, fb)
        torch.testing.assert_close(out, reference(qi, layer, fb, prefix_lens, extend_lens), rtol=1e-4, atol=1e-4)
    assert len(backend.forward_metadata.plans) == 2  # the two layers with sinks share one


def test_sinks_parameter_stays_float32_and_is_checked() -> None:
    old = torch.get_default_dtype()
    torch.set_default_dtype(torch.bfloat16)  # as the model loader builds a bf16 model
    try:
        layer = RadixAttention(6, 16, 0.25, 2, 0, sinks=True)
        plain = RadixAttention(6, 16, 0.25, 2, 0)
    finally:
        torch.set_default_dtype(old)
    assert isinstance(layer.sinks, torch.nn.Parameter) and layer.sinks.dtype == torch.float32
    assert layer.sinks.shape == (6,) and not layer.sinks.any()
    assert "sinks" in dict(layer.named_parameters())  # a checkpoint's sinks load by name
    assert sinks(layer) is layer.sinks and sinks(plain) is None and plain.sinks is None
    assert sinks(SimpleNamespace(sinks=torch.zeros(3, dtype=torch.bfloat16))).dtype == torch.float32
    q = torch.zeros(1, 6, 16)
    o = torch.zeros(1, 6, 16)
    mid_o, mid_lse = torch.zeros(1, 6, 16, 16), torch.zeros(1, 6, 16)
    idx = torch.zeros(1, dtype=torch.int64)
    kb = torch.zeros(4, 2, 16)
    for bad in (torch.zeros(6, dtype=torch.bfloat16), torch.zeros(5), torch.zeros(12)[::2]):
        with pytest.raises(ValueError, match="sinks"):
            decode_attention.decode_attention_fwd(q, kb, kb, o, torch.zeros(1, 4, dtype=torch.int32), idx, idx + 1,
                                                  mid_o, mid_lse, 1.0, sinks=bad)


def test_backends_without_sinks_say_so() -> None:
    from radixserve.layers.attention.double_sparsity_backend import DoubleSparseAttnBackend

    assert not DoubleSparseAttnBackend.supports_sinks


def test_model_runner_refuses_sinks_on_a_backend_without_them(tmp_path, monkeypatch) -> None:  # noqa: ANN001
    """A model whose attention has sinks, on a backend that does not set supports_sinks (flashinfer, double
    sparsity; here torch_native with its flag off), is refused at load, naming the backends that take them."""
    from model_utils import make_runner as make_model_runner
    from model_utils import make_tiny_model

    from radixserve.layers import radix_attention
    from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend

    make_tiny_model("llama", str(tmp_path), num_hidden_layers=1)
    original = radix_attention.RadixAttention.__init__

    def with_sinks(self, *args, **kwargs) -> None:  # noqa: ANN001, ANN002, ANN003
        original(self, *args, **{**kwargs, "sinks": True})

    monkeypatch.setattr(radix_attention.RadixAttention, "__init__", with_sinks)
    monkeypatch.setattr(TorchNativeAttnBackend, "supports_sinks", False)
    with pytest.raises(ValueError, match="attention sinks .* torch_native attention backend .* triton, torch_native, "
                                         "flex or \\(on the CPU\\) cpu"):
        make_model_runner(str(tmp_path), attention_backend="torch_native", load_format="dummy")
