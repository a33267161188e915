"""On CUDA: greedy outputs vs transformers (bf16) on tiny random models, CUDA-graph decode vs eager, overlap vs
normal scheduling. Skipped without a GPU."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from model_utils import make_tiny_model, peaky_tiny_model, teacher_forced_agreement  # noqa: E402

from radixserve.bench_one_batch import StaticBatch  # noqa: E402


def gpu_runner(path: str, **kw):
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    args = ServerArgs(model_path=path, device="cuda", dtype="bfloat16", max_total_tokens=1 << 16,
                      max_running_requests=80, cuda_graph_max_bs=80, **kw)
    return ModelRunner(ModelConfig(path), args)


def prompts(n: int, vocab: int, seed: int = 0) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, vocab, (int(torch.randint(4, 64, (1,), generator=g)),), generator=g).tolist()
            for _ in range(n)]


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_greedy_agrees_with_transformers_bf16(kind: str, tmp_path) -> None:
    """64 prompts × 64 greedy steps, bf16 on both sides, compared position by position with the same context."""
    hf = peaky_tiny_model(kind, str(tmp_path)).to("cuda", torch.bfloat16)
    runner = gpu_runner(str(tmp_path))
    exact, near, total = teacher_forced_agreement(hf, runner, prompts(64, 2048), 64)
    assert (exact + near) / total >= 0.99, f"{kind}: {exact} exact + {near} near-ties of {total}"
    assert exact / total >= 0.95, f"{kind}: only {exact}/{total} exact"


def test_cuda_graph_decode_equals_eager(tmp_path) -> None:
    peaky_tiny_model("llama", str(tmp_path))
    ps = prompts(37, 2048, seed=3)  # 37: padded up to a captured size (same kernels, so identical tokens)
    graph = gpu_runner(str(tmp_path))
    assert graph.cuda_graph_runner is not None
    eager = gpu_runner(str(tmp_path), disable_cuda_graph=True)
    assert eager.cuda_graph_runner is None
    assert StaticBatch(graph).generate(ps, 32) == StaticBatch(eager).generate(ps, 32)


def test_one_copy_decode_path_equals_the_generic_one(tmp_path, monkeypatch) -> None:
    """Float32: decode steps through ForwardBatch's one-copy path (the pack and the graph's input kernel, which also
    writes the request table) give the tokens of the generic path (one copy per column, the table written by an
    indexed store), and the device request table matches the host mirror after every step."""
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_executor import forward_batch_info as fbi
    from radixserve.model_executor.model_runner import ModelRunner
    from radixserve.server_args import ServerArgs

    peaky_tiny_model("llama", str(tmp_path))
    args = ServerArgs(model_path=str(tmp_path), device="cuda", dtype="float32", max_total_tokens=1 << 14,
                      max_running_requests=48, cuda_graph_max_bs=48)
    runner = ModelRunner(ModelConfig(str(tmp_path)), args)
    pool = runner.req_to_token_pool
    ps = prompts(37, 2048, seed=5)
    calls: list[int] = []
    fast = fbi.ForwardBatch._init_graph_decode

    def counted(*a, **k):
        calls.append(1)
        return fast(*a, **k)

    def run() -> list[list[int]]:
        sb = StaticBatch(runner)
        batch, _ = sb.prefill(ps)
        for _ in range(24):
            sb.decode(batch)
            assert torch.equal(pool.req_to_token.cpu(), pool.req_to_token_cpu)
        out = [list(r.output_ids) for r in batch.reqs]
        sb.release(batch)
        return out

    assert runner.cuda_graph_runner.load_in_graph  # the triton backend: the input kernel is the graph's first node
    monkeypatch.setattr(fbi.ForwardBatch, "_init_graph_decode", counted)
    one_copy = run()
    assert len(calls) == 24, "every decode step should have taken the one-copy path"
    take_pack = fbi._graph_decode_from_pack
    monkeypatch.setattr(fbi, "_graph_decode_from_pack", lambda *a: False)
    calls.clear()
    generic = run()
    assert not calls
    assert one_copy == generic
    # the two paths in turn on the same graphs: a general-path step leaves the pack's batch size at -1, so the
    # graph's own input kernel does not reload the previous pack over the buffers just loaded
    turn = iter(range(1 << 20))
    monkeypatch.setattr(fbi, "_graph_decode_from_pack", lambda *a: next(turn) % 2 == 0 and take_pack(*a))
    calls.clear()
    assert run() == one_copy
    assert len(calls) == 12


def test_overlap_equals_normal_on_cuda(tmp_path) -> None:
    sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
    from test_scheduler import drain, sampled_workload

    from radixserve.managers import io_struct as io
    from radixserve.managers.scheduler import Scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    make_tiny_model("llama", str(tmp_path), vocab_size=512)

    def run(overlap: bool) -> dict:
        s = Scheduler(ServerArgs(model_path=str(tmp_path), device="cuda", dtype="float32", max_total_tokens=4096,
                                 skip_tokenizer_init=True, disable_overlap_schedule=not overlap,
                                 chunked_prefill_size=16, enable_mixed_chunk=True), port_args={})
        for rid, prompt, sp in sampled_workload():
            s.process_input_requests([io.TokenizedGenerateReqInput(
                rid=rid, input_text=None, input_ids=prompt, sampling_params=SamplingParams.from_dict(sp),
                return_logprob=True, top_logprobs_num=2)])
        return drain(s)

    off, on = run(False), run(True)
    for rid in off:
        assert on[rid]["ids"] == off[rid]["ids"], rid


def compiled_while_serving(s, waves: list[int], shared_len: int, max_tail: int) -> list[str]:
    """Runs waves of greedy requests (odd ones sharing a prefix of shared_len tokens, tails of 1..max_tail) through
    the warmed-up scheduler s, checks that each produced all its tokens, and returns the Triton kernels compiled
    meanwhile."""
    from test_scheduler import drain
    from triton import knobs

    from radixserve.managers import io_struct as io
    from radixserve.sampling.sampling_params import SamplingParams

    compiled: list[str] = []

    def on_compile(**kw) -> bool:
        spec = kw.get("compile") or {}  # the variant: constexprs and the arguments' alignment / value attributes
        compiled.append(f"{str(kw.get('repr', '')).split('[')[0]} constants {spec.get('constants')} "
                        f"attrs {spec.get('configs')}"[:1500])
        return False  # compile as usual

    knobs.runtime.jit_cache_hook = on_compile
    try:
        g = torch.Generator().manual_seed(7)
        shared = torch.randint(3, 512, (shared_len,), generator=g).tolist()
        for wave, n in enumerate(waves):
            for i in range(n):
                tail = torch.randint(3, 512, (int(torch.randint(1, max_tail, (1,), generator=g)),),
                                     generator=g).tolist()
                prompt = shared + tail if i % 2 else tail
                s.process_input_requests([io.TokenizedGenerateReqInput(
                    rid=f"w{wave}r{i}", input_text=None, input_ids=prompt, sampling_params=SamplingParams.from_dict(
                        {"max_new_tokens": 3 + i, "temperature": 0, "ignore_eos": True}))])
            results = drain(s)
            assert {rid: len(r["ids"]) for rid, r in results.items()} == {f"w{wave}r{i}": 3 + i for i in range(n)}
    finally:
        knobs.runtime.jit_cache_hook = None
        if s.worker_client is not None:
            s.worker_client.shutdown()
    return compiled


def test_no_triton_compilation_after_warmup(tmp_path) -> None:
    """After the start-up warm-up, serving compiles no new Triton kernel specialisation: batches of odd and even
    sizes and token counts (device views are 16-byte aligned), eager decode above the captured sizes, prefix hits,
    chunked and mixed prefill all reuse the kernels compiled by the warm-up and the graph capture."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    make_tiny_model("llama", str(tmp_path), vocab_size=512)
    s = Scheduler(ServerArgs(model_path=str(tmp_path), device="cuda", dtype="bfloat16", max_total_tokens=8192,
                             skip_tokenizer_init=True, cuda_graph_max_bs=4, chunked_prefill_size=32,
                             enable_mixed_chunk=True), port_args={})
    s.warmup()
    compiled = compiled_while_serving(s, [1, 3, 2, 7, 12, 5], 21, 40)  # eager decode above the captured size 4
    assert compiled == [], compiled


@pytest.mark.parametrize("kind,quantization", [("qwen3_moe", None), ("deepseek_v2", None), ("qwen3_moe", "fp8")])
def test_no_triton_compilation_after_warmup_moe(kind: str, quantization: str | None, tmp_path) -> None:
    """The same for MoE models with prefill batches of up to 2,048 tokens: the experts' grouped GEMMs at every block
    size (fp8 experts: their own variants), the parallel align (more than 1,024 token-expert assignments) and the
    router over any number of tokens were compiled before serving (`fused_moe.precompile`, the warm-up, the graph
    capture)."""
    from radixserve.managers.scheduler import Scheduler
    from radixserve.server_args import ServerArgs

    make_tiny_model(kind, str(tmp_path), vocab_size=512)
    s = Scheduler(ServerArgs(model_path=str(tmp_path), device="cuda", dtype="bfloat16", max_total_tokens=32768,
                             skip_tokenizer_init=True, cuda_graph_max_bs=4, chunked_prefill_size=2048,
                             quantization=quantization),
                  port_args={})
    s.warmup()
    compiled = compiled_while_serving(s, [1, 3, 6, 2], 100, 380)  # up to ~2,000 prompt tokens a prefill batch
    assert compiled == [], compiled


@pytest.mark.parametrize("rows", [8, 64, 300])
def test_lm_head_float32_logits_match_the_widened_16_bit_product(rows: int) -> None:
    """From FLOAT_LOGITS_MIN_ROWS rows a bf16 LM head writes float32 logits from its accumulator: the widened bf16
    product's values to within its rounding, with a padded vocabulary cut off and the result contiguous."""
    from types import SimpleNamespace

    from radixserve.layers import logits_processor as lp

    g = torch.Generator(device="cuda").manual_seed(0)
    hidden = torch.randn(rows, 256, device="cuda", generator=g).to(torch.bfloat16)
    weight = torch.randn(1000, 256, device="cuda", generator=g).to(torch.bfloat16) * 0.05
    head = SimpleNamespace(weight=weight, tp_size=1)
    got = lp.LogitsProcessor(990)._logits(hidden, head)
    ref = (hidden @ weight.T)[:, :990].float()
    assert got.dtype == torch.float32 and got.shape == (rows, 990) and got.is_contiguous()
    torch.testing.assert_close(got, ref, atol=1e-4, rtol=2 ** -7)  # about bf16 rounding of the reference
    exact = (hidden.float() @ weight.float().T)[:, :990]
    if rows >= lp.FLOAT_LOGITS_MIN_ROWS:  # the float32 result is nearer the exact sums than the rounded one
        assert (got - exact).abs().mean() < (ref - exact).abs().mean()
    else:
        assert torch.equal(got, ref)


@pytest.mark.parametrize("rows", [1, 8, 64, 300])
@pytest.mark.parametrize("vocab", [1000, 990])
def test_lm_head_logits_into_shared_rows_equal_their_own(rows: int, vocab: int) -> None:
    """Inside `logits_into` (the decode graphs' capture) a bf16 LM head's float32 logits land in the buffer's first
    rows, equal to the processor's own tensor: the product's `out=` from FLOAT_LOGITS_MIN_ROWS rows (an unpadded
    vocabulary), the widening copy below it or with a padded one."""
    from types import SimpleNamespace

    from radixserve.layers import logits_processor as lp

    g = torch.Generator(device="cuda").manual_seed(1)
    hidden = torch.randn(rows, 256, device="cuda", generator=g).to(torch.bfloat16)
    head = SimpleNamespace(weight=torch.randn(1000, 256, device="cuda", generator=g).to(torch.bfloat16) * 0.05,
                           tp_size=1)
    proc = lp.LogitsProcessor(vocab, final_logit_softcapping=30.0)
    own = proc._logits(hidden, head)
    buf = torch.full((512, vocab), float("nan"), device="cuda")
    with lp.logits_into(buf):
        shared = proc._logits(hidden, head)
    assert shared.data_ptr() == buf.data_ptr() and shared.shape == (rows, vocab)
    torch.testing.assert_close(shared, own, rtol=0, atol=0)
    assert buf[rows:].isnan().all()
