"""Small process and socket helpers shared by the entry points and managers."""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import socket
import threading
import time

import zmq

logger = logging.getLogger(__name__)


def get_zmq_socket(ctx: zmq.Context, kind: int, endpoint: str, bind: bool) -> zmq.Socket:
    sock = ctx.socket(kind)
    sock.setsockopt(zmq.LINGER, 0)
    if kind in (zmq.PUSH, zmq.DEALER):
        sock.setsockopt(zmq.SNDHWM, 0)
    if kind in (zmq.PULL, zmq.DEALER):
        sock.setsockopt(zmq.RCVHWM, 0)
    if bind:
        sock.bind(endpoint)
    else:
        sock.connect(endpoint)
    return sock


def kill_itself_when_parent_died() -> None:
    """Make this child process die with its parent: PR_SET_PDEATHSIG where Linux offers it, and a watcher thread
    (covers the parent being killed with SIGKILL before the prctl, and non-Linux systems)."""
    parent = os.getppid()
    try:
        libc = ctypes.CDLL("libc.so.6", use_errno=True)
        libc.prctl(1, signal.SIGKILL)  # PR_SET_PDEATHSIG
    except OSError:
        pass

    def watch() -> None:
        while True:
            if os.getppid() != parent:
                os._exit(0)
            time.sleep(0.5)

    threading.Thread(target=watch, daemon=True, name="parent-watch").start()


def free_port(host: str = "127.0.0.1") -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind((host, 0))
        return s.getsockname()[1]


def kill_process_tree(pid: int, include_parent: bool = True, timeout: float = 5.0) -> None:
    """Terminate `pid`'s children (and itself), then SIGKILL whatever is left after `timeout`."""
    import psutil

    try:
        parent = psutil.Process(pid)
    except psutil.NoSuchProcess:
        return
    procs = parent.children(recursive=True)
    if include_parent:
        procs.append(parent)
    for p in procs:
        try:
            p.terminate()
        except psutil.NoSuchProcess:
            pass
    _, alive = psutil.wait_procs(procs, timeout=timeout)
    for p in alive:
        try:
            p.kill()
        except psutil.NoSuchProcess:
            pass


def log_safe(text: str) -> str:
    """`text` from a client (a path, a rid) for a log line: control characters escaped as Python writes them
    (`\\n`, `\\x1b`), so that it can neither end the line nor forge another."""
    if text.isprintable():
        return text
    return "".join(ch if ch.isprintable() else repr(ch)[1:-1] for ch in text)
