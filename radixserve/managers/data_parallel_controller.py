"""The data-parallel controller process (node 0, --dp-size > 1): it binds the tokenizer manager's
`scheduler_input` socket and routes each generate request to one replica (dp_routing); aborts, cache flushes and
internal-state queries go to every replica, and the replies of the last two are merged into one. The processes are
started by dp_launcher."""

from __future__ import annotations

import logging
import signal
from collections import deque
from typing import Any

import zmq

from radixserve.managers import io_struct as io
from radixserve.managers.dp_routing import LoadBalancer
from radixserve.server_args import ServerArgs
from radixserve.utils import get_zmq_socket, kill_itself_when_parent_died

logger = logging.getLogger(__name__)


# ===================================================================== merging control replies
_SUMMED = ("invariant_violations", "free_tokens", "evictable_tokens", "protected_tokens", "max_total_num_tokens",
           "num_running_reqs", "num_waiting_reqs", "num_grammar_queue_reqs", "num_retractions", "cache_hit_tokens",
           "prompt_tokens_total", "forward_ct", "grammar_compiles", "grammar_cache_hits", "grammar_errors",
           "grammar_compile_time_s", "grammar_cache_entries", "lora_slot_loads")


def merge_internal_states(states: list[dict[str, Any]]) -> dict[str, Any]:
    """One state for the whole engine from the replicas' states: counts summed, `idle` / `memory_ok` only when
    every replica says so, `last_step_time` the stalest busy replica's (for the watchdog); keys this does not
    know come from replica 0. Each replica's own state is under `dp_states`."""
    if not states:
        raise ValueError("no state to merge")
    merged = dict(states[0])
    for key in _SUMMED:
        vals = [s.get(key) for s in states]
        if all(isinstance(v, int | float) and not isinstance(v, bool) for v in vals):
            merged[key] = sum(vals)
    merged["idle"] = all(s.get("idle", True) for s in states)
    oks = [s.get("memory_ok") for s in states]
    merged["memory_ok"] = None if any(v is None for v in oks) else all(oks)
    ratios = [s["new_token_ratio"] for s in states if "new_token_ratio" in s]
    if ratios:
        merged["new_token_ratio"] = max(ratios)
    busy_times = [s["last_step_time"] for s in states if not s.get("idle", True) and "last_step_time" in s]
    all_times = [s["last_step_time"] for s in states if "last_step_time" in s]
    if busy_times or all_times:
        merged["last_step_time"] = min(busy_times) if busy_times else max(all_times)
    merged["pids"] = [s.get("pid") for s in states]
    merged["dp_size"] = len(states)
    merged["dp_states"] = states
    return merged


# ===================================================================== the controller process
class DataParallelController:
    """Receives what the tokenizer manager sends to "the scheduler" and spreads it over the replicas."""

    def __init__(self, server_args: ServerArgs, port_args: dict[str, str], replica_port_args: list[dict[str, str]],
                 capacities: list[int] | None = None) -> None:
        self.dp_size = len(replica_port_args)
        self.balancer = LoadBalancer(server_args.load_balance_method, self.dp_size, capacities,
                                     server_args.balance_abs_threshold, server_args.balance_rel_threshold)
        self.ctx = zmq.Context(2)
        self.recv_from_tokenizer = get_zmq_socket(self.ctx, zmq.PULL, port_args["scheduler_input"], bind=True)
        self.send_to_tokenizer = get_zmq_socket(self.ctx, zmq.PUSH, port_args["tokenizer_input"], bind=False)
        self.send_to_replicas = [get_zmq_socket(self.ctx, zmq.PUSH, p["scheduler_input"], bind=False)
                                 for p in replica_port_args]
        self.recv_from_replicas = [get_zmq_socket(self.ctx, zmq.PULL, p["controller_input"], bind=True)
                                   for p in replica_port_args]
        # replies per type, per replica, in arrival order; merged once every replica has answered
        self.replies: dict[tuple[type, int], list[deque[Any]]] = {}

    def event_loop(self) -> None:
        poller = zmq.Poller()
        poller.register(self.recv_from_tokenizer, zmq.POLLIN)
        for sock in self.recv_from_replicas:
            poller.register(sock, zmq.POLLIN)
        while True:
            events = dict(poller.poll())
            for i, sock in enumerate(self.recv_from_replicas):  # fresh loads before routing
                if sock in events:
                    for obj in _drain(sock):
                        self.handle_replica_message(i, obj)
            if self.recv_from_tokenizer in events:
                for obj in _drain(self.recv_from_tokenizer):
                    self.handle_request(obj)

    def handle_request(self, obj: Any) -> None:
        try:
            if isinstance(obj, io.TokenizedGenerateReqInput):
                self.send_to_replicas[self.balancer.select(obj.input_ids)].send_pyobj(obj)
            else:  # aborts (the request may be on any replica), cache flushes, state queries, anything new
                for sock in self.send_to_replicas:
                    sock.send_pyobj(obj)
        except Exception:  # the controller never dies on one message
            logger.exception("data-parallel controller failed to route %s", type(obj).__name__)

    def handle_replica_message(self, replica: int, obj: Any) -> None:
        if isinstance(obj, io.SchedulerLoadReport):
            self.balancer.on_report(replica, obj)
            return
        key = (type(obj), getattr(obj, "seq", 0))  # replies to one request (they may come in another order)
        queues = self.replies.setdefault(key, [deque() for _ in range(self.dp_size)])
        queues[replica].append(obj)
        if all(queues):
            parts = [q.popleft() for q in queues]
            if not any(queues):
                del self.replies[key]
            self.send_to_tokenizer.send_pyobj(self.merge_replies(parts))

    def merge_replies(self, parts: list[Any]) -> Any:
        first = parts[0]
        if isinstance(first, io.GetInternalStateReqOutput):
            state = merge_internal_states([p.state for p in parts])
            state.update(self.balancer.stats())
            return io.GetInternalStateReqOutput(state=state, seq=first.seq)
        if isinstance(first, io.FlushCacheReqOutput):
            ok = all(p.success for p in parts)
            msg = "" if ok else f"{sum(not p.success for p in parts)} of {len(parts)} replicas were busy"
            return io.FlushCacheReqOutput(success=ok, message=msg, seq=first.seq)
        return first


def _drain(sock: zmq.Socket) -> list[Any]:
    out = []
    while True:
        try:
            out.append(sock.recv_pyobj(zmq.NOBLOCK))
        except zmq.ZMQError:
            return out


def run_data_parallel_controller_process(server_args: ServerArgs, port_args: dict[str, str],
                                         replica_port_args: list[dict[str, str]], capacities: list[int],
                                         pipe_writer: Any) -> None:
    kill_itself_when_parent_died()
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=server_args.log_level.upper(),
                        format="[%(asctime)s DP controller] %(levelname)s %(message)s")
    try:
        controller = DataParallelController(server_args, port_args, replica_port_args, capacities)
        pipe_writer.send({"status": "ready"})
    except Exception as e:
        logger.exception("the data-parallel controller failed to start")
        pipe_writer.send({"status": "error", "message": f"{type(e).__name__}: {e}"})
        return
    controller.event_loop()
