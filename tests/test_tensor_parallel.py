"""Tensor parallelism on the CPU (gloo): the sharded layers recombine to the full ones, TP=2 engines generate
exactly what one TP=1 scheduler does (Llama with GQA and biases, Qwen2 with q/k/v bias and tied embeddings, one KV
head for two ranks with a vocabulary that does not split evenly), and a killed rank takes the engine down loudly."""

from __future__ import annotations

import os
import signal
import time

import pytest
import torch
from parallel_utils import SERVER_KW, make_model, reference_outputs

from radixserve import Engine
from radixserve.layers.linear import (
    ColumnParallelLinear,
    MergedColumnParallelLinear,
    QKVParallelLinear,
    RowParallelLinear,
)
from radixserve.layers.vocab_parallel_embedding import VocabParallelEmbedding

PROMPTS = [[1, 5, 9, 33, 2], [7, 8, 9, 10, 11, 12, 13, 14, 15, 16, 17], [200, 3], list(range(40, 90))]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
SEEDED = {"max_new_tokens": 10, "temperature": 1.0, "top_p": 0.9, "seed": 1234, "ignore_eos": True}


# ----------------------------------------------------------------------------------------- layers, in-process
def _shards(cls: type, *args: object, tp: int = 2, **kw: object) -> list[torch.nn.Module]:
    return [cls(*args, tp_rank=r, tp_size=tp, **kw) for r in range(tp)]


@pytest.mark.parametrize("num_kv_heads", [4, 2, 1])
def test_qkv_shards_match_full_projection(num_kv_heads: int) -> None:
    torch.manual_seed(0)
    hidden, head_dim, heads, tp = 32, 8, 4, 4
    q, k, v = torch.randn(heads * head_dim, hidden), torch.randn(num_kv_heads * head_dim, hidden), \
        torch.randn(num_kv_heads * head_dim, hidden)
    bq, bk, bv = torch.randn(heads * head_dim), torch.randn(num_kv_heads * head_dim), \
        torch.randn(num_kv_heads * head_dim)
    x = torch.randn(3, hidden)
    full_q, full_k, full_v = x @ q.T + bq, x @ k.T + bk, x @ v.T + bv
    group = heads // num_kv_heads
    for rank, layer in enumerate(_shards(QKVParallelLinear, hidden, head_dim, heads, num_kv_heads, True, tp=tp)):
        for w, b, sid in ((q, bq, "q"), (k, bk, "k"), (v, bv, "v")):
            layer.weight.weight_loader(layer.weight, w, sid)
            layer.bias.weight_loader(layer.bias, b, sid)
        out = layer(x)
        nq, nkv = layer.num_heads * head_dim, layer.num_kv_heads * head_dim
        assert nkv == max(1, num_kv_heads // tp) * head_dim
        my_q = full_q[:, rank * nq:(rank + 1) * nq]
        # the KV head serving this rank's first query head (replicated when there are fewer KV heads than ranks)
        kv_head = (rank * layer.num_heads) // group
        my_k = full_k[:, kv_head * head_dim: kv_head * head_dim + nkv]
        my_v = full_v[:, kv_head * head_dim: kv_head * head_dim + nkv]
        torch.testing.assert_close(out, torch.cat([my_q, my_k, my_v], dim=-1))


def test_mlp_and_embedding_shards_recombine() -> None:
    torch.manual_seed(0)
    hidden, inter, vocab = 16, 24, 37  # 37: the last of two vocabulary shards is padded
    gate, up, down = torch.randn(inter, hidden), torch.randn(inter, hidden), torch.randn(hidden, inter)
    down_bias = torch.randn(hidden)
    x = torch.randn(5, hidden)
    ref = torch.nn.functional.silu(x @ gate.T) * (x @ up.T) @ down.T + down_bias
    partial = []
    for gu, dn in zip(_shards(MergedColumnParallelLinear, hidden, [inter, inter]),
                      _shards(RowParallelLinear, inter, hidden, True), strict=True):
        gu.weight.weight_loader(gu.weight, gate, 0)
        gu.weight.weight_loader(gu.weight, up, 1)
        dn.weight.weight_loader(dn.weight, down)
        dn.bias.weight_loader(dn.bias, down_bias)
        g, u = gu(x).chunk(2, dim=-1)
        # no process group here: the all-reduce is a no-op, so the sum over ranks is done by hand
        partial.append(dn(torch.nn.functional.silu(g) * u))
    torch.testing.assert_close(sum(partial), ref)

    col = _shards(ColumnParallelLinear, hidden, 8, True)
    w, b = torch.randn(8, hidden), torch.randn(8)
    for layer in col:
        layer.weight.weight_loader(layer.weight, w)
        layer.bias.weight_loader(layer.bias, b)
    torch.testing.assert_close(torch.cat([layer(x) for layer in col], dim=-1), x @ w.T + b)

    table = torch.randn(vocab, hidden)
    ids = torch.tensor([0, 5, 18, 19, 36])
    embs = _shards(VocabParallelEmbedding, vocab, hidden)
    for e in embs:
        e.weight.weight_loader(e.weight, table)
    torch.testing.assert_close(sum(e(ids) for e in embs), table[ids])
    logits = torch.cat([x @ e.weight.T for e in embs], dim=-1)[:, :vocab]  # what the LogitsProcessor gathers
    torch.testing.assert_close(logits, x @ table.T)


# ----------------------------------------------------------------------------------------- engines, TP=2
def _check_engine_matches(path: str, engine: Engine) -> None:
    want = reference_outputs(path, PROMPTS, GREEDY)
    got = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == want
    alone = engine.generate(input_ids=PROMPTS[1], sampling_params=GREEDY)  # now a prefix-cache hit
    assert alone["output_ids"] == want[1] and alone["meta_info"]["cached_tokens"] > 0


@pytest.fixture(scope="module")
def llama_tp2(tmp_path_factory: pytest.TempPathFactory):
    path = make_model("llama", str(tmp_path_factory.mktemp("llama_tp")), seed=1, attention_bias=True,
                      mlp_bias=True)
    engine = Engine(model_path=path, tp_size=2, dist_timeout=10, **SERVER_KW)
    try:
        yield path, engine
    finally:
        engine.shutdown()


@pytest.mark.integration
def test_llama_gqa_tp2_matches_tp1(llama_tp2) -> None:
    path, engine = llama_tp2
    _check_engine_matches(path, engine)
    # seeded sampling depends on the request only: TP=2 draws what TP=1 draws
    got = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS[:2], sampling_params=SEEDED)]
    assert got == reference_outputs(path, PROMPTS[:2], SEEDED)
    # unseeded sampling: rank 0's draw is the one every rank keeps, so the ranks' KV caches stay identical and a
    # greedy continuation of the sampled text (a prefix-cache hit on every rank) is still exact
    sampled = engine.generate(input_ids=PROMPTS[3], sampling_params={**SEEDED, "seed": None})["output_ids"]
    cont = PROMPTS[3] + sampled
    again = engine.generate(input_ids=cont, sampling_params=GREEDY)
    assert again["meta_info"]["cached_tokens"] >= len(cont) - 1
    assert again["output_ids"] == reference_outputs(path, [cont], GREEDY)[0]


@pytest.mark.integration
def test_qwen2_bias_tied_tp2_matches_tp1(tmp_path) -> None:
    path = make_model("qwen2", str(tmp_path), seed=2)
    with Engine(model_path=path, tp_size=2, **SERVER_KW) as engine:
        _check_engine_matches(path, engine)


@pytest.mark.integration
def test_int8_lm_head_tied_and_padded_tp2_matches_tp1(tmp_path) -> None:
    """--quantize-lm-head at TP=2: each rank quantises its own vocabulary rows (one scale a row, so its shard holds
    the TP=1 head's rows), here a tied head whose last shard is padded (251 rows over two ranks)."""
    path = make_model("qwen2", str(tmp_path), seed=4, vocab_size=251)
    want = reference_outputs(path, PROMPTS, GREEDY, quantize_lm_head=True)
    with Engine(model_path=path, tp_size=2, quantize_lm_head=True, **SERVER_KW) as engine:
        got = [o["output_ids"] for o in engine.generate(input_ids=PROMPTS, sampling_params=GREEDY)]
    assert got == want


@pytest.mark.integration
def test_fewer_kv_heads_than_ranks_tp2_matches_tp1(tmp_path) -> None:
    # one KV head for two ranks (replicated), and a vocabulary of 251 (the second shard is padded)
    path = make_model("llama", str(tmp_path), seed=3, num_key_value_heads=1, vocab_size=251)
    with Engine(model_path=path, tp_size=2, **SERVER_KW) as engine:
        _check_engine_matches(path, engine)


@pytest.mark.integration
def test_hung_rank_is_detected(llama_tp2) -> None:
    """Freeze TP rank 1 (SIGSTOP): rank 0's next collective times out after --dist-timeout, it exits, and the
    engine reports a dead process (what /health turns into a 503), no silent hang. (A killed rank is noticed at
    once: test_multinode.)"""
    _, engine = llama_tp2
    procs = {p.name: p for p in engine.processes.procs}
    rank0, rank1 = procs["radixserve-scheduler-tp0"], procs["radixserve-scheduler-tp1"]
    assert engine.processes.alive()
    os.kill(rank1.pid, signal.SIGSTOP)
    try:
        start = time.monotonic()
        while rank0.is_alive() and time.monotonic() - start < 40:
            time.sleep(0.1)
        assert not rank0.is_alive(), "rank 0 did not give up on the frozen rank 1"
        assert 9 < time.monotonic() - start  # it waited for the timeout (10 s), not less
        assert rank0.exitcode == 1
        assert not engine.processes.alive()
    finally:
        os.kill(rank1.pid, signal.SIGKILL)


# ----------------------------------------------------------------------------------------- dummy weights under TP
def _dummy_model(path: str, tp_rank: int, tp_size: int) -> torch.nn.Module:
    from radixserve.configs.model_config import ModelConfig
    from radixserve.model_loader import get_model

    return get_model(ModelConfig(path, load_format="dummy"), load_format="dummy", dtype=torch.float32, device="cpu",
                     tp_rank=tp_rank, tp_size=tp_size, seed=5)


@pytest.mark.parametrize("kind,over", [("llama", dict(attention_bias=True, mlp_bias=True)),
                                       ("qwen2", dict(num_key_value_heads=1, vocab_size=251))])
def test_dummy_weights_do_not_depend_on_tp(kind: str, over: dict, tmp_path) -> None:
    """Each TP=2 rank's dummy parameter is exactly its shard of the TP=1 dummy parameter: the full tensors are
    generated whole (seeded by name) and narrowed by the weight loaders, as a checkpoint would be."""
    from radixserve.model_loader.dummy import full_shards

    path = make_model(kind, str(tmp_path), seed=4, **over)
    full = dict(_dummy_model(path, 0, 1).named_parameters())
    for rank in range(2):
        sharded = _dummy_model(path, rank, 2)
        modules = dict(sharded.named_modules())
        for name, param in sharded.named_parameters():
            mod_name, _, leaf = name.rpartition(".")
            shards = full_shards(modules[mod_name], leaf, param)
            want = torch.empty_like(param)
            loader = getattr(param, "weight_loader", None)
            if loader is None:
                want.copy_(full[name])
            else:  # the TP=1 parameter is the full tensors stacked (q/k/v, gate/up): split it, load each piece
                pieces = full[name].split([shape[0] for _, shape in shards])
                for (shard_id, _), piece in zip(shards, pieces, strict=True):
                    loader(want, piece, shard_id)
            assert torch.equal(param, want), (rank, name)


@pytest.mark.integration
def test_dummy_weights_tp2_logits_match_tp1(tmp_path) -> None:
    """The same --load-format dummy model at TP=2 (gloo) and TP=1: prompt logprobs equal to float32 rounding and
    the same greedy tokens (before the fix each rank drew its own random shard: a different model)."""
    path = make_model("llama", str(tmp_path), seed=6)
    prompts = [[1, 5, 9, 33, 2], list(range(40, 90))]
    kw = dict(input_ids=prompts, sampling_params={**GREEDY, "max_new_tokens": 8}, return_logprob=True,
              logprob_start_len=0, top_logprobs_num=3)
    outs = []
    for tp in (1, 2):
        with Engine(model_path=path, tp_size=tp, load_format="dummy", random_seed=11, **SERVER_KW) as engine:
            outs.append(engine.generate(**kw))
    for one, two in zip(*outs, strict=True):
        assert two["output_ids"] == one["output_ids"]
        lp1 = [lp for lp, _ in one["meta_info"]["input_token_logprobs"][1:]]
        lp2 = [lp for lp, _ in two["meta_info"]["input_token_logprobs"][1:]]
        assert lp2 == pytest.approx(lp1, abs=1e-4)
        out1 = [lp for lp, _ in one["meta_info"]["output_token_logprobs"]]
        out2 = [lp for lp, _ in two["meta_info"]["output_token_logprobs"]]
        assert out2 == pytest.approx(out1, abs=1e-4)


@pytest.mark.integration
def test_bench_one_batch_tp2(tmp_path) -> None:
    """bench_one_batch --tp-size 2 spawns one process per rank (gloo here); rank 0 alone writes the JSON."""
    import json

    from radixserve import bench_one_batch

    path = make_model("llama", str(tmp_path / "model"), seed=7)
    out = tmp_path / "one_batch.json"
    bench_one_batch.main(["--model-path", path, "--load-format", "dummy", "--tp-size", "2", "--device", "cpu",
                          "--batch-size", "1", "3", "--input-len", "8", "--output-len", "4", "--log-level", "warning",
                          "--result-file", str(out)])
    written = json.loads(out.read_text())
    results = written["results"]
    assert [r["batch_size"] for r in results] == [1, 3] and all(r["tp_size"] == 2 for r in results)
    assert all(r["decode_tok_s"] > 0 for r in results)
    assert written["meta"]["host_probe_us"] > 0  # the host's speed at the time, to read the figures against
