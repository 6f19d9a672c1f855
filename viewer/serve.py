"""``ovpipe view RUN [--port P] [--host 127.0.0.1]``: serve the viewer over a run folder with uvicorn.

Loopback by default: another host is served only when ``--host`` names it. The process only reads; stop it
with Ctrl-C (or by its PID).
"""
from __future__ import annotations

import argparse
import os
import socket
import sys
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
    return p


def main(argv: list[str] | None = None) -> int:
    import uvicorn

    from viewer.app import create_app

    args = build_parser().parse_args(argv)
    run_dir = Path(args.run_dir).expanduser().resolve()
    if not run_dir.is_dir():
        print(f"ovpipe view: {args.run_dir}: no such run folder", file=sys.stderr)
        return 2
    app = create_app(run_dir, memory_limit=args.memory_limit)
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
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", access_log=False))
    print(f"ovpipe view: {run_dir} on http://{host}:{port}/ (pid {os.getpid()}; Ctrl-C stops it)", flush=True)
    server.run(sockets=[sock])
    return 0
