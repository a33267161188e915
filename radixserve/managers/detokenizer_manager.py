"""DetokenizerManager: its own process. Turns BatchTokenIDOut into text deltas (BatchStrOut), holding back text
that might be the start of a stop string and trimming a matched stop string from the end."""

from __future__ import annotations

import logging
import signal
from typing import Any

import zmq

from radixserve.managers import io_struct as io
from radixserve.managers.tokenizer_utils import IncrementalDecoder, get_tokenizer
from radixserve.server_args import ServerArgs
from radixserve.utils import get_zmq_socket, kill_itself_when_parent_died

logger = logging.getLogger(__name__)


def _stop_holdback(text: str, stops: list[str]) -> int:
    """Length of the longest suffix of `text` that is a proper prefix of a stop string."""
    best = 0
    for s in stops:
        for k in range(min(len(s) - 1, len(text)), best, -1):
            if text.endswith(s[:k]):
                best = k
                break
    return best


class DecodeState:
    def __init__(self, decoder: IncrementalDecoder) -> None:
        self.decoder = decoder
        self.sent = 0  # characters of decoder.text already sent


class DetokenizerManager:
    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self.states: dict[str, DecodeState] = {}

    def handle(self, out: io.BatchTokenIDOut) -> io.BatchStrOut:
        res = io.BatchStrOut([], [], [], [], [])
        stops_all = out.stop_strs or [[] for _ in out.rids]
        for i, rid in enumerate(out.rids):
            finished = out.finished_reasons[i]
            state = self.states.get(rid)
            if state is None:
                state = DecodeState(IncrementalDecoder(self.tokenizer, out.skip_special_tokens[i],
                                                       out.spaces_between_special_tokens[i]))
                self.states[rid] = state
            state.decoder.add(out.new_token_ids[i], final=finished is not None)
            text = state.decoder.text
            stops = stops_all[i]
            if finished is not None:
                matched = finished.get("matched")
                if isinstance(matched, str) and not out.no_stop_trim[i]:
                    pos = text.find(matched, max(0, state.sent - len(matched)))
                    if pos >= 0:
                        text = text[:pos]
                end = len(text)
                self.states.pop(rid, None)
            else:
                end = len(text) - _stop_holdback(text, stops) if stops else len(text)
            delta = text[state.sent:end] if end > state.sent else ""
            state.sent = max(state.sent, end)
            res.rids.append(rid)
            res.text_deltas.append(delta)
            res.new_token_ids.append(out.new_token_ids[i])
            res.finished_reasons.append(finished)
            res.meta_infos.append(out.meta_infos[i])
        return res


def run_detokenizer_process(server_args: ServerArgs, port_args: dict[str, str], tokenizer_path: str | None,
                            pipe_writer: Any) -> None:
    kill_itself_when_parent_died()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s detokenizer] %(levelname)s %(message)s")
    try:
        tokenizer = get_tokenizer(tokenizer_path, server_args.trust_remote_code) if tokenizer_path else None
        ctx = zmq.Context(2)
        recv = get_zmq_socket(ctx, zmq.PULL, port_args["detokenizer_input"], bind=True)
        send = get_zmq_socket(ctx, zmq.PUSH, port_args["tokenizer_input"], bind=False)
        manager = DetokenizerManager(tokenizer)
        pipe_writer.send({"status": "ready"})
    except Exception as e:
        logger.exception("detokenizer failed to start")
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    while True:
        obj = recv.recv_pyobj()
        try:
            if isinstance(obj, io.BatchTokenIDOut):
                if manager.tokenizer is None:
                    send.send_pyobj(io.BatchStrOut(obj.rids, [""] * len(obj.rids), obj.new_token_ids,
                                                   obj.finished_reasons, obj.meta_infos))
                else:
                    send.send_pyobj(manager.handle(obj))
            else:
                send.send_pyobj(obj)  # control replies pass through
        except Exception:
            logger.exception("detokenizer error")
