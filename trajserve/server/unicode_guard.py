"""Request bodies whose strings are not valid Unicode are a 400 naming the field.

JSON lets a string hold a lone UTF-16 surrogate ("h\\ud800i"), and Python's
json module decodes one (and raw surrogate bytes, which it reads with
surrogatepass). Such a str cannot be encoded as UTF-8: the tokenizer raised
a TypeError deep in a handler, the client got a 500, and the next request on
that keep-alive connection was reset. This middleware looks for the two
byte patterns that can produce one; only a body that has one is parsed, to
name the first field that holds a bad string, so ordinary requests pay a
byte scan and nothing more.
"""
from __future__ import annotations

import json
import re
from collections.abc import Callable

from starlette.responses import Response

# A \uD800-\uDFFF escape, or the UTF-8-style bytes of a surrogate (ED A0..BF xx).
_MAYBE = re.compile(rb"\\u[dD][89a-fA-F][0-9a-fA-F]{2}|\xed[\xa0-\xbf]")


def _bad(s: str) -> bool:
    try:
        s.encode("utf-8")
        return False
    except UnicodeEncodeError:
        return True


def first_bad_field(value, path: str = "") -> str | None:
    """The dotted path (messages.0.content) of the first string, or key, that is not valid Unicode."""
    if isinstance(value, str):
        return (path or "body") if _bad(value) else None
    if isinstance(value, dict):
        for k, v in value.items():
            here = f"{path}.{k}" if path else str(k)
            if _bad(k):
                return path or "body"
            found = first_bad_field(v, here)
            if found is not None:
                return found
    elif isinstance(value, list):
        for i, v in enumerate(value):
            found = first_bad_field(v, f"{path}.{i}" if path else str(i))
            if found is not None:
                return found
    return None


class UnicodeGuard:
    def __init__(self, app, respond: Callable[[int, str, str | None, str], Response]) -> None:
        """respond(status, message, param, path): the error in the path's API's shape."""
        self.app, self.respond = app, respond

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http" or scope.get("method") not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        messages, more = [], True
        while more:
            m = await receive()
            messages.append(m)
            more = m["type"] == "http.request" and m.get("more_body", False)
        body = b"".join(m.get("body", b"") for m in messages if m["type"] == "http.request")
        if _MAYBE.search(body):
            try:
                field = first_bad_field(json.loads(body))
            except ValueError:
                field = None  # not JSON: the app's own parser answers that
            if field is not None:
                msg = f"{field}: the string is not valid Unicode (a lone UTF-16 surrogate); send UTF-8 text"
                return await self.respond(400, msg, field, scope.get("path", ""))(scope, receive, send)
        replay = [{"type": "http.request", "body": body, "more_body": False}]
        replay += [m for m in messages if m["type"] != "http.request"]

        async def replayed():
            return replay.pop(0) if replay else await receive()
        await self.app(scope, replayed, send)
