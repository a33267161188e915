"""The `radixserve` console script.

    radixserve serve [--model-path P] [--host H] [--port N] ...   run the HTTP server (every ServerArgs flag)
    radixserve bench-serving --base-url URL ...                    the online serving benchmark
    radixserve version
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> int:
    args = list(sys.argv[1:] if argv is None else argv)
    usage = ("usage: radixserve {serve,bench-serving,version} [options]\n"
             "  serve          run the OpenAI-compatible HTTP server (radixserve serve --help)\n"
             "  bench-serving  benchmark a running server (radixserve bench-serving --help)\n"
             "  version        print the version")
    if not args or args[0] in ("-h", "--help"):
        print(usage)
        return 0 if args else 2
    command, rest = args[0], args[1:]
    if command == "serve":
        from radixserve.launch_server import main as serve_main

        return serve_main(rest)
    if command == "bench-serving":
        from radixserve.bench_serving import main as bench_main

        return bench_main(rest)
    if command == "version":
        import radixserve

        print(radixserve.__version__)
        return 0
    print(f"radixserve: unknown command {command!r}\n{usage}", file=sys.stderr)
    return 2


if __name__ == "__main__":
    sys.exit(main())
