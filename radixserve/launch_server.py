"""`python -m radixserve.launch_server [--model-path P] [--host H] [--port N] ...`: serve the HTTP API.

Takes every ServerArgs flag (`--help` lists them). Without --model-path it serves the embedded SmolLM2-135M-Instruct.
With `--nnodes N --node-rank K --dist-init-addr HOST:PORT`, node 0 serves HTTP and runs its share of the TP ranks;
a node K > 0 starts no server: it runs its ranks until SIGTERM, or exits 1 when one of them dies.
"""

from __future__ import annotations

import logging
import os
import sys

from radixserve.server_args import prepare_server_args


def main(argv: list[str] | None = None) -> int:
    try:
        server_args = prepare_server_args(argv)
    except ValueError as e:  # a flag that parses but does not validate
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 2
    if server_args.node_rank > 0:  # multi-node: only node 0 serves; the others run their scheduler ranks
        from radixserve.managers.dp_launcher import run_worker_node

        return run_worker_node(server_args)
    from radixserve.entrypoints.http_server import launch_server

    try:
        code = launch_server(server_args)
    except (RuntimeError, ValueError) as e:
        print(f"radixserve: error: {e}", file=sys.stderr)
        return 1
    if code != 0:
        # a child process died and the server stopped its siblings: exit now, for a supervisor to restart us (the
        # interpreter's own teardown of torch and friends can take several seconds on a busy machine)
        logging.shutdown()
        sys.stdout.flush()
        sys.stderr.flush()
        os._exit(code)
    return code


if __name__ == "__main__":
    sys.exit(main())
