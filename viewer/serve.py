"""``ovpipe view RUN [--port P] [--host 127.0.0.1] [--allow-host NAME] [--query-timeout S]``: serve the viewer
over a run folder with uvicorn.

Loopback by default: another address is bound only when ``--host`` names it. Requests are answered only for
a ``Host`` header of 127.0.0.1, localhost, [::1], the ``--host`` address, or a name given with
``--allow-host`` (so a DNS-rebinding page reads nothing). The process only reads; stop it with Ctrl-C or
SIGTERM by its PID: either interrupts the queries in flight, so it exits within a few seconds even mid-query.
"""
from __future__ import annotations

import argparse
import contextlib
import os
import socket
import sys
import threading
from pathlib import Path

DEFAULT_HOST = "127.0.0.1"
DEFAULT_PORT = 8765


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="ovpipe view", description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("run_dir", help="the run folder to browse")
    p.add_argument("--host", default=DEFAULT_HOST, help=f"address to bind (default {DEFAULT_HOST}: this machine only)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT}; 0: any free one)")
    p.add_argument("--memory-limit", default="1GB", help="DuckDB's memory limit for the server's queries")
    p.add_argument("--query-timeout", type=float, default=30.0,
                   help="seconds a query may run before it is stopped (default 30)")
    p.add_argument("--allow-host", action="append", default=[],
                   help="a Host name to answer besides loopback and --host (repeatable), e.g. the machine's name "
                        "when --host 0.0.0.0")
    return p


def allowed_hosts(host: str, extra: list[str]) -> list[str]:
    """The ``Host`` names the server answers: loopback, the bound address unless a wildcard, and ``extra``."""
    from viewer.app import LOOPBACK_HOSTS

    bound = [] if host in ("0.0.0.0", "::", "") else [f"[{host}]" if ":" in host else host]
    return list(dict.fromkeys([*LOOPBACK_HOSTS, *bound, *extra]))


@contextlib.contextmanager
def serving_in_thread(app):
    """Serve ``app`` with uvicorn on a free loopback port in a thread of this process (tests, benches): its base
    URL, the server stopped on exit."""
    import uvicorn

    sock = socket.socket()
    sock.bind((DEFAULT_HOST, 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning"))
    t = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    t.start()
    while not server.started:
        t.join(0.05)
    try:
        yield f"http://{DEFAULT_HOST}:{sock.getsockname()[1]}"
    finally:
        server.should_exit = True
        t.join(10)


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from viewer.app import create_app

    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        print(f"ovpipe view: {args.run_dir}: no such run folder", file=sys.stderr)
        return 2
    if not args.query_timeout > 0:
        print(f"ovpipe view: --query-timeout {args.query_timeout}: give a number of seconds > 0", file=sys.stderr)
        return 2
    app = create_app(run_dir, memory_limit=args.memory_limit, allowed_hosts=allowed_hosts(args.host, args.allow_host),
                     query_timeout=args.query_timeout)
    # The socket is bound here, so the line below names the address really bound (--port 0: the free port
    # the system chose), and a port in use fails before uvicorn starts.
    family = socket.AF_INET6 if ":" in args.host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        print(f"ovpipe view: cannot listen on {args.host}:{args.port}: {e.strerror or e}", file=sys.stderr)
        return 2
    host, port = sock.getsockname()[:2]
    catalog = app.state.catalog

    class Server(uvicorn.Server):
        def handle_exit(self, sig, frame):          # SIGINT / SIGTERM: stop the queries the requests wait on
            super().handle_exit(sig, frame)
            catalog.interrupt_all()

    server = Server(uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5))
    print(f"ovpipe view: {run_dir} on http://{host}:{port}/ (pid {os.getpid()}; Ctrl-C stops it)", flush=True)
    server.run(sockets=[sock])
    return 0
