"""On CUDA with flashinfer installed: the flashinfer backend against torch_native through real pools (page sizes 1
and 16, cached prefixes, GQA, sliding window), its CUDA-graph hooks against its eager path, and greedy decoding of a
model against the triton backend. bf16 (FlashInfer has no float32 kernels), head_dim 128. Skipped otherwise."""

from __future__ import annotations

import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
flashinfer = pytest.importorskip("flashinfer")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from radixserve.layers.attention.flashinfer_backend import (  # noqa: E402
    TENSOR_CORES_ENV,
    FlashInferAttnBackend,
    decode_on_tensor_cores,
)
from radixserve.layers.attention.torch_native_backend import TorchNativeAttnBackend  # noqa: E402
from radixserve.mem_cache.memory_pool import ReqToTokenPool, TokenToKVPool  # noqa: E402
from radixserve.model_executor.forward_batch_info import ForwardBatch, ForwardMode  # noqa: E402

DEV, D, DT = "cuda", 128, torch.bfloat16


def setup(heads: int, kv_heads: int, page: int, window: int = -1) -> tuple[SimpleNamespace, SimpleNamespace]:
    cfg = SimpleNamespace(num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=D, num_hidden_layers=1)
    pool = TokenToKVPool(4096, DT, kv_heads, D, num_layers=1, device=DEV, page_size=page)
    runner = SimpleNamespace(device=DEV, model_config=cfg, tp_size=1, dtype=DT, token_to_kv_pool=pool,
                             req_to_token_pool=ReqToTokenPool(8, 1024, DEV))
    layer = SimpleNamespace(tp_q_head_num=heads, tp_k_head_num=kv_heads, tp_v_head_num=kv_heads, head_dim=D,
                            scaling=D ** -0.5, layer_id=0, sliding_window_size=window, k_scale=1.0, v_scale=1.0)
    return runner, layer


def batch(runner: SimpleNamespace, backend: object, prefix: list[int], new: list[int], mode: ForwardMode,
          gen: torch.Generator) -> tuple[ForwardBatch, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Requests on whole pages (position i of a request in page i // P of its own), prefix KV random."""
    pool, r2t = runner.token_to_kv_pool, runner.req_to_token_pool
    p, hkv, h = pool.page_size, runner.model_config.num_key_value_heads, runner.model_config.num_attention_heads
    rows = r2t.alloc(len(prefix))
    k_buf, v_buf = pool.get_kv_buffer(0)
    out = []
    for row, pre, n in zip(rows, prefix, new, strict=True):
        pages = pool.alloc(pre + n)  # page-aligned slots of this request
        r2t.write(row, 0, pages)
        k_buf[pages[:pre].to(DEV)] = torch.randn(pre, hkv, D, generator=gen).to(DEV, DT)
        v_buf[pages[:pre].to(DEV)] = torch.randn(pre, hkv, D, generator=gen).to(DEV, DT)
        out.append(pages[pre:])
        assert p == 1 or bool((pages[::p] % p == 0).all())
    r2t.apply_writes(r2t.take_pending_writes())
    t = sum(new)
    q, k, v = (torch.randn(t, x * D, generator=gen).to(DEV, DT) for x in (h, hkv, hkv))
    lens = [a + b for a, b in zip(prefix, new, strict=True)]
    fb = ForwardBatch(forward_mode=mode, batch_size=len(lens), input_ids=torch.zeros(t, dtype=torch.int64, device=DEV),
                      req_pool_indices=torch.tensor(rows, device=DEV), seq_lens=torch.tensor(lens, device=DEV),
                      out_cache_loc=torch.cat(out).to(DEV), seq_lens_sum=sum(lens), positions=None,
                      req_to_token_pool=r2t, token_to_kv_pool=pool, attn_backend=backend,
                      seq_lens_cpu=lens)  # type: ignore[arg-type]
    if mode.is_extend():
        fb.extend_seq_lens_cpu, fb.extend_prefix_lens_cpu = list(new), list(prefix)
        fb.extend_seq_lens = torch.tensor(new, device=DEV)
        fb.extend_prefix_lens = torch.tensor(prefix, device=DEV)
        fb.extend_start_loc = torch.tensor([sum(new[:i]) for i in range(len(new))], device=DEV)
    return fb, q, k, v


def test_decode_kernel_rule(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(TENSOR_CORES_ENV, raising=False)
    assert decode_on_tensor_cores(32, 8, torch.bfloat16)  # Llama-3.1-8B: 4 query heads a KV head
    assert not decode_on_tensor_cores(32, 16, torch.bfloat16)
    assert not decode_on_tensor_cores(8, 8, torch.bfloat16)
    assert decode_on_tensor_cores(8, 8, torch.float8_e4m3fn)
    monkeypatch.setenv(TENSOR_CORES_ENV, "1")
    assert decode_on_tensor_cores(32, 8, torch.bfloat16)
    monkeypatch.setenv(TENSOR_CORES_ENV, "yes")
    with pytest.raises(ValueError, match=TENSOR_CORES_ENV):
        decode_on_tensor_cores(32, 8, torch.bfloat16)


def test_pdl_setting_changes_no_value(monkeypatch: pytest.MonkeyPatch) -> None:
    """RADIXSERVE_FLASHINFER_PDL=0 / 1 only changes how FlashInfer's kernels are launched: the same outputs, bit
    for bit, as FlashInfer's default; another value is refused."""
    outs = []
    for pdl in ("", "0", "1"):
        monkeypatch.setenv("RADIXSERVE_FLASHINFER_PDL", pdl)
        gen = torch.Generator().manual_seed(5)
        runner, layer = setup(8, 2, 16)
        backend = FlashInferAttnBackend(runner)
        fb, q, k, v = batch(runner, backend, [0, 15, 16, 300], [1, 1, 1, 1], ForwardMode.DECODE, gen)
        backend.init_forward_metadata(fb)
        outs.append(backend.forward(q, k, v, layer, fb))
    assert torch.equal(outs[0], outs[1]) and torch.equal(outs[0], outs[2])
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_PDL", "on")
    with pytest.raises(ValueError, match="RADIXSERVE_FLASHINFER_PDL"):
        FlashInferAttnBackend(setup(8, 2, 16)[0])


@pytest.mark.parametrize("tensor_cores", ["0", "1"])
@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("window", [-1, 40])
def test_extend_and_decode_match_torch_native(page: int, heads: int, kv_heads: int, window: int, tensor_cores: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TENSOR_CORES_ENV, tensor_cores)
    gen = torch.Generator().manual_seed(page * 100 + heads + window)
    for mode, prefix, new in ((ForwardMode.EXTEND, [0, 17, 64, 200], [33, 1, 16, 70]),
                              (ForwardMode.DECODE, [0, 15, 16, 300], [1, 1, 1, 1])):
        runner, layer = setup(heads, kv_heads, page, window)
        backend = FlashInferAttnBackend(runner, sliding_windows=[window])
        assert backend.tensor_cores == (tensor_cores == "1")
        fb, q, k, v = batch(runner, backend, prefix, new, mode, gen)
        backend.init_forward_metadata(fb)
        out = backend.forward(q, k, v, layer, fb)
        ref = TorchNativeAttnBackend(runner)
        ref.init_forward_metadata(fb)
        want = ref.forward(q, k, v, layer, fb, save_kv_cache=False)
        torch.testing.assert_close(out.float(), want.float(), atol=2e-2, rtol=2e-2)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("heads,kv_heads", [(8, 2), (4, 4)])
@pytest.mark.parametrize("prefix", [[0, 0, 0], [0, 17, 300], [16, 64, 5]])
def test_ragged_extend_matches_paged_and_torch_native(page: int, heads: int, kv_heads: int, prefix: list[int],
                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    """From RADIXSERVE_FLASHINFER_RAGGED_MIN_TOKENS new tokens an extend runs ragged (+ paged over the prefixes,
    merged): no prefix at all, some requests without one, prefixes off page boundaries. The same attention as the
    paged path and as torch_native; below the threshold the paged path runs."""
    new = [200, 1, 77]
    outs = {}
    for threshold in ("0", "100000"):
        monkeypatch.setenv("RADIXSERVE_FLASHINFER_RAGGED_MIN_TOKENS", threshold)
        gen = torch.Generator().manual_seed(page + heads + sum(prefix))
        runner, layer = setup(heads, kv_heads, page)
        backend = FlashInferAttnBackend(runner)
        fb, q, k, v = batch(runner, backend, prefix, new, ForwardMode.EXTEND, gen)
        backend.init_forward_metadata(fb)
        assert (backend.plan.ragged is not None) == (threshold == "0")
        assert backend.plan.prefix == (threshold == "0" and any(prefix))
        outs[threshold] = backend.forward(q, k, v, layer, fb)
        ref = TorchNativeAttnBackend(runner)
        ref.init_forward_metadata(fb)
        want = ref.forward(q, k, v, layer, fb, save_kv_cache=False)
        torch.testing.assert_close(outs[threshold].float(), want.float(), atol=2e-2, rtol=2e-2)
    torch.testing.assert_close(outs["0"].float(), outs["100000"].float(), atol=2e-2, rtol=2e-2)


def test_sliding_window_keeps_the_paged_extend(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_RAGGED_MIN_TOKENS", "0")
    runner, _ = setup(8, 2, 16, window=40)
    backend = FlashInferAttnBackend(runner, sliding_windows=[40, -1])
    assert backend.ragged is None
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_RAGGED_MIN_TOKENS", "many")
    with pytest.raises(ValueError, match="RAGGED_MIN_TOKENS"):
        FlashInferAttnBackend(runner)


@pytest.mark.parametrize("tensor_cores", ["0", "1"])
def test_cuda_graph_hooks_match_eager(tensor_cores: str, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(TENSOR_CORES_ENV, tensor_cores)
    gen = torch.Generator().manual_seed(7)
    runner, layer = setup(8, 2, 16)
    backend = FlashInferAttnBackend(runner)
    fb, q, k, v = batch(runner, backend, [5, 100, 31], [1, 1, 1], ForwardMode.DECODE, gen)
    backend.init_forward_metadata(fb)
    eager = backend.forward(q, k, v, layer, fb)
    backend.init_cuda_graph_state(4)
    rpi = torch.zeros(4, dtype=torch.int64, device=DEV)
    lens = torch.ones(4, dtype=torch.int64, device=DEV)
    backend.init_forward_metadata_capture_cuda_graph(4, rpi, lens)
    qp = torch.zeros(4, q.shape[1], dtype=DT, device=DEV)
    out = torch.empty_like(qp)
    fb.batch_size = 4
    graph = torch.cuda.CUDAGraph()
    backend.forward(qp, k.new_zeros(4, k.shape[1]), v.new_zeros(4, v.shape[1]), layer, fb, save_kv_cache=False)
    with torch.cuda.graph(graph):
        out.copy_(backend.forward(qp, k, v, layer, fb, save_kv_cache=False))
    rpi[:3].copy_(fb.req_pool_indices)
    lens[:3].copy_(fb.seq_lens)
    qp[:3].copy_(q)
    backend.init_forward_metadata_replay_cuda_graph(4, rpi, lens, int(lens.sum()))
    graph.replay()
    torch.testing.assert_close(out[:3].float(), eager.float(), atol=1e-2, rtol=1e-2)


@pytest.mark.parametrize("page", [1, 16])
@pytest.mark.parametrize("fast", ["0", "1"])
@pytest.mark.parametrize("tensor_cores", ["0", "1"])
def test_graph_replays_follow_growing_lengths(page: int, fast: str, tensor_cores: str,
                                              monkeypatch: pytest.MonkeyPatch) -> None:
    """One captured graph replayed for 20 steps while three requests grow by a token a step (page boundaries
    crossed; at step 10 by two, which the plan made ahead did not expect): every replay equals the eager path on
    those lengths, with the direct replay plan and with plan(). With the direct plan, the next step is planned
    after each replay (on every second step once the GPU has caught up, so the plan ahead surely runs)."""
    import dataclasses

    monkeypatch.setenv(TENSOR_CORES_ENV, tensor_cores)
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_FAST_PLAN", fast)
    gen = torch.Generator().manual_seed(11 + page)
    runner, layer = setup(8, 2, page)
    backend = FlashInferAttnBackend(runner)
    base = [5, 100, 31]
    fb, q, k, v = batch(runner, backend, [b + 24 for b in base], [1, 1, 1], ForwardMode.DECODE, gen)
    backend.init_cuda_graph_state(4)
    rpi = torch.zeros(4, dtype=torch.int64, device=DEV)
    lens = torch.ones(4, dtype=torch.int64, device=DEV)
    backend.init_forward_metadata_capture_cuda_graph(4, rpi, lens)
    assert backend.fast_plan == (fast == "1")  # the direct plan reproduced plan()'s at capture
    qp = torch.zeros(4, q.shape[1], dtype=DT, device=DEV)
    out = torch.empty_like(qp)
    cap = dataclasses.replace(fb, batch_size=4)
    backend.forward(qp, k.new_zeros(4, k.shape[1]), v.new_zeros(4, v.shape[1]), layer, cap, save_kv_cache=False)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out.copy_(backend.forward(qp, k, v, layer, cap, save_kv_cache=False))
    hits = 0
    for step in range(20):
        now = [b + step + 1 + (step >= 10) for b in base]
        q = torch.randn(3, q.shape[1], generator=gen).to(DEV, DT)
        seq = torch.tensor(now, device=DEV)
        eager_fb = dataclasses.replace(fb, seq_lens=seq, seq_lens_cpu=now, seq_lens_sum=sum(now))
        backend.init_forward_metadata(eager_fb)
        eager = backend.forward(q, k, v, layer, eager_fb, save_kv_cache=False)
        rpi[:3].copy_(fb.req_pool_indices)
        lens[:3].copy_(seq)
        qp[:3].copy_(q)
        hits += backend._ahead is not None and backend._ahead[1] == now + [1]
        backend.init_forward_metadata_replay_cuda_graph(4, rpi, lens, int(lens.sum()), now)
        graph.replay()
        if step % 2:
            torch.cuda.synchronize()
        backend.after_replay_cuda_graph(4)
        torch.testing.assert_close(out[:3].float(), eager.float(), atol=1e-2, rtol=1e-2)
    # each odd step surely planned the next (8 of them hit: step 10 was not what step 9 expected, 19 is the last)
    assert hits >= 8 if fast == "1" else hits == 0


@pytest.mark.parametrize("ragged", ["0", "100000"])
def test_model_decodes_like_triton_teacher_forced(tmp_path, ragged: str,  # noqa: ANN001
                                                  monkeypatch: pytest.MonkeyPatch) -> None:
    """bf16, CUDA graphs on both, page size 16: flashinfer decodes triton's greedy tokens (teacher-forced) with the
    same argmax at every step but near-ties (triton's own lead under 2% of the step's largest |logit|); its prefill
    on the ragged kernel or the paged one."""
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_RAGGED_MIN_TOKENS", ragged)
    from model_utils import make_tiny_model

    from radixserve.bench_one_batch import StaticBatch
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    hf = make_tiny_model("llama", str(tmp_path), hidden_size=256, intermediate_size=256, num_attention_heads=2,
                         num_key_value_heads=1, vocab_size=512)
    with torch.no_grad():
        hf.get_output_embeddings().weight.mul_(30.0)
    hf.save_pretrained(str(tmp_path))
    prompts = [[5, 17, 42, 99, 3, 250, 7, 8, 9, 10, 11, 12, 13, 14], [1, 2, 3], list(range(30, 90))]

    def run(name: str, forced: list[list[int]] | None) -> tuple[list[list[int]], list[torch.Tensor]]:
        args = ServerArgs(model_path=str(tmp_path), device="cuda", dtype="bfloat16", max_total_tokens=4096,
                          max_running_requests=8, cuda_graph_max_bs=8, attention_backend=name, page_size=16)
        runner = ModelRunner(ModelConfig(str(tmp_path)), args)
        assert runner.cuda_graph_runner is not None
        sb = StaticBatch(runner)
        batch, _ = sb.prefill(prompts)
        logits = [sb.last_logits.next_token_logits.float().cpu()]
        for step in range(15):
            if forced is not None:
                for req, toks in zip(batch.reqs, forced, strict=True):
                    req.output_ids[-1] = toks[step]
            sb.decode(batch)
            logits.append(sb.last_logits.next_token_logits.float().cpu())
        return [list(r.output_ids) for r in batch.reqs], logits

    ref_tokens, ref_logits = run("triton", None)
    _, fi_logits = run("flashinfer", ref_tokens)
    misses = near = 0
    for step, (a, b) in enumerate(zip(ref_logits, fi_logits, strict=True)):
        for row in range(len(prompts)):
            want, got = ref_tokens[row][step], int(b[row].argmax())
            if got != want:
                misses += 1
                near += bool(a[row, want] - a[row, got] < 0.02 * a[row].abs().max())
        assert (a - b).abs().max() < 0.05 * a.abs().max() + 0.5
    assert misses == near, (misses, near)


@pytest.mark.parametrize("overlap", [False, True])
def test_scheduler_replays_planned_ahead_equal_plan(tmp_path, overlap: bool, monkeypatch: pytest.MonkeyPatch) -> None:
    """Through the scheduler (radix cache, chunked prefill, page size 16, decode in CUDA graphs), bf16: replays that
    take the plan made after the previous step (or plan directly) give the tokens of replays that all plan through
    FlashInfer's plan(), with and without overlap scheduling (the same plans, so the same kernels and bits)."""
    from model_utils import make_tiny_model
    from test_scheduler import run, workload

    make_tiny_model("llama", str(tmp_path), hidden_size=256, intermediate_size=256, num_attention_heads=2,
                    num_key_value_heads=1, vocab_size=512)
    kw = dict(device="cuda", dtype="bfloat16", attention_backend="flashinfer", page_size=16, chunked_prefill_size=16,
              cuda_graph_max_bs=8, enable_overlap_schedule=overlap)
    reqs = workload(n=10)
    monkeypatch.setenv("RADIXSERVE_FLASHINFER_FAST_PLAN", "0")
    want = run(str(tmp_path), reqs, **kw)
    monkeypatch.delenv("RADIXSERVE_FLASHINFER_FAST_PLAN")
    assert run(str(tmp_path), reqs, **kw) == want
