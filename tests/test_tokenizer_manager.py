"""The tokenizer manager over its real ZMQ sockets, with the test playing the scheduler (no model, no process): what
it sends to the scheduler and what its callers get back."""

from __future__ import annotations

import asyncio
import os
from typing import Any

import pytest
import zmq
import zmq.asyncio

from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_manager import TokenizerManager
from radixserve.server_args import ServerArgs


async def _collect(agen: Any) -> list[dict[str, Any]]:
    return [out async for out in agen]


@pytest.mark.parametrize("by", ["job", None], ids=["by-rid", "abort-all"])
@pytest.mark.parametrize("prefill_end", ["length", "abort"], ids=["prefill-ran", "prefill-aborted"])
def test_abort_during_the_shared_prefill_aborts_the_samples(tmp_path: os.PathLike, prefill_end: str,
                                                            by: str | None) -> None:
    """An n > 1 request aborted by its rid while its prompt is prefilled once for its samples (`job-0-prefill`)
    ends aborted, and its samples are never sent, whether the scheduler aborted that prefill or had already run it
    (the abort reached only the prefill, which usually ran to its end in the forward under way, and then both
    samples ran to their max_new_tokens). The same for an abort of everything (abort_all, a SIGTERM's drain)."""
    names = ("scheduler_input", "detokenizer_input", "tokenizer_input")
    port_args = {name: f"ipc://{os.path.join(str(tmp_path), name)}" for name in names}

    async def scenario() -> None:
        ctx = zmq.asyncio.Context()
        scheduler_in = ctx.socket(zmq.PULL)
        scheduler_in.bind(port_args["scheduler_input"])
        tm = TokenizerManager(ServerArgs(skip_tokenizer_init=True), port_args, None, 64, 100)
        to_tm = ctx.socket(zmq.PUSH)
        to_tm.connect(port_args["tokenizer_input"])
        try:
            obj = io.GenerateReqInput(input_ids=[1, 2, 3], rid="job",
                                      sampling_params={"max_new_tokens": 8, "n": 2, "temperature": 1.0})
            task = asyncio.create_task(_collect(tm.generate_request(obj)))
            warm = await asyncio.wait_for(scheduler_in.recv_pyobj(), 5)
            assert warm.rid == "job-0-prefill" and warm.sampling_params.max_new_tokens == 0
            assert tm.abort_named(by, "aborted by /abort_request") == 1  # as POST /abort_request does
            abort = await asyncio.wait_for(scheduler_in.recv_pyobj(), 5)
            assert isinstance(abort, io.AbortReq) and abort.rid == warm.rid
            reason = {"type": "abort", "message": abort.message}
            end = reason if prefill_end == "abort" else {"type": "length", "length": 0}
            to_tm.send_pyobj(io.BatchStrOut([warm.rid], [""], [[]], [end], [{}]))
            outs = await asyncio.wait_for(task, 5)
            assert [o["meta_info"]["finish_reason"] for o in outs] == [reason, reason]
            assert [o["meta_info"]["id"] for o in outs] == ["job-0", "job-1"]
            assert not tm.rid_to_state and not tm.rid_parent and not tm.unsent_aborts
            assert await scheduler_in.poll(200) == 0, "a sample of the aborted request was sent"
        finally:
            tm.send_to_scheduler.close(linger=0)
            tm.recv_from_detokenizer.close(linger=0)
            ctx.destroy(linger=0)

    asyncio.run(scenario())
