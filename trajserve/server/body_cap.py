"""A cap on request bodies, counted as they arrive.

The Content-Length header alone is not enough: a chunked body has none,
and would be read whole. So the body's messages are counted on the way in;
once they pass the cap, the app's response (it is reading a body it cannot
finish) is replaced by the 413."""
from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response


class BodyTooLarge(Exception):
    pass


class BodyCap:
    def __init__(self, app, max_bytes: int, respond: Callable[[int, str, str], Response]) -> None:
        """respond(status, message, path): the error response in the shape the path's API uses."""
        self.app, self.max_bytes, self.respond = app, max_bytes, respond

    def _message(self, size: int, arrived: bool = False) -> str:
        if arrived:  # reading stopped at the cap
            return f"request body is over the limit of {self.max_bytes:,} bytes ({size:,} read when it stopped)"
        return f"request body has {size:,} bytes; the limit is {self.max_bytes:,}"

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        path = scope.get("path", "")
        length = dict(scope.get("headers") or []).get(b"content-length", b"")
        if length.isdigit() and int(length) > self.max_bytes:
            return await self.respond(413, self._message(int(length)), path)(scope, receive, send)
        seen = 0
        over = False
        started = False

        async def counted():
            nonlocal seen, over
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    over = True
                    raise BodyTooLarge
            return message

        async def guarded_send(message) -> None:
            nonlocal started
            if over:  # whatever the app answers to a body it could not finish
                return
            started = True
            await send(message)

        try:
            await self.app(scope, counted, guarded_send)
        except BodyTooLarge:
            pass
        except Exception:
            if not over:
                raise
        if over and not started:
            await self.respond(413, self._message(seen, arrived=True), path)(scope, receive, send)
