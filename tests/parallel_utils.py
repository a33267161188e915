"""Helpers shared by the tensor-parallel, data-parallel and multi-node tests."""

from __future__ import annotations

import time
from typing import Any

from model_utils import make_tiny_model

# Weights spread wider than transformers' default (std 0.02), so greedy continuations are varied rather than one
# token repeated, and logits far apart (a different summation order under TP cannot flip an argmax).
INIT_RANGE = 0.3
SERVER_KW = dict(skip_tokenizer_init=True, device="cpu", dtype="float32", max_total_tokens=2048, log_level="warning")


def make_model(kind: str, path: str, seed: int = 0, **over: Any) -> str:
    make_tiny_model(kind, path, seed=seed, initializer_range=INIT_RANGE, **over)
    return path


def reference_outputs(path: str, prompts: list[list[int]], sampling: dict[str, Any], **server_kw: Any
                      ) -> list[list[int]]:
    """What one TP=1 scheduler in this process generates for each prompt (alone, no prefix cache); `server_kw`: more
    ServerArgs fields."""
    from radixserve.managers import io_struct as io
    from radixserve.managers.scheduler import Scheduler
    from radixserve.sampling.sampling_params import SamplingParams
    from radixserve.server_args import ServerArgs

    kw = {k: v for k, v in SERVER_KW.items() if k != "log_level"} | server_kw
    sched = Scheduler(ServerArgs(model_path=path, disable_radix_cache=True, **kw), port_args={})
    outs = []
    for i, prompt in enumerate(prompts):
        sched.process_input_requests([io.TokenizedGenerateReqInput(
            rid=f"ref{i}", input_text=None, input_ids=list(prompt),
            sampling_params=SamplingParams.from_dict(dict(sampling)))])
        for _ in range(10_000):
            if not sched.step() and sched.is_idle():
                break
        ids: list[int] = []
        for msg in sched.outbox:
            if isinstance(msg, io.BatchTokenIDOut):
                for new in msg.new_token_ids:
                    ids += new
        sched.outbox.clear()
        outs.append(ids)
    return outs


def tp2_and_tp1_outputs(path: str, prompts: list[list[int]], max_new_tokens: int = 12, **engine_kw: Any
                        ) -> tuple[list[list[int]], list[list[int]]]:
    """Greedy tokens of `prompts` from a TP=2 Engine over gloo (`engine_kw`: more server arguments, e.g. ep_size),
    and from one TP=1 scheduler (`reference_outputs`)."""
    from radixserve import Engine

    sampling = {"max_new_tokens": max_new_tokens, "temperature": 0, "ignore_eos": True}
    want = reference_outputs(path, prompts, sampling)
    with Engine(model_path=path, tp_size=2, **SERVER_KW, **engine_kw) as engine:
        got = engine.generate(input_ids=prompts, sampling_params=sampling)
    return [o["output_ids"] for o in got], want


def wait_idle(engine: Any, timeout: float = 30.0) -> dict[str, Any]:
    """The engine's internal state once every scheduler reports idle (finished requests leave the running batch
    one step after their last token is sent)."""
    deadline = time.monotonic() + timeout
    while True:
        state = engine.get_internal_state()
        if state["idle"] or time.monotonic() > deadline:
            return state
        time.sleep(0.05)
