"""bench_one_batch on the CPU: profile_prefill's figures, and every KV slot and request row given back; the
--correctness-test run."""

from __future__ import annotations

from model_utils import make_runner, make_tiny_model

from radixserve.bench_one_batch import CORRECTNESS_PROMPTS, main, print_profile, profile_prefill


def test_profile_prefill_reports_and_frees(tmp_path, capsys) -> None:
    make_tiny_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path))
    kv_free = runner.token_to_kv_pool.available_size()
    rows_free = runner.req_to_token_pool.available_size()
    p = profile_prefill(runner, 3, 7, seed=0, top=5)
    assert p["prefill"] and (p["batch_size"], p["input_len"]) == (3, 7)
    assert p["wall_ms"] > 0 and p["tokens_per_s"] > 0
    assert p["kernels"] == 0 and p["top_kernels"] == []  # no CUDA kernels on the CPU
    assert runner.token_to_kv_pool.available_size() == kv_free
    assert runner.req_to_token_pool.available_size() == rows_free
    print_profile(p)
    assert "prefill of 3 x 7 tokens" in capsys.readouterr().out


def test_correctness_test_runs_at_batch_size_1(embedded_model_path, tmp_path, capsys) -> None:
    """`--batch-size 1 --correctness-test` sized the pool for one request and failed on its several prompts
    ("out of request slots")."""
    main(["--model-path", embedded_model_path, "--dtype", "float32", "--batch-size", "1", "--output-len", "8",
          "--correctness-test", "--result-file", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert out.count("=== ") == len(CORRECTNESS_PROMPTS) and "Paris" in out


def test_correctness_test_text_ends_at_the_end_of_sequence(embedded_model_path, tmp_path, capsys) -> None:
    """The static batch decodes past each answer's <|im_end|>; the printed text is what a server returns."""
    main(["--model-path", embedded_model_path, "--dtype", "float32", "--batch-size", "1", "--output-len", "40",
          "--correctness-test", "--result-file", str(tmp_path / "r.json")])
    out = capsys.readouterr().out
    assert "=== What is the capital of France?\nThe capital of France is Paris.\n\n===" in out
    assert "user" not in out


def test_prefill_in_runs_within_a_token_budget_decodes_the_same(tmp_path) -> None:
    """`StaticBatch.prefill(max_tokens=...)`: whole prompts in runs within the budget (one forward each), merged
    into one batch: the same greedy tokens as one forward for all, and every slot given back after."""
    from radixserve.bench_one_batch import StaticBatch

    make_tiny_model("llama", str(tmp_path))
    runner = make_runner(str(tmp_path))
    kv_free = runner.token_to_kv_pool.available_size()
    prompts = [[(7 * i + 3 * j) % 200 + 5 for i in range(n)] for j, n in enumerate([9, 4, 12, 3, 7])]
    forwards: list[int] = []  # the requests of each forward

    def counted(sb: StaticBatch) -> StaticBatch:
        run = sb._run
        sb._run = lambda batch: forwards.append(len(batch.reqs)) or run(batch)  # type: ignore[method-assign]
        return sb

    whole = counted(StaticBatch(runner)).generate(prompts, 6)
    assert forwards == [5] + [5] * 5  # one prefill forward without a budget
    forwards.clear()
    sb = counted(StaticBatch(runner))
    batch, first = sb.prefill(prompts, max_tokens=13)  # runs [9, 4], [12], [3, 7]
    assert forwards == [2, 1, 2]
    assert first == [w[0] for w in whole] and [r.rid for r in batch.reqs] == ["0", "1", "2", "3", "4"]
    for _ in range(5):
        sb.decode(batch)
    assert [list(r.output_ids) for r in batch.reqs] == whole
    sb.release(batch)
    assert runner.token_to_kv_pool.available_size() == kv_free
