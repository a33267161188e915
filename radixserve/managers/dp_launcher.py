"""Launching the scheduler ranks of tensor / data parallelism (and the data-parallel controller).

Layout of one deployment (`--dp-size D --tp-size T --nnodes N`):

- D replicas, each its own torch.distributed world of T scheduler processes (TP ranks). Replica i joins at
  `--dist-init-addr` host:port + i (a free local port per replica when the flag is not given, single node only).
  Each node runs T / N ranks of every replica; node 0 holds every replica's rank 0, which alone talks ZMQ: it
  receives the requests and broadcasts them to its replica's other ranks over torch.distributed, and sends the
  outputs to the detokenizer.
- With D > 1, node 0 also runs the controller process (data_parallel_controller).
- DP attention (`--enable-dp-attention`, D == T, one node): one world of T ranks; TP rank i is also DP replica i
  (it has its own request sockets and answers its own requests), so the controller routes to the ranks.
- Nodes other than 0 serve nothing: `python -m radixserve.launch_server --node-rank K ...` runs their ranks
  (`run_worker_node`) until it is stopped or one of them dies.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing as mp
import os
import signal
import time
from typing import Any

from radixserve.managers import io_struct as io
from radixserve.managers.data_parallel_controller import run_data_parallel_controller_process
from radixserve.server_args import ServerArgs
from radixserve.utils import free_port

logger = logging.getLogger(__name__)


START_TIMEOUT_S = 1800.0


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


def require_head_node(server_args: ServerArgs) -> None:
    """An Engine or HTTP server runs on node 0; other nodes run only their scheduler ranks."""
    if server_args.node_rank != 0:
        raise ValueError("a node with --node-rank > 0 runs only its scheduler ranks: start it with "
                         "`python -m radixserve.launch_server --node-rank K ...`, not as an Engine")


def launch_parallel_schedulers(server_args: ServerArgs, port_args: dict[str, str], ctx: Any,
                               procs: list[mp.Process]) -> list[io.SchedulerInfo]:
    """Start this node's scheduler ranks of every DP replica (and, on node 0 with --dp-size > 1, the controller),
    appending each process to `procs` as soon as it starts; return when all are ready. Returns the SchedulerInfo
    of each replica's rank 0 on node 0, else of each local rank (an Engine checks `require_head_node` first)."""
    from radixserve.managers.scheduler import run_scheduler_process

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
    dp_attention = server_args.enable_dp_attention
    for i in range(dp):
        # each replica is its own world: its own address (set before the children copy the args); with DP
        # attention the replicas are the ranks of one world
        args_i = dataclasses.replace(server_args, dist_init_addr=addrs[0 if dp_attention else i]) if tp > 1 \
            else server_args
        pargs = replica_port_args[i] if is_head else {}
        ranks = [i] if dp_attention else range(first, first + per_node)
        for tp_rank in ranks:
            gpu_id = server_args.base_gpu_id + (i if dp_attention else i * per_node + (tp_rank - first))
            reader, writer = ctx.Pipe(duplex=False)
            name = f"radixserve-scheduler-dp{i}-tp{tp_rank}" if dp > 1 else f"radixserve-scheduler-tp{tp_rank}"
            proc = ctx.Process(target=run_scheduler_process, args=(args_i, pargs, tp_rank, gpu_id, writer),
                               daemon=True, name=name)
            proc.start()
            procs.append(proc)
            starting.append(_Starting(proc, reader, f"scheduler (DP {i}, TP rank {tp_rank})"))
    msgs = _wait_all_ready(starting)
    infos: list[io.SchedulerInfo] = [m["info"] for m in msgs]
    if is_head and not dp_attention:
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
        launch_parallel_schedulers(server_args, {}, ctx, procs)
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
