"""Launching the scheduler ranks of tensor / data parallelism, and the data-parallel controller.

Layout of one deployment (`--dp-size D --tp-size T --nnodes N`):

- D replicas, each its own torch.distributed world of T scheduler processes (TP ranks). Replica i joins at
  `--dist-init-addr` host:port + i (a free local port per replica when the flag is not given, single node only).
  Each node runs T / N ranks of every replica; node 0 holds every replica's rank 0, which alone talks ZMQ: it
  receives the requests and broadcasts them to its replica's other ranks over torch.distributed, and sends the
  outputs to the detokenizer.
- With D > 1, node 0 also runs the controller process: it binds the tokenizer manager's `scheduler_input` socket
  and routes each generate request to one replica (round_robin | shortest_queue | cache_aware); aborts, cache
  flushes and internal-state queries go to every replica, and the replies of the last two are merged into one.
- Nodes other than 0 serve nothing: `python -m radixserve.launch_server --node-rank K ...` runs their ranks
  (`run_worker_node`) until it is stopped or one of them dies.
"""

from __future__ import annotations

import dataclasses
import heapq
import logging
import multiprocessing as mp
import os
import signal
import time
from collections import deque
from typing import Any

import zmq

from radixserve.managers import io_struct as io
from radixserve.server_args import ServerArgs
from radixserve.utils import free_port, get_zmq_socket, kill_itself_when_parent_died

logger = logging.getLogger(__name__)

START_TIMEOUT_S = 1800.0


# ===================================================================== an approximate prefix tree per replica
class _Node:
    __slots__ = ("key", "children", "parent", "last_access")

    def __init__(self, key: list[int], parent: _Node | None) -> None:
        self.key = key
        self.children: dict[int, _Node] = {}
        self.parent = parent
        self.last_access = 0


def _common_prefix_len(a: list[int], b: list[int], start: int) -> int:
    """Length of the common prefix of `a` and `b[start:]`."""
    n = min(len(a), len(b) - start)
    i = 0
    while i < n and a[i] == b[start + i]:
        i += 1
    return i


class ApproxPrefixTree:
    """The token ids of the prompts routed to one replica, as a radix tree with LRU eviction down to `capacity`
    tokens: an estimate of what that replica's RadixCache holds, kept without asking it."""

    def __init__(self, capacity: int | None = None) -> None:
        if capacity is not None and capacity <= 0:
            raise ValueError(f"capacity must be positive, got {capacity}")
        self.capacity = capacity
        self.root = _Node([], None)
        self.size = 0
        self._clock = 0

    def match(self, tokens: list[int]) -> int:
        """Length of the longest prefix of `tokens` in the tree."""
        node, pos = self.root, 0
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                break
            n = _common_prefix_len(child.key, tokens, pos)
            pos += n
            if n < len(child.key):
                break
            node = child
        return pos

    def insert(self, tokens: list[int]) -> int:
        """Add `tokens`, mark its path most recently used, evict if over capacity; returns the length that was
        already there."""
        self._clock += 1
        node, pos = self.root, 0
        node.last_access = self._clock
        already = len(tokens)
        while pos < len(tokens):
            child = node.children.get(tokens[pos])
            if child is None:
                already = pos
                leaf = _Node(list(tokens[pos:]), node)
                leaf.last_access = self._clock
                node.children[tokens[pos]] = leaf
                self.size += len(leaf.key)
                break
            n = _common_prefix_len(child.key, tokens, pos)
            if n < len(child.key):  # split the edge: node -> mid (key[:n]) -> child (key[n:])
                mid = _Node(child.key[:n], node)
                node.children[tokens[pos]] = mid
                child.key = child.key[n:]
                child.parent = mid
                mid.children[child.key[0]] = child
                mid.last_access = child.last_access
                child = mid
            child.last_access = self._clock
            pos += n
            node = child
        if self.capacity is not None and self.size > self.capacity:
            self.evict(self.size - int(self.capacity * 0.9))
        return already

    def evict(self, num_tokens: int) -> int:
        """Drop least recently used leaves until `num_tokens` tokens are gone (or the tree is empty)."""
        heap: list[tuple[int, int, _Node]] = []
        stack = [self.root]
        while stack:
            n = stack.pop()
            if not n.children and n is not self.root:
                heap.append((n.last_access, id(n), n))
            stack.extend(n.children.values())
        heapq.heapify(heap)
        freed = 0
        while heap and freed < num_tokens:
            _, _, leaf = heapq.heappop(heap)
            parent = leaf.parent
            if parent is None:
                continue
            del parent.children[leaf.key[0]]
            freed += len(leaf.key)
            self.size -= len(leaf.key)
            if not parent.children and parent is not self.root:
                heapq.heappush(heap, (parent.last_access, id(parent), parent))
        return freed


# ===================================================================== routing
class LoadBalancer:
    """Picks a replica for each request. Loads are request counts: the replica's last report plus the requests
    routed to it that it had not taken in at the time of that report."""

    def __init__(self, method: str, dp_size: int, capacities: list[int] | None = None, abs_threshold: int = 8,
                 rel_threshold: float = 1.5) -> None:
        if method not in ("round_robin", "shortest_queue", "cache_aware"):
            raise ValueError(f"unknown load balance method {method!r}")
        if dp_size < 1:
            raise ValueError(f"dp_size must be positive, got {dp_size}")
        self.method = method
        self.dp_size = dp_size
        self.abs_threshold, self.rel_threshold = abs_threshold, rel_threshold
        caps = capacities or [None] * dp_size  # type: ignore[list-item]
        self.trees = [ApproxPrefixTree(c) for c in caps] if method == "cache_aware" else []
        self.next_rr = 0
        self.routed = [0] * dp_size
        self.reported = [(0, 0)] * dp_size  # (num_reqs, num_received) from the replicas' last reports
        self.cache_routed = 0  # requests sent where their prefix was

    def on_report(self, replica: int, report: io.SchedulerLoadReport) -> None:
        self.reported[replica] = (report.num_reqs, report.num_received)

    def loads(self) -> list[int]:
        return [n + max(0, self.routed[i] - recv) for i, (n, recv) in enumerate(self.reported)]

    def _round_robin(self, among: list[int] | None = None) -> int:
        """The next replica in turn (restricted to `among` when given)."""
        for k in range(self.dp_size):
            i = (self.next_rr + k) % self.dp_size
            if among is None or i in among:
                self.next_rr = (i + 1) % self.dp_size
                return i
        raise ValueError("no replica to choose from")

    def _shortest(self, loads: list[int], among: list[int] | None = None) -> int:
        cands = among if among is not None else list(range(self.dp_size))
        low = min(loads[i] for i in cands)
        return self._round_robin([i for i in cands if loads[i] == low])

    def select(self, input_ids: list[int]) -> int:
        if self.method == "round_robin":
            choice = self._round_robin()
        elif self.method == "shortest_queue":
            choice = self._shortest(self.loads())
        else:
            choice = self._cache_aware(input_ids)
        self.routed[choice] += 1
        return choice

    def _cache_aware(self, input_ids: list[int]) -> int:
        loads = self.loads()
        matches = [t.match(input_ids) for t in self.trees]
        best_len = max(matches)
        choice = None
        if best_len > 0:
            best = [i for i in range(self.dp_size) if matches[i] == best_len]
            cand = self._shortest(loads, best)
            low = min(loads)
            overloaded = loads[cand] - low > self.abs_threshold and loads[cand] > low * self.rel_threshold
            if not overloaded:
                choice = cand
                self.cache_routed += 1
        if choice is None:
            choice = self._shortest(loads)
        self.trees[choice].insert(input_ids)
        return choice

    def stats(self) -> dict[str, Any]:
        return {"load_balance_method": self.method, "dp_routed": list(self.routed), "dp_loads": self.loads(),
                "dp_cache_routed": self.cache_routed}


# ===================================================================== merging control replies
_SUMMED = ("invariant_violations", "free_tokens", "evictable_tokens", "protected_tokens", "max_total_num_tokens",
           "num_running_reqs", "num_waiting_reqs", "num_retractions", "cache_hit_tokens", "prompt_tokens_total",
           "forward_ct")


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
        self.replies: dict[type, list[deque[Any]]] = {}

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
        queues = self.replies.setdefault(type(obj), [deque() for _ in range(self.dp_size)])
        queues[replica].append(obj)
        if all(queues):
            parts = [q.popleft() for q in queues]
            self.send_to_tokenizer.send_pyobj(self.merge_replies(parts))

    def merge_replies(self, parts: list[Any]) -> Any:
        first = parts[0]
        if isinstance(first, io.GetInternalStateReqOutput):
            state = merge_internal_states([p.state for p in parts])
            state.update(self.balancer.stats())
            return io.GetInternalStateReqOutput(state=state)
        if isinstance(first, io.FlushCacheReqOutput):
            ok = all(p.success for p in parts)
            msg = "" if ok else f"{sum(not p.success for p in parts)} of {len(parts)} replicas were busy"
            return io.FlushCacheReqOutput(success=ok, message=msg)
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


# ===================================================================== launching
@dataclasses.dataclass
class _Starting:
    proc: mp.Process
    reader: Any
    what: str


def _wait_all_ready(starting: list[_Starting], timeout: float = START_TIMEOUT_S) -> list[dict[str, Any]]:
    """Wait for every process's readiness message; fail as soon as any of them dies or reports an error (a TP
    rank waits for its peers, so waiting on one process at a time could block on a dead sibling)."""
    results: list[dict[str, Any] | None] = [None] * len(starting)
    deadline = time.monotonic() + timeout
    while any(r is None for r in results):
        for i, s in enumerate(starting):
            if results[i] is not None:
                continue
            if s.reader.poll(0.2):
                msg = s.reader.recv()
                if msg.get("status") != "ready":
                    raise RuntimeError(f"the {s.what} process failed to start: {msg.get('message')}")
                results[i] = msg
            elif not s.proc.is_alive():
                raise RuntimeError(f"the {s.what} process died during start-up (exit code {s.proc.exitcode})")
        if time.monotonic() > deadline:
            waiting = [s.what for s, r in zip(starting, results, strict=True) if r is None]
            raise RuntimeError(f"not ready within {timeout:.0f} s: {', '.join(waiting)} (with --nnodes > 1: are "
                               "the other nodes started, and can they reach --dist-init-addr?)")
    return [r for r in results if r is not None]


def replica_dist_addrs(server_args: ServerArgs) -> list[str]:
    """host:port of each DP replica's TP world: --dist-init-addr's port + replica index, or free local ports."""
    if server_args.dist_init_addr:
        host, _, port = server_args.dist_init_addr.rpartition(":")
        return [f"{host}:{int(port) + i}" for i in range(server_args.dp_size)]
    if server_args.nnodes > 1:
        raise ValueError("--dist-init-addr host:port is required with --nnodes > 1")
    return [f"127.0.0.1:{free_port()}" for _ in range(server_args.dp_size)]


def launch_parallel_schedulers(server_args: ServerArgs, port_args: dict[str, str], ctx: Any,
                               procs: list[mp.Process], serving: bool = True) -> list[io.SchedulerInfo]:
    """Start this node's scheduler ranks of every DP replica (and, on node 0 with --dp-size > 1, the controller),
    appending each process to `procs` as soon as it starts; return when all are ready. Returns the SchedulerInfo
    of each replica's rank 0 on node 0, else of each local rank. `serving=False` on nodes other than 0."""
    from radixserve.managers.scheduler import run_scheduler_process

    if serving and server_args.node_rank != 0:
        raise ValueError("a node with --node-rank > 0 runs only its scheduler ranks: start it with "
                         "`python -m radixserve.launch_server --node-rank K ...`, not as an Engine")
    tp, dp, nnodes = server_args.tp_size, server_args.dp_size, server_args.nnodes
    per_node = tp // nnodes
    first = server_args.node_rank * per_node
    addrs = replica_dist_addrs(server_args)
    is_head = server_args.node_rank == 0
    replica_port_args: list[dict[str, str]] = []
    if dp > 1 and is_head:
        ipc_dir = server_args.make_ipc_dir()
        for i in range(dp):
            replica_port_args.append({
                "scheduler_input": f"ipc://{os.path.join(ipc_dir, f'dp{i}_scheduler_input')}",
                "controller_input": f"ipc://{os.path.join(ipc_dir, f'dp{i}_controller_input')}",
                "detokenizer_input": port_args["detokenizer_input"],
                "tokenizer_input": port_args["tokenizer_input"],
            })
    elif is_head:
        replica_port_args.append(port_args)

    starting: list[_Starting] = []
    for i in range(dp):
        # each replica is its own world: its own address (set before the children copy the args)
        args_i = dataclasses.replace(server_args, dist_init_addr=addrs[i]) if tp > 1 else server_args
        pargs = replica_port_args[i] if is_head else {}
        for tp_rank in range(first, first + per_node):
            gpu_id = server_args.base_gpu_id + i * per_node + (tp_rank - first)
            reader, writer = ctx.Pipe(duplex=False)
            name = f"radixserve-scheduler-dp{i}-tp{tp_rank}" if dp > 1 else f"radixserve-scheduler-tp{tp_rank}"
            proc = ctx.Process(target=run_scheduler_process, args=(args_i, pargs, tp_rank, gpu_id, writer),
                               daemon=True, name=name)
            proc.start()
            procs.append(proc)
            starting.append(_Starting(proc, reader, f"scheduler (DP {i}, TP rank {tp_rank})"))
    msgs = _wait_all_ready(starting)
    infos: list[io.SchedulerInfo] = [m["info"] for m in msgs]
    if is_head:
        infos = infos[::per_node]  # rank 0 of each replica
    if dp > 1 and is_head:
        reader, writer = ctx.Pipe(duplex=False)
        proc = ctx.Process(target=run_data_parallel_controller_process,
                           args=(server_args, port_args, replica_port_args,
                                 [info.max_total_num_tokens for info in infos], writer),
                           daemon=True, name="radixserve-dp-controller")
        proc.start()
        procs.append(proc)
        _wait_all_ready([_Starting(proc, reader, "data-parallel controller")])
    logger.info("%d scheduler process(es) ready (dp %d x tp %d on %d node(s), this is node %d)", len(starting), dp,
                tp, nnodes, server_args.node_rank)
    return infos


def run_worker_node(server_args: ServerArgs) -> int:
    """The whole job of a node with --node-rank > 0: run its scheduler ranks until SIGTERM / SIGINT (exit 0) or
    until one of them dies (exit 1, after stopping the others)."""
    from radixserve.entrypoints.engine import resolve_model

    logging.basicConfig(level=server_args.log_level.upper(),
                        format=f"[%(asctime)s node {server_args.node_rank}] %(levelname)s %(message)s")
    if server_args.node_rank == 0:
        raise ValueError("node 0 serves the API: launch it as a server, not as a worker node")
    resolve_model(server_args)
    ctx = mp.get_context("spawn")
    procs: list[mp.Process] = []
    stop: list[bool] = []
    started: list[bool] = []

    def on_signal(*_: Any) -> None:
        stop.append(True)
        if not started:  # still waiting for the ranks (and the other nodes): give up now
            raise SystemExit(0)

    signal.signal(signal.SIGTERM, on_signal)
    signal.signal(signal.SIGINT, on_signal)
    code = 0
    try:
        launch_parallel_schedulers(server_args, {}, ctx, procs, serving=False)
        started.append(True)
        logger.info("node %d of %d: %d rank(s) running; stop with SIGTERM", server_args.node_rank,
                    server_args.nnodes, len(procs))
        while not stop:
            dead = [p for p in procs if not p.is_alive()]
            if dead:
                logger.critical("node %d: %s exited (code %s); stopping this node's other ranks",
                                server_args.node_rank, dead[0].name, dead[0].exitcode)
                code = 1
                break
            time.sleep(0.5)
    except RuntimeError as e:
        logger.critical("node %d failed to start: %s", server_args.node_rank, e)
        code = 1
    finally:
        for p in procs:
            if p.is_alive():
                p.terminate()
        for p in procs:
            p.join(timeout=10)
            if p.is_alive():
                p.kill()
                p.join(timeout=5)
    return code
