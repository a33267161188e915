"""The offline Engine over the real three processes (ZMQ), on the embedded SmolLM2."""

from __future__ import annotations

import os
import time

import psutil
import pytest

from radixserve import Engine
from radixserve.managers.tokenizer_manager import RequestError

pytestmark = pytest.mark.integration  # every test here starts processes

GREEDY = {"temperature": 0, "max_new_tokens": 12}


@pytest.fixture(scope="module")
def engine(embedded_model_path):
    with Engine(model_path=embedded_model_path, max_total_tokens=3000, log_level="warning") as e:
        yield e


def children() -> list[psutil.Process]:
    return psutil.Process(os.getpid()).children(recursive=True)


def test_generate_single_batch_and_ids(engine) -> None:
    one = engine.generate("The capital of France is", GREEDY)
    assert set(one) == {"text", "output_ids", "meta_info"}
    meta = one["meta_info"]
    assert meta["completion_tokens"] == len(one["output_ids"]) == 12
    assert meta["finish_reason"] == {"type": "length", "length": 12}
    assert "Paris" in one["text"]
    prompts = ["The capital of France is", "1, 2, 3, 4,", "Hello"]
    many = engine.generate(prompts, GREEDY)
    assert [m["text"] for m in many][0] == one["text"]  # order kept, batching does not change greedy output
    alone = [engine.generate(p, GREEDY)["text"] for p in prompts]
    assert [m["text"] for m in many] == alone
    tok = engine.tokenizer_manager.tokenizer
    by_ids = engine.generate(input_ids=[tok.encode(prompts[1])], sampling_params=GREEDY)
    assert by_ids[0]["output_ids"] == many[1]["output_ids"]


def test_stream_concatenates_to_full_text(engine) -> None:
    full = engine.generate("Write a list of fruits:", {**GREEDY, "max_new_tokens": 20})
    chunks = list(engine.generate("Write a list of fruits:", {**GREEDY, "max_new_tokens": 20}, stream=True))
    assert len(chunks) > 1
    assert chunks[-1]["text"] == full["text"]
    assert chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    assert all(b["text"].startswith(a["text"]) for a, b in zip(chunks, chunks[1:], strict=False))


def test_cached_tokens_on_repeated_prompt(engine) -> None:
    p = "A long shared system prompt about the history of the Roman empire and its many emperors. Question:"
    engine.generate(p + " who was first?", GREEDY)
    again = engine.generate(p + " who was last?", GREEDY)
    assert again["meta_info"]["cached_tokens"] > 10


def test_n_samples_share_the_prompt(engine) -> None:
    outs = engine.generate("Tell me a story:", {"max_new_tokens": 8, "temperature": 1.0, "n": 3, "seed": 7})
    assert len(outs) == 3
    assert all(o["meta_info"]["cached_tokens"] > 0 for o in outs)


def test_bad_requests_fail_alone_and_engine_keeps_serving(engine) -> None:
    with pytest.raises(RequestError, match="empty"):
        engine.generate("", GREEDY)
    with pytest.raises(RequestError, match="context length"):
        engine.generate(input_ids=[[5] * 9000], sampling_params=GREEDY)
    with pytest.raises(RequestError, match=r"\[0, 49152\)"):
        engine.generate(input_ids=[[5, 10**7]], sampling_params=GREEDY)
    with pytest.raises(RequestError, match="temperature"):
        engine.generate("hi", {"temperature": -1})
    with pytest.raises(RequestError, match="unknown"):
        engine.generate("hi", {"max_tokens": 3})
    assert engine.generate("The capital of France is", GREEDY)["meta_info"]["completion_tokens"] == 12
    state = engine.get_internal_state()
    assert state["memory_ok"] and state["invariant_violations"] == 0


def test_abort_running_request_frees_memory(engine) -> None:
    stream = engine.generate("Count to one thousand:", {"max_new_tokens": 400, "temperature": 0}, stream=True)
    first = next(stream)
    engine.abort_request(first["meta_info"]["id"])
    last = list(stream)[-1]
    assert last["meta_info"]["finish_reason"]["type"] == "abort"
    state = engine.get_internal_state()
    assert state["idle"] and state["memory_ok"]


def test_async_generate_from_another_event_loop(engine) -> None:
    """SGLang's Engine.async_generate: awaited from the caller's own loop, the same answers as generate(); a stream
    the caller leaves early aborts its request (nothing is left running or held)."""
    import asyncio

    prompts = ["The capital of France is", "1, 2, 3, 4,"]

    async def main() -> tuple:
        one = await engine.async_generate(prompts[0], GREEDY)
        both = await asyncio.gather(*(engine.async_generate(p, GREEDY) for p in prompts))
        batch = await engine.async_generate(prompts, GREEDY)
        chunks = [c async for c in await engine.async_generate(prompts[1], GREEDY, stream=True)]
        left = await engine.async_generate("Count to one thousand:", {"max_new_tokens": 400, "temperature": 0},
                                           stream=True)
        async for _ in left:
            break
        await left.aclose()
        return one, both, batch, chunks

    one, both, batch, chunks = asyncio.run(main())
    assert one["text"] == engine.generate(prompts[0], GREEDY)["text"]
    assert [b["text"] for b in both] == [b["text"] for b in batch] == [one["text"], chunks[-1]["text"]]
    assert len(chunks) > 1 and chunks[-1]["meta_info"]["finish_reason"]["type"] == "length"
    for _ in range(100):  # the abort reaches the scheduler within a step or two
        state = engine.get_internal_state()
        if state["idle"]:
            break
        time.sleep(0.05)
    assert state["idle"] and state["memory_ok"]


def test_get_server_info(engine) -> None:
    info = engine.get_server_info()
    assert info["max_total_tokens"] == 3000 and info["scheduler_info"]["max_total_num_tokens"] == 3000
    assert info["internal_states"][0]["memory_ok"] and info["version"]


def test_flush_cache(engine) -> None:
    engine.generate("Some text to cache", GREEDY)
    assert engine.flush_cache()
    state = engine.get_internal_state()
    assert state["evictable_tokens"] == 0 and state["free_tokens"] == state["max_total_num_tokens"]


def test_shutdown_leaves_no_child(embedded_model_path) -> None:
    before = {p.pid for p in children()}
    e = Engine(model_path=embedded_model_path, max_total_tokens=512, log_level="warning")
    mine = [p for p in children() if p.pid not in before]
    assert len(mine) >= 2  # scheduler and detokenizer
    e.shutdown()
    gone, alive = psutil.wait_procs(mine, timeout=10)
    assert not alive


def test_a_clean_exit_reports_no_leaked_semaphore(embedded_model_path, tmp_path) -> None:
    """Every server and Engine shutdown printed Python's "resource_tracker: There appear to be 1 leaked semaphore
    objects" warning (the scheduler's tqdm lock, its process stopped by a signal)."""
    import subprocess
    import sys

    script = tmp_path / "clean.py"
    script.write_text(
        "from radixserve import Engine\n"
        "if __name__ == '__main__':\n"
        f"    with Engine(model_path={embedded_model_path!r}, max_total_tokens=512, log_level='warning') as e:\n"
        "        print(e.generate('Hi', {'max_new_tokens': 1})['meta_info']['completion_tokens'], flush=True)\n")
    done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "1", done.stderr[-2000:]
    assert "leaked semaphore" not in done.stderr, done.stderr[-2000:]


def test_children_die_when_the_parent_is_killed(embedded_model_path, tmp_path) -> None:
    """A parent killed with SIGKILL (no chance to clean up) takes its scheduler and detokenizer with it."""
    import signal
    import subprocess
    import sys
    import time

    script = tmp_path / "parent.py"
    script.write_text(
        "import sys, time\n"
        "from radixserve import Engine\n"
        "if __name__ == '__main__':\n"
        f"    e = Engine(model_path={embedded_model_path!r}, max_total_tokens=512, log_level='warning')\n"
        "    print('ready', flush=True)\n"
        "    time.sleep(600)\n")
    parent = subprocess.Popen([sys.executable, str(script)], stdout=subprocess.PIPE, text=True)
    try:
        assert parent.stdout.readline().strip() == "ready"
        kids = psutil.Process(parent.pid).children(recursive=True)
        assert len(kids) >= 2
        parent.send_signal(signal.SIGKILL)
        parent.wait(timeout=10)
        gone, alive = psutil.wait_procs(kids, timeout=15)
        assert not alive, f"orphans left: {[p.pid for p in alive]}"
    finally:
        if parent.poll() is None:
            parent.kill()
        time.sleep(0)


def test_requests_fail_instead_of_hanging_when_the_scheduler_dies(embedded_model_path) -> None:
    e = Engine(model_path=embedded_model_path, max_total_tokens=512, log_level="warning")
    try:
        stream = e.generate("Count to one thousand:", {"max_new_tokens": 400, "temperature": 0}, stream=True)
        next(stream)
        e.processes.procs[0].kill()  # the scheduler
        with pytest.raises(RequestError, match="not running") as info:
            list(stream)
        assert info.value.status_code == 503
        # control requests too, at once (they waited out their timeout: 30 s, a LoRA unload 600 s)
        for control in (e.get_internal_state, e.flush_cache):
            start = time.monotonic()
            with pytest.raises(RequestError, match="not running"):
                control()
            assert time.monotonic() - start < 10
    finally:
        e.shutdown()


def test_n_samples_under_overlap_scheduling(embedded_model_path) -> None:
    """The overlap loop (CUDA's default) with a prefill-only request: n > 1 first prefills the shared prompt with
    max_new_tokens 0 (the scheduler used to fail on it and exit), then every sample decodes; the engine stays
    healthy."""
    with Engine(model_path=embedded_model_path, max_total_tokens=2048, log_level="warning",
                enable_overlap_schedule=True) as e:
        outs = e.generate("The capital of France is", {**GREEDY, "n": 3})
        assert len(outs) == 3 and len({o["text"] for o in outs}) == 1 and "Paris" in outs[0]["text"]
        assert e.generate("1, 2, 3,", GREEDY)["meta_info"]["completion_tokens"] == 12
        state = e.get_internal_state()
        assert state["memory_ok"] and state["invariant_violations"] == 0
