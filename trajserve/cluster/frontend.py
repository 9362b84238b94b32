"""The cluster's front end: one OpenAI-compatible HTTP server over N engine
replicas (Ray actors, cluster/replica.py), routing each request by the
policies of cluster/router.py.

Every endpoint of the single-engine server is served: a request is read
whole here (under the body cap), its route key taken (cluster/route_key.py),
and handed as bytes to the chosen replica, which runs it through its own
copy of the server's app and streams the answer back. So the replicas give
every check, error and stream exactly as one server does; this file only
decides where a request goes and what happens when a replica dies.

Where a request goes:
  generation    the router's choice for its prompt's block hashes, session and
                load (kv: the prefix directory fed by the replicas' KV events,
                which ride on every response and on a poll every `poll_s`)
  a session's   GET / DELETE /v1/sessions/{id}, its forks: where it lives
  a response's  GET / DELETE /v1/responses/{id}, previous_response_id: where
                it is stored (learned from the reply that created it)
  LoRA loads    every replica (the first refusal is the answer)
  the rest      the least loaded healthy replica
Load, per replica: the tokens of the requests in flight there that it has
still to compute (the prompt past what the directory says it holds, and the
max_tokens asked for), counted here as requests go and come back.

Failover. A replica whose call fails with Ray's actor errors (the process
died, was killed, its node went away) is marked down and forgotten by the
directory; Ray restarts it (max_restarts), and the poll marks it up again,
empty, once it answers. The request that met the failure is sent to another
healthy replica (waiting up to `restart_wait_s` for one if none is), so no
request is silently lost: a non-streaming one is answered whole by whichever
replica completes it; a stream is moved only while nothing of it has reached
the client, and one that already sent tokens ends with an error event (as
OpenAI's API ends a failed stream). A session whose replica died moves with
its next turn and recomputes its context there.

A client that leaves a stream cancels the replica's call, which aborts its
request there; a non-streaming request whose client leaves runs to its end
(the front end learns of the leaving only when it answers).
"""
from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import re
from collections import OrderedDict
from collections.abc import AsyncIterator, Sequence

from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Counter, generate_latest
from prometheus_client.parser import text_string_to_metric_families

from trajserve.cluster.asgi import HttpRequest, ResponseStart
from trajserve.cluster.directory import prompt_hashes
from trajserve.cluster.replica import Report, ReplicaInfo
from trajserve.cluster.replicas import ReplicaDown, ReplicaSet, ReplicaState
from trajserve.cluster.route_key import RouteKey, route_key
from trajserve.cluster.router import KVRouter, ReplicaLoad, RouteRequest, Router
from trajserve.kv.scope import CacheScope, namespace_of
from trajserve.server import anthropic
from trajserve.server.errors import error_response
from trajserve.server.config import DEFAULT, ServerConfig
from trajserve.server.metrics import LogCollector
from trajserve.server.tap import sse_event

log = logging.getLogger("trajserve.cluster")
# Headers not passed on: hop-by-hop, or recomputed for the new message.
_DROP = {b"host", b"connection", b"keep-alive", b"transfer-encoding", b"te", b"upgrade", b"content-length"}
_RESPONSE_ID = re.compile(rb'"id"\s*:\s*"(resp_[0-9A-Za-z_-]{1,200})"')
DEFAULT_OUTPUT_TOKENS = 128  # a request's expected output when it gives no max_tokens (load estimate only)
MAX_OWNERS = 100_000  # stored responses and sessions remembered (oldest forgotten first)


class Frontend:
    def __init__(self, actors: Sequence, router: Router, tokenizer, *, restart_wait_s: float = 120.0,
                 poll_s: float = 0.5) -> None:
        self.router, self.tok = router, tokenizer
        r = self.registry = CollectorRegistry()
        self.replicas = ReplicaSet(actors, router.directory if isinstance(router, KVRouter) else None, r,
                                   poll_s, restart_wait_s)
        self.info: ReplicaInfo | None = None  # model id, block size, adapters: the same on every replica
        self.response_owner: OrderedDict[str, int] = OrderedDict()
        self.m_routed = Counter("trajserve_router_requests", "requests sent to each replica", ["replica"], registry=r)
        self.m_retried = Counter("trajserve_router_retries", "requests sent again after their replica died",
                                 registry=r)
        self.m_broken = Counter("trajserve_router_broken_streams",
                                "streams ended with an error event: their replica died after tokens were sent",
                                registry=r)
        self.m_prompt = Counter("trajserve_router_prompt_tokens", "prompt tokens routed", registry=r)
        self.m_matched = Counter("trajserve_router_matched_tokens",
                                 "prompt tokens the directory said the chosen replica held (kv router)", registry=r)
        r.register(LogCollector())

    async def start(self) -> None:
        self.info = (await self.replicas.start())[0]

    async def stop(self) -> None:
        await self.replicas.stop()

    # ------------------------------------------------------------ routing
    def _loads(self, exclude: set[int]) -> list[ReplicaLoad]:
        return [ReplicaLoad(running_tokens=r.tokens, healthy=r.healthy and r.index not in exclude,
                            requests=r.in_flight) for r in self.replicas]

    def _hashes(self, key: RouteKey) -> list[bytes]:
        info = self.info
        if key.token_ids is None or info is None:
            return []
        digest = info.adapters.get(key.model) if key.model is not None else None
        # Without the last token: a replica computes at least that one (its
        # logits give the first output), so a block ending on it is never a hit.
        return prompt_hashes(namespace_of(info.model_id, CacheScope(key.cache_salt, digest)), key.token_ids[:-1],
                             info.block_size)

    def _choose(self, key: RouteKey, exclude: set[int]) -> tuple[int, int, RouteRequest | None]:
        """(replica, the work this request adds there in tokens, what the router
        was shown: it is told when the request is done)."""
        loads = self._loads(exclude)
        if key.kind == "session" or key.kind == "response":
            j = self.router.sessions.get(key.session_id) if key.kind == "session" \
                else self.response_owner.get(key.response_id)
            if j is not None and loads[j].healthy:
                return j, 0, None
        if key.kind != "prompt":
            healthy = [r.index for r in self.replicas if loads[r.index].healthy]
            return min(healthy, key=lambda i: (loads[i].tokens, loads[i].requests, i)), 0, None
        n = len(key.token_ids or ())
        output = key.max_tokens or DEFAULT_OUTPUT_TOKENS
        if key.response_id is not None:  # its conversation lives with the stored response
            j = self.response_owner.get(key.response_id)
            if j is not None and loads[j].healthy:
                return j, n + output, None
        hashes = self._hashes(key)
        view = RouteRequest(hashes, n, key.token_ids or (), key.session_id)
        if isinstance(self.router, KVRouter):  # what the chosen replica holds, before this request's promise
            matched = {j: self.router.match_tokens(j, hashes) for j in range(len(loads)) if loads[j].healthy}
        j = self.router.route(view, loads)
        while len(self.router.sessions) > MAX_OWNERS:  # client-chosen ids: the oldest placements go first
            self.router.end_session(next(iter(self.router.sessions)))
        m = int(matched[j]) if isinstance(self.router, KVRouter) else 0
        self.m_prompt.inc(n)
        self.m_matched.inc(min(m, n))
        return j, max(0, n - m) + output, view

    async def _pick(self, key: RouteKey, exclude: set[int]) -> tuple[int, int, RouteRequest | None]:
        """A healthy replica not in exclude (those this request died on); if
        only those are up (they restarted since), them; if none is, wait for one."""
        while True:
            if any(r.healthy and r.index not in exclude for r in self.replicas):
                return self._choose(key, exclude)
            if not self.replicas.healthy:
                await self.replicas.wait_up()
            exclude.clear()

    # ------------------------------------------------------------ requests
    def _learn(self, key: RouteKey, j: int, path: str, status: int, head: bytes) -> None:
        """Where a stored response, a new fork or a closed session lives now."""
        if status != 200:
            return
        if path == "/v1/responses":
            m = _RESPONSE_ID.search(head)
            if m:
                self._remember(self.response_owner, m.group(1).decode(), j)
        elif key.kind == "session" and path.endswith("/fork"):
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                for sid in json.loads(head).get("forks", []):
                    self.router.sessions[str(sid)] = j
                    self.router.session_tokens.setdefault(str(sid), 0)
        elif key.kind == "session" and key.session_id is not None and path.startswith("/v1/sessions/") \
                and not path.endswith("/fork") and b'"deleted"' in head:
            self.router.end_session(key.session_id)
        elif key.kind == "response" and b'"deleted"' in head:
            self.response_owner.pop(key.response_id, None)

    @staticmethod
    def _remember(table: OrderedDict, k: str, j: int) -> None:
        table[k] = j
        table.move_to_end(k)
        while len(table) > MAX_OWNERS:
            table.popitem(last=False)

    async def forward(self, request: Request) -> Response:
        body = await request.body()
        path = request.url.path
        headers = {k.decode("latin-1").lower(): v.decode("latin-1") for k, v in request.headers.raw}
        # Rendering and tokenizing a long prompt takes milliseconds: not on the event loop.
        key = await asyncio.to_thread(route_key, request.method, path, body, headers, self.tok)
        hreq = HttpRequest(request.method, path, request.url.query.encode(),
                           tuple((k, v) for k, v in request.headers.raw if k.lower() not in _DROP), body)
        if key.kind == "all":
            return await self._broadcast(hreq)
        exclude: set[int] = set()
        tries = len(self.replicas) + 2  # a request that kills every replica it meets stops here
        for _ in range(tries):
            try:
                j, work, view = await self._pick(key, exclude)
            except ReplicaDown as e:
                return error_response(503, f"no replica can serve: {e}", "server_error", path=path)
            r = self.replicas[j]
            r.in_flight += 1
            r.tokens += work
            r.routed += 1
            self.m_routed.labels(str(j)).inc()
            handed_over = False  # a stream gives the in-flight count back when it ends
            try:
                gen = self.replicas.open(r, hreq)
                start, first = await self.replicas.head(r, gen)
                if not (key.stream and start.status == 200):
                    whole = first + await self.replicas.rest(r, gen)
                    self._learn(key, j, path, start.status, whole)
                    return Response(whole, start.status, headers=_headers(start, j))
                self._learn(key, j, path, start.status, first)  # a stream's first event names its response
                handed_over = True
                done = _Once(lambda: self._done(r, work, view))
                return _Stream(self._stream(r, gen, first, done, path), done, start.status,
                               headers=_headers(start, j))
            except ReplicaDown:
                self.replicas.mark_down(r)
                exclude.add(j)
                self.m_retried.inc()
                # The route kind, not the path: no client text in a log line.
                log.warning("a %s request: replica %d died under it; sending it to another", key.kind, j)
            finally:
                if not handed_over:
                    self._done(r, work, view)
        return error_response(503, f"the request failed on {tries} replicas in turn, each dying under it",
                              "server_error", path=path)

    def _done(self, r: ReplicaState, work: int, view: RouteRequest | None) -> None:
        r.in_flight -= 1
        r.tokens -= work
        if view is not None:
            self.router.done(view, r.index)

    async def _stream(self, r: ReplicaState, gen, first: bytes, done: _Once, path: str) -> AsyncIterator[bytes]:
        """The rest of a stream. Each chunk is held until the next comes, so
        the last one (the end of the reply) reaches the client only after
        the report carrying this turn's KV events is applied: the next turn
        is routed knowing where this one's blocks are."""
        held = first
        finished = False
        try:
            while True:
                try:
                    item = await self.replicas.next(r, gen)
                except ReplicaDown:
                    self.replicas.mark_down(r)
                    self.m_broken.inc()
                    if held:
                        yield held
                    held = b""
                    yield _stream_error(path, f"replica {r.index} stopped while streaming this reply; "
                                              "send the request again")
                    finished = True
                    return
                if item is None:
                    break
                if isinstance(item, Report):
                    self.replicas.apply(r, item)
                    continue
                if held:
                    yield held
                held = item
            if held:
                yield held
            finished = True
        finally:
            done()
            if not finished:  # the client left: cancelling the call aborts the replica's request
                with contextlib.suppress(Exception):
                    import ray

                    ray.cancel(gen)

    async def _broadcast(self, hreq: HttpRequest) -> Response:
        """To every healthy replica; the first refusal (or else the first answer) is the reply."""
        live = self.replicas.healthy
        if not live:
            return error_response(503, "no replica is serving", "server_error", path=hreq.path)
        got = await asyncio.gather(*(self.replicas.fetch(r, hreq) for r in live), return_exceptions=True)
        answers = []
        for r, g in zip(live, got):
            if isinstance(g, ReplicaDown):
                self.replicas.mark_down(r)
            elif isinstance(g, BaseException):
                raise g
            else:
                answers.append((r.index, g))
        if not answers:
            return error_response(503, "no replica answered", "server_error", path=hreq.path)
        if any(start.status == 200 for _, (start, _) in answers):  # the adapters (and their digests) changed
            with contextlib.suppress(ReplicaDown, asyncio.TimeoutError):
                self.info = await self.replicas.call(self.replicas[answers[0][0]], "info", timeout=30.0)
        j, (start, body) = next((a for a in answers if a[1][0].status != 200), answers[0])
        return Response(body, start.status, headers=_headers(start, j))

    # --------------------------------------------------------- own routes
    def health(self) -> Response:
        n = len(self.replicas.healthy)
        if not n:
            return error_response(503, "no replica is serving", "server_error")
        return JSONResponse({"status": "ok", "replicas": len(self.replicas), "healthy": n})

    def describe(self) -> dict:
        """GET /v1/replicas: each replica's health, where it runs, what it was sent and its last report."""
        return {"object": "list", "router": self.router.name,
                "directory_hashes": len(self.router.directory) if isinstance(self.router, KVRouter) else None,
                "data": [{"index": r.index, "healthy": r.healthy, "pid": r.info.pid if r.info else None,
                          "node": r.info.node if r.info else None, "routed": r.routed, "in_flight": r.in_flight,
                          "running": r.running, "waiting": r.waiting, "kv_usage": r.kv_usage,
                          "failures": r.failures} for r in self.replicas]}

    async def metrics(self) -> Response:
        """The front end's counters, then each healthy replica's own metrics with a replica label."""
        out = [generate_latest(self.registry).decode()]
        for r in self.replicas.healthy:
            try:
                _, text = await self.replicas.fetch(r, HttpRequest("GET", "/metrics"))
            except ReplicaDown:
                self.replicas.mark_down(r)
                continue
            out.append(_labelled(text.decode(), r.index))
        return Response("".join(out), media_type=CONTENT_TYPE_LATEST)


class _Once:
    """A cleanup that runs once, from whichever end comes first."""

    def __init__(self, fn) -> None:
        self.fn = fn

    def __call__(self) -> None:
        fn, self.fn = self.fn, None
        if fn is not None:
            fn()


class _Stream(StreamingResponse):
    """A stream whose in-flight accounting ends even if its body never starts
    (the client left between the head and the first chunk: the body
    generator then never runs, so its own finally would not either)."""

    def __init__(self, content, done: _Once, status_code: int, headers: dict) -> None:
        super().__init__(content, status_code, headers=headers)
        self.done = done

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            self.done()


def _headers(start: ResponseStart, j: int) -> dict[str, str]:
    out = {k.decode("latin-1"): v.decode("latin-1") for k, v in start.headers if k.lower() not in _DROP}
    out["x-trajserve-replica"] = str(j)
    return out


def _labelled(text: str, replica: int) -> str:
    """A replica's exposition text with replica="j" on every sample."""
    lines = []
    for fam in text_string_to_metric_families(text):
        for s in fam.samples:
            labels = {**s.labels, "replica": str(replica)}
            inner = ",".join(f'{k}="{_escape(v)}"' for k, v in labels.items())
            lines.append(f"{s.name}{{{inner}}} {s.value!r}\n")
    return "".join(lines)


def _escape(v: str) -> str:
    return v.replace("\\", "\\\\").replace("\n", "\\n").replace('"', '\\"')


def _stream_error(path: str, message: str) -> bytes:
    if path.startswith("/v1/messages"):
        return sse_event("error", anthropic.error_body(503, message)).encode()
    if path.startswith("/v1/responses"):
        return sse_event("error", {"message": message}).encode()
    body = {"message": message, "type": "server_error", "param": None, "code": None}
    return f"data: {json.dumps({'error': body})}\n\ndata: [DONE]\n\n".encode()


def build_frontend(frontend: Frontend, config: ServerConfig = DEFAULT) -> FastAPI:
    """The routing app over frontend: the server's outer middleware under
    config (body cap, API keys, CORS, header limits)."""
    from trajserve.server.app import add_outer_middleware

    @contextlib.asynccontextmanager
    async def lifespan(_app):
        await frontend.start()
        yield
        await frontend.stop()

    app = FastAPI(title="trajserve cluster", docs_url=None, redoc_url=None, lifespan=lifespan)
    app.state.frontend = frontend

    @app.api_route("/", methods=["GET", "HEAD"])
    async def root():  # clients probe the base URL first (Claude Code: HEAD /), as a replica answers
        return {"server": "trajserve"}

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        return frontend.health()

    @app.get("/metrics")
    async def metrics():
        return await frontend.metrics()

    @app.get("/v1/replicas")
    async def replicas():
        return frontend.describe()

    @app.api_route("/{path:path}", methods=["GET", "POST", "DELETE", "PUT", "PATCH"])
    async def forward(request: Request):
        return await frontend.forward(request)

    add_outer_middleware(app, config)
    return app

