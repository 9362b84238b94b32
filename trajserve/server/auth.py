"""API keys (`serve --api-key`, as vLLM's): every /v1 route wants one of
the keys, sent as OpenAI clients send it (`Authorization: Bearer KEY`) or as
Anthropic's do (`x-api-key: KEY`). /health, /metrics, /tokenize,
/detokenize and /version stay open, as in vLLM (probes and scrapers carry no
key), and so do CORS preflights (browsers send them without credentials).
The route list (/openapi.json, and /docs, /redoc where an app serves them)
wants a key too: it tells a caller which routes exist.

An ASGI middleware rather than a FastAPI dependency, so an unknown /v1 path
is refused before it can tell a caller which routes exist."""
from __future__ import annotations

import hmac
from collections.abc import Callable

from starlette.types import ASGIApp, Receive, Scope, Send


# Besides /v1: what describes the API.
GUARDED = ("/openapi.json", "/docs", "/redoc")


def guarded(path: str) -> bool:
    return path.startswith("/v1") or path.startswith(GUARDED)


class ApiKeyAuth:
    def __init__(self, app: ASGIApp, keys: list[str], respond: Callable) -> None:
        if not keys or any(not k for k in keys):
            raise ValueError("an API key must not be empty")
        self.app = app
        self.keys = [k.encode() for k in keys]
        self.respond = respond  # (status, message, path) -> Response in the path's error shape

    def _allowed(self, scope: Scope) -> bool:
        headers = dict(scope.get("headers") or [])
        auth = headers.get(b"authorization", b"")
        given = [auth[7:].strip()] if auth[:7].lower() == b"bearer " else []
        if b"x-api-key" in headers:
            given.append(headers[b"x-api-key"].strip())
        # compare_digest: the time taken says nothing about how much of a key matched.
        return any(hmac.compare_digest(g, k) for g in given for k in self.keys)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        path = scope.get("path", "")
        if scope["type"] != "http" or scope.get("method") == "OPTIONS" or not guarded(path) \
                or self._allowed(scope):
            await self.app(scope, receive, send)
            return
        response = self.respond(401, "missing or wrong API key: send 'Authorization: Bearer KEY' or "
                                     "'x-api-key: KEY' (serve --api-key)", path)
        await response(scope, receive, send)
