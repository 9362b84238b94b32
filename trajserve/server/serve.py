"""`trajserve serve`: load the engine, start its loop thread, run uvicorn.

The socket is bound before uvicorn starts so `--port 0` works: the line
"trajserve serving <model> on http://HOST:PORT" (stderr) names the port.
With --replicas the engines run as Ray actors behind a routing front end
(cluster/launch.py, chosen by server/cli.py); each replica builds its
server with build_server."""
from __future__ import annotations

import argparse
import logging
import os
import signal
import socket
import sys
from dataclasses import dataclass
from pathlib import Path

from trajserve.server.header_limits import MAX_HEADER_BYTES

log = logging.getLogger("trajserve.server")


def served_name(model_path: str) -> str:
    p = Path(model_path)
    return p.stem if p.suffix == ".gguf" else p.name


def check_args(args: argparse.Namespace) -> list[str] | None:
    """The server options' own checks (before anything loads); returns the API keys, if any."""
    if args.max_waiting < 1:
        raise ValueError(f"--max-waiting must be >= 1, got {args.max_waiting}")
    if not 0 <= args.session_ttl < float("inf"):
        raise ValueError(f"--session-ttl must be a finite number of seconds >= 0 (0: never), got {args.session_ttl}")
    if args.max_sessions < 0:
        raise ValueError(f"--max-sessions must be >= 0 (0: no limit), got {args.max_sessions}")
    api_keys = args.api_key or ([os.environ["TRAJSERVE_API_KEY"]] if os.environ.get("TRAJSERVE_API_KEY") else None)
    if api_keys is not None and not all(api_keys):
        raise ValueError("--api-key: a key must not be empty")
    return api_keys


def bind(args: argparse.Namespace) -> socket.socket:
    sock = socket.socket(socket.AF_INET6 if ":" in args.host else socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    try:
        sock.bind((args.host, args.port))
    except OSError as e:
        raise ValueError(f"cannot listen on {args.host}:{args.port}: {e.strerror}") from None
    return sock


@dataclass
class Server:
    """One engine, its loop thread and the app over it."""
    engine: object
    aengine: object
    app: object
    names: list[str]

    def close(self) -> None:
        self.aengine.shutdown()
        if self.aengine.running:
            log.warning("the engine thread did not stop within 30 s; its state is left as it is")
        else:  # nothing steps any more: this thread may touch the engine
            if self.app.state.sessions is not None:
                self.app.state.sessions.shutdown()
            self.engine.close()


def build_server(args: argparse.Namespace, api_keys: list[str] | None = None) -> Server:
    from trajserve.llm import LLM
    from trajserve.server.app import build_app
    from trajserve.server.async_engine import AsyncEngine

    engine = LLM.from_args(args).engine
    names = args.served_model_name or [served_name(engine.model_path)]
    aengine = AsyncEngine(engine, max_waiting=args.max_waiting)
    aengine.start()
    app = build_app(aengine, names, max_body_bytes=args.max_body_bytes, tool_call_parser=args.tool_call_parser,
                    allowed_origins=args.allowed_origins, session_ttl_s=args.session_ttl or None,
                    max_sessions=args.max_sessions or None, api_keys=api_keys)
    return Server(engine, aengine, app, names)


def run_uvicorn(app, sock: socket.socket, name: str, on_stop, detail: str = "") -> int:
    """Serve app on sock until SIGINT / SIGTERM, then on_stop(). detail: said after the address."""
    import uvicorn

    host, port = sock.getsockname()[:2]
    print(f"trajserve serving {name} on http://{host}:{port}{detail}", file=sys.stderr, flush=True)
    # log_config None: uvicorn's loggers go to the root logger, which the log
    # guard (server/log_guard.py) owns -- never a stream handler of their own.
    # h11 buffers at most a request head's worth of bytes before it answers
    # 400 (server/header_limits.py answers 431 for what fits but is too much).
    config = uvicorn.Config(app, log_level="warning", log_config=None, timeout_graceful_shutdown=5,
                            h11_max_incomplete_event_size=MAX_HEADER_BYTES + 16 * 1024)
    # uvicorn shuts down gracefully on SIGINT / SIGTERM, then raises the signal
    # again under the handler found before it started. With the default one the
    # process would die right there, before the engine below is shut down: the
    # sessions' temporary directory would stay behind and queued disk writes
    # would be lost. So the handler it finds only notes the signal.
    # (One that comes before uvicorn has put in its own handlers still stops it.)
    server = uvicorn.Server(config)
    stopped_by: list[int] = []

    def note(signum: int, _frame) -> None:
        stopped_by.append(signum)
        server.should_exit = True

    for sig in (signal.SIGINT, signal.SIGTERM):
        signal.signal(sig, note)
    try:
        server.run(sockets=[sock])
    finally:
        on_stop()
    if stopped_by:
        log.info("stopped by %s", signal.Signals(stopped_by[0]).name)
    return 0


def serve(args: argparse.Namespace) -> int:
    api_keys = check_args(args)
    sock = bind(args)
    server = build_server(args, api_keys)
    return run_uvicorn(server.app, sock, server.names[0], server.close)
