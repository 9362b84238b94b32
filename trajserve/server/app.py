"""OpenAI-compatible HTTP API over an AsyncEngine (FastAPI).

    GET  /health                 200 while the engine loop runs, else 503
    GET  /v1/models
    POST /v1/completions         prompt: text, token ids, or a list of texts
    POST /v1/chat/completions    the model's chat template
    POST /v1/messages            Anthropic's Messages API (server/anthropic.py)
    POST /v1/messages/count_tokens
    POST /v1/responses           OpenAI's Responses API (server/responses.py)
    GET / DELETE /v1/responses/{id}
    GET  /metrics                Prometheus
    POST /tokenize, /detokenize  vLLM's: a prompt or chat messages to token ids, and back
    GET  /version
    GET / DELETE /v1/sessions/{id}, POST /v1/sessions/{id}/fork
    POST /v1/load_lora_adapter, /v1/unload_lora_adapter   (server/routes/lora.py)

build_app puts them together: the routers of server/routes/ over one
ServerState (server/state.py), the error handlers of server/errors.py, and
the middleware (Unicode guard, body cap, API keys, CORS).
"""
from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.middleware.cors import CORSMiddleware

from trajserve.engine.memory import bytes_per_block
from trajserve.server.async_engine import AsyncEngine
from trajserve.server.auth import ApiKeyAuth
from trajserve.server.body_cap import BodyCap
from trajserve.server.errors import error_response, install_handlers
from trajserve.server.header_limits import HeaderLimits
from trajserve.server.metrics import ServerMetrics
from trajserve.server.routes import admin, chat, completions, lora, messages, responses, sessions
from trajserve.server.state import ServerState, calls_format_for
from trajserve.server.unicode_guard import UnicodeGuard
from trajserve.sessions.manager import SessionManager

log = logging.getLogger("trajserve")


def _calibrate(sessions: SessionManager) -> None:
    # A failed measurement leaves the default rates; it must not stop the engine loop.
    try:
        sessions.calibrate()  # logs what it measured and what it checked
    except Exception:  # noqa: BLE001
        log.exception("keep policy calibration failed; using default rates")


def add_outer_middleware(app: FastAPI, max_body_bytes: int, api_keys: list[str] | None,
                         allowed_origins) -> None:
    """The body cap, API keys, CORS and the header limits, outermost last:
    the server's and the cluster front end's (cluster/frontend.py), which
    reads a body whole."""
    app.add_middleware(BodyCap, max_bytes=max_body_bytes,
                       respond=lambda status, message, path: error_response(status, message, path=path))
    if api_keys:
        app.add_middleware(ApiKeyAuth, keys=list(api_keys), respond=lambda status, message, path: error_response(
            status, message, code="invalid_api_key", path=path))
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])
    app.add_middleware(HeaderLimits, respond=lambda status, message, path: error_response(status, message,
                                                                                          path=path))


def build_app(aengine: AsyncEngine, served_model_name: str | list[str], max_body_bytes: int = 8 * 2**20,
              tool_call_parser: str = "auto", allowed_origins: list[str] | tuple[str, ...] = ("*",),
              session_ttl_s: float | None = 3600.0, max_sessions: int | None = 4096,
              api_keys: list[str] | None = None) -> FastAPI:
    """served_model_name: the model id clients send; several are aliases
    (the first is the one replies name). allowed_origins: the browser
    origins CORS lets call the API (vLLM's default: any). session_ttl_s,
    max_sessions: when session records are closed (None: never), since
    clients that send a session_id need not DELETE it. api_keys: if given,
    /v1 routes want one of them (server/auth.py)."""
    names = [served_model_name] if isinstance(served_model_name, str) else list(served_model_name)
    engine = aengine.engine
    calls_format = calls_format_for(engine.tokenizer, tool_call_parser)  # a bad name fails before anything starts
    if engine.lora is not None:  # a request's model field names the base model or an adapter, never both
        clash = sorted(set(names) & set(engine.lora.adapters))
        if clash:
            raise ValueError(f"--lora-modules: {', '.join(clash)} is also a served model name")
        engine.lora.reserved = set(names)
    metrics = ServerMetrics(lambda: aengine.snapshot,
                            bytes_per_block(engine.model_config, engine.kv.block_size, engine.kv_format))
    aengine.on_finished = metrics.observe
    # Touched only on the engine thread (through aengine.call / submit).
    manager = SessionManager(engine, idle_ttl_s=session_ttl_s, max_sessions=max_sessions) \
        if engine.kv.prefix_caching else None
    state = ServerState(aengine, names, metrics, manager, calls_format)
    if manager is not None:
        aengine.extra_metrics = lambda: {"sessions": manager.metrics()}
        # On the engine thread, before the first request (calibrate skips its
        # prefill if one got in first: it must not step other requests).
        aengine.submit(lambda _: _calibrate(manager))
    app = FastAPI(title="trajserve", docs_url=None, redoc_url=None)
    app.state.engine = aengine
    app.state.sessions = manager
    app.state.server = state
    install_handlers(app)
    app.add_middleware(UnicodeGuard, respond=lambda status, message, param, path: error_response(
        status, message, param=param, path=path))
    add_outer_middleware(app, max_body_bytes, api_keys, allowed_origins)
    for api in (admin, sessions, completions, chat, messages, responses, lora):
        app.include_router(api.router)
    return app
