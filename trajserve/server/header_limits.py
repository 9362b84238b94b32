"""Limits on request headers: 431 Request Header Fields Too Large.

A header is kept in memory for the whole request and walked by every
middleware; a client has no need for ten thousand of them or for a 100 KB
line. The limits are Apache's field count (100) and a line size a few
times nginx's default buffer, enough for long bearer tokens. The HTTP
server's own parser bounds what it buffers before the app sees anything
(server/serve.py passes it MAX_HEADER_BYTES)."""
from __future__ import annotations

from collections.abc import Callable

from starlette.responses import Response

MAX_HEADERS = 100
MAX_HEADER_LINE_BYTES = 16 * 1024  # one field: name and value
MAX_HEADER_BYTES = 64 * 1024       # all fields together


def header_problem(headers) -> str | None:
    """What is over a limit in these (name, value) byte pairs, or None."""
    if len(headers) > MAX_HEADERS:
        return f"the request has {len(headers):,} header fields; at most {MAX_HEADERS} are allowed"
    total = 0
    for name, value in headers:
        size = len(name) + len(value)
        if size > MAX_HEADER_LINE_BYTES:
            # Names come from a token alphabet (no control characters); cut short all the same.
            return (f"header field {name[:64].decode('latin-1')!r} has {size:,} bytes; at most "
                    f"{MAX_HEADER_LINE_BYTES:,} are allowed per field")
        total += size
    if total > MAX_HEADER_BYTES:
        return f"the request's header fields have {total:,} bytes together; at most {MAX_HEADER_BYTES:,} are allowed"
    return None


class HeaderLimits:
    def __init__(self, app, respond: Callable[[int, str, str], Response]) -> None:
        """respond(status, message, path): the error response in the shape the path's API uses."""
        self.app, self.respond = app, respond

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] == "http":
            problem = header_problem(scope.get("headers") or [])
            if problem is not None:
                return await self.respond(431, problem, scope.get("path", ""))(scope, receive, send)
        await self.app(scope, receive, send)
