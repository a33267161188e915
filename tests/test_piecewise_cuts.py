"""The contract the piecewise CUDA graphs rest on (model_executor/piecewise_graph_runner.py), checked on the CPU for
every model family they may capture: between two attention calls (and before the logits) a model's forward reads
from the ForwardBatch only the per-token inputs the runner keeps in static buffers (ids, positions, KV slots) and
objects that never change (the pools); a field read there, such as the forward mode or the request lengths, would
be baked into the graph at capture. The forward is cut exactly once per attention layer and once at the logits, and
running attention and the logits through the capture's hooks gives the plain forward's logits. (The graphs
themselves need CUDA: tests/gpu/test_piecewise_graph_gpu.py.)"""

from __future__ import annotations

from dataclasses import fields
from typing import Any

import pytest
import torch
from model_utils import make_runner, make_tiny_model

from radixserve.managers.schedule_batch import Req, ScheduleBatch
from radixserve.model_executor import piecewise_graph_runner as pgr
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode
from radixserve.sampling.sampling_params import SamplingParams

# what the pieces may read: the static inputs and the pools
ALLOWED = {"input_ids", "positions", "out_cache_loc", "token_to_kv_pool", "req_to_token_pool"}


class _Recorder:
    """Stands in for a capture: attention and the logits run eagerly, and every ForwardBatch field read between two
    cuts is recorded."""

    def __init__(self) -> None:
        self.in_piece = True
        self.reads: set[str] = set()
        self.cuts = 0

    def attention(self, layer: Any, q: torch.Tensor, k: torch.Tensor | None, v: torch.Tensor | None,
                  forward_batch: ForwardBatch, save_kv_cache: bool) -> torch.Tensor:
        return self.cut(layer, pgr._attention_call(layer, save_kv_cache), (q, k, v), forward_batch)

    def cut(self, owner: object, call: Any, inputs: tuple[torch.Tensor | None, ...],
            forward_batch: ForwardBatch) -> torch.Tensor:
        self.in_piece = False
        pgr._active = None  # as the capture does: attention inside the call runs as outside a capture
        try:
            return call(*inputs, forward_batch)
        finally:
            pgr._active = self
            self.cuts += 1
            self.in_piece = True

    def logits(self, processor: Any, hidden: torch.Tensor, lm_head: Any, forward_batch: ForwardBatch) -> Any:
        self.in_piece = False
        self.cuts += 1
        return processor.compute(hidden, lm_head, forward_batch)


class _Watched(ForwardBatch):
    def __getattribute__(self, name: str) -> Any:
        if not name.startswith("_"):
            rec = object.__getattribute__(self, "_rec")
            if rec.in_piece:
                rec.reads.add(name)
        return object.__getattribute__(self, name)


def _mixed_batch(runner: Any) -> ForwardBatch:
    """Two prompts prefilled and one step decoded, then a third prompt with those two riding along (MIXED)."""
    g = torch.Generator().manual_seed(0)

    def req(rid: str, n: int) -> Req:
        r = Req(rid, torch.randint(3, 250, (n,), generator=g).tolist(),
                SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 8}))
        r.init_next_round_input(None)
        return r

    from radixserve.managers.tp_worker import run_model_worker_batch

    vocab = runner.model_config.vocab_size
    first = ScheduleBatch([req("a", 7), req("b", 12)], runner.req_to_token_pool, runner.token_to_kv_pool, None,
                          runner.device, vocab)
    first.prepare_for_extend()
    for r, t in zip(first.reqs, run_model_worker_batch(runner, first.get_model_worker_batch()).next_token_ids.tolist(),
                    strict=True):
        r.output_ids.append(t)
    mixed = ScheduleBatch([req("c", 9)], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device,
                          vocab)
    mixed.prepare_for_extend()
    mixed.mix_with_running(first)
    return ForwardBatch.init_new(mixed.get_model_worker_batch(), runner)


def _check_pieces(kind: str, runner: Any, fb: ForwardBatch, monkeypatch: pytest.MonkeyPatch) -> None:
    """The plain forward of `fb`, then the same batch through the hooks (the KV writes repeat with the same
    values): one cut a layer and one at the logits, only the static inputs read in the pieces, the same logits."""
    with torch.inference_mode():
        want = runner.model.forward(fb.input_ids, fb.positions, fb).next_token_logits.clone()
        rec = _Recorder()
        watched = _Watched(**{f.name: getattr(fb, f.name) for f in fields(fb)})
        object.__setattr__(watched, "_rec", rec)
        monkeypatch.setattr(pgr, "_active", rec)
        got = runner.model.forward(watched.input_ids, watched.positions, watched).next_token_logits
    assert rec.cuts == runner.model_config.num_hidden_layers + 1
    assert rec.reads <= ALLOWED, f"{kind} reads {sorted(rec.reads - ALLOWED)} between two attention calls"
    torch.testing.assert_close(got, want, rtol=0, atol=0)


@pytest.mark.parametrize("kind", ["llama", "qwen2", "qwen3", "qwen2_moe", "qwen3_moe", "mixtral", "deepseek_v2",
                                  "deepseek_v2_lora", "deepseek_v3"])
def test_pieces_read_only_the_static_inputs(kind: str, tmp_path, monkeypatch) -> None:
    make_tiny_model(kind, str(tmp_path))
    runner = make_runner(str(tmp_path))
    fb = _mixed_batch(runner)
    assert fb.forward_mode == ForwardMode.MIXED and fb.batch_size == 3
    _check_pieces(kind, runner, fb, monkeypatch)


def test_active_capture_is_off_outside_a_capture() -> None:
    assert pgr.active_capture() is None


def _prefix_batch(runner: Any) -> ForwardBatch:
    """A prompt prefilled; then an EXTEND batch of a prompt on its first 8 cached tokens and a fresh prompt."""
    from radixserve.managers.tp_worker import run_model_worker_batch

    g = torch.Generator().manual_seed(1)
    params = SamplingParams.from_dict({"temperature": 0, "max_new_tokens": 8})
    vocab = runner.model_config.vocab_size
    a = Req("a", torch.randint(3, 250, (12,), generator=g).tolist(), params)
    a.init_next_round_input(None)
    first = ScheduleBatch([a], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device, vocab)
    first.prepare_for_extend()
    run_model_worker_batch(runner, first.get_model_worker_batch())
    c = Req("c", a.origin_input_ids[:8] + torch.randint(3, 250, (6,), generator=g).tolist(), params)
    c.init_next_round_input(None)
    c.prefix_indices = runner.req_to_token_pool.req_to_token[a.req_pool_idx, :8].to(torch.int64)
    c.extend_input_len = len(c.fill_ids) - 8
    d = Req("d", torch.randint(3, 250, (9,), generator=g).tolist(), params)
    d.init_next_round_input(None)
    batch = ScheduleBatch([c, d], runner.req_to_token_pool, runner.token_to_kv_pool, None, runner.device, vocab)
    batch.prepare_for_extend()
    return ForwardBatch.init_new(batch.get_model_worker_batch(), runner)


@pytest.mark.parametrize("kind", ["deepseek_v2", "deepseek_v3"])
def test_mla_prefill_on_a_cached_prefix_is_one_cut_a_layer(kind: str, tmp_path, monkeypatch) -> None:
    """DeepSeek's prefill takes the expanded form inside its cut (every request's keys gathered from the pool, the
    cached prefix's among them): the pieces still read only the static inputs, and the logits are the plain
    forward's."""
    from radixserve.models.deepseek_v2 import DeepseekMLAAttention

    make_tiny_model(kind, str(tmp_path))
    runner = make_runner(str(tmp_path))
    fb = _prefix_batch(runner)
    assert fb.forward_mode == ForwardMode.EXTEND and fb.extend_prefix_lens_cpu == [8, 0]
    calls: list[int] = []
    attend = DeepseekMLAAttention._attend_expanded
    monkeypatch.setattr(DeepseekMLAAttention, "_attend_expanded",
                        lambda self, pos, q, kv_a, b: (calls.append(q.shape[0]), attend(self, pos, q, kv_a, b))[1])
    _check_pieces(kind, runner, fb, monkeypatch)
    assert calls == [15] * (2 * runner.model_config.num_hidden_layers)  # both forwards, every layer, expanded
