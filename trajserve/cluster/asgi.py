"""Call an ASGI app in-process and stream its response out.

A replica (cluster/replica.py) runs the single-engine server's whole app
(server/app.py: every route, its checks, errors and middleware) and is
handed each HTTP request as bytes through Ray; this turns one request into
the app's response messages as they come: first (status, headers), then
the body's chunks. No socket is opened, so replicas need no ports of their
own and work across machines over Ray's transport.

httpx's ASGITransport would do the call but reads the whole body before
returning, which would hold a stream's tokens until it ends.
"""
from __future__ import annotations

import asyncio
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass

log = logging.getLogger("trajserve.cluster")


@dataclass(frozen=True, slots=True)
class HttpRequest:
    """What the front end forwards: a request as it arrived, body read."""
    method: str
    path: str
    query: bytes = b""
    headers: tuple[tuple[bytes, bytes], ...] = ()
    body: bytes = b""


@dataclass(frozen=True, slots=True)
class ResponseStart:
    status: int
    headers: tuple[tuple[bytes, bytes], ...]


async def call(app, req: HttpRequest, disconnected: asyncio.Event | None = None
               ) -> AsyncIterator[ResponseStart | bytes]:
    """The app's answer to req: a ResponseStart, then body chunks (bytes).
    disconnected, when set, tells the app its client left (a streaming route
    stops and aborts its request). Closing this iterator early does the same."""
    gone = disconnected or asyncio.Event()
    out: asyncio.Queue = asyncio.Queue()
    sent_body = False

    async def receive() -> dict:
        nonlocal sent_body
        if not sent_body:
            sent_body = True
            return {"type": "http.request", "body": req.body, "more_body": False}
        await gone.wait()
        return {"type": "http.disconnect"}

    async def send(message: dict) -> None:
        await out.put(message)

    scope = {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": req.method,
             "scheme": "http", "path": req.path, "raw_path": req.path.encode(), "query_string": req.query,
             "root_path": "", "headers": list(req.headers), "client": ("127.0.0.1", 0),
             "server": ("trajserve-replica", 0)}

    async def run() -> None:
        try:
            await app(scope, receive, send)
        finally:
            await out.put(None)  # the app returned (or raised): no more messages

    task = asyncio.create_task(run())
    try:
        while True:
            message = await out.get()
            if message is None:
                break
            if message["type"] == "http.response.start":
                yield ResponseStart(message["status"], tuple((bytes(k), bytes(v))
                                                              for k, v in message.get("headers", ())))
            elif message["type"] == "http.response.body":
                if message.get("body"):
                    yield bytes(message["body"])
                if not message.get("more_body", False):
                    break
        try:
            await task
        except Exception:  # noqa: BLE001 - the app answered it already (its error middleware sent a 500)
            log.exception("a request raised after its response")  # no client text (its path) in the log
    finally:
        if not task.done():  # the caller stopped reading: the client is gone
            gone.set()
            try:
                await asyncio.wait_for(task, 5.0)
            except (asyncio.TimeoutError, Exception):  # noqa: BLE001 - the app's own cleanup failed; nothing to send
                task.cancel()
