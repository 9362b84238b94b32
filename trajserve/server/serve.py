"""`trajserve serve`: load the engine, start its loop thread, run uvicorn.

The socket is bound before uvicorn starts so `--port 0` works: the line
"trajserve serving <model> on http://HOST:PORT" (stderr) names the port.
With --replicas the engines run as Ray actors behind a routing front end
(cluster/launch.py, chosen by trajserve/cli.py); each replica builds its
server with build_server."""
from __future__ import annotations

import argparse
import logging
import signal
import socket
import sys
from dataclasses import dataclass

from trajserve.server.config import ServerConfig
from trajserve.server.header_limits import MAX_HEADER_BYTES

log = logging.getLogger("trajserve.server")


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


def build_server(args: argparse.Namespace, config: ServerConfig) -> Server:
    """The engine of args' engine options, and the app over it under config."""
    from trajserve.llm import LLM
    from trajserve.server.app import build_app

    if getattr(args, "slo", None) is not None:  # calibrate, choose, maybe rebuild (server/slo_choice.py)
        from trajserve.server.slo_choice import build_for_slo

        engine, said = build_for_slo(args, args.slo)
        print(said, file=sys.stderr, flush=True)
    else:
        engine = LLM.from_args(args).engine
    app = build_app(engine, config)
    if (said := config.generation.describe()) is not None:
        print(f"generation defaults: {said} (--override-generation-config: for requests that name none; "
              "max_new_tokens caps every reply)", file=sys.stderr, flush=True)
    if config.admission != "off":
        cap = (f"at most {config.admission} requests in the engine" if config.admission != "auto" else
               "where goodput under the SLO starts to fall, from this engine's step times once it has run steps of "
               "three batch sizes")
        print(f"admission: {cap}; one more gets 429 with Retry-After (--admission)", file=sys.stderr, flush=True)
    app.state.engine.start()
    return Server(engine, app.state.engine, app, app.state.server.names)


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
    config = ServerConfig.from_args(args)
    sock = bind(args)
    server = build_server(args, config)
    return run_uvicorn(server.app, sock, server.names[0], server.close)
