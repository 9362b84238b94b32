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

from trajserve.engine.engine import LLMEngine
from trajserve.server.admission_limit import AdmissionLimit
from trajserve.server.async_engine import AsyncEngine
from trajserve.server.auth import ApiKeyAuth
from trajserve.server.body_cap import BodyCap
from trajserve.server.config import DEFAULT, ServerConfig
from trajserve.server.errors import error_response, install_handlers
from trajserve.server.header_limits import HeaderLimits
from trajserve.server.goodput import SLO
from trajserve.server.metrics import CountResponses, ServerMetrics
from trajserve.server.routes import admin, chat, completions, lora, messages, responses, sessions
from trajserve.server.key_priority import KeyPriorities
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


def add_outer_middleware(app: FastAPI, config: ServerConfig) -> None:
    """The body cap, API keys, CORS and the header limits, outermost last:
    the server's and the cluster front end's (cluster/frontend.py), which
    reads a body whole."""
    app.add_middleware(BodyCap, max_bytes=config.max_body_bytes,
                       respond=lambda status, message, path: error_response(status, message, path=path))
    if config.api_keys:
        app.add_middleware(ApiKeyAuth, keys=list(config.api_keys), respond=lambda status, message, path:
                           error_response(status, message, code="invalid_api_key", path=path))
    app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])
    app.add_middleware(HeaderLimits, respond=lambda status, message, path: error_response(status, message,
                                                                                          path=path))


def build_app(engine: LLMEngine, config: ServerConfig = DEFAULT) -> FastAPI:
    """The app over engine, with its AsyncEngine (app.state.engine; the
    caller starts it) and session manager (app.state.sessions, when the
    engine caches prefixes) built here, callbacks wired in."""
    names = config.names_for(engine.model_path)
    calls_format = calls_format_for(engine.tokenizer, config.tool_call_parser)  # a bad name fails first
    if engine.lora is not None:  # a request's model field names the base model or an adapter, never both
        clash = sorted(set(names) & set(engine.lora.adapters))
        if clash:
            raise ValueError(f"--lora-modules: {', '.join(clash)} is also a served model name")
    # Touched only on the engine thread (through aengine.call / submit).
    manager = SessionManager(engine, config.sessions) if engine.kv.prefix_caching else None
    slo = SLO(*(None if ms is None else ms / 1e3 for ms in (config.slo_ttft_ms, config.slo_itl_ms)))
    metrics = ServerMetrics(lambda: aengine.snapshot, engine.block_bytes, slo)
    admission = (None if config.admission == "off" else
                 AdmissionLimit(config.admission, engine.config.scheduler, slo.ttft_s, slo.itl_s,
                                n_max=engine.config.scheduler.max_num_seqs + config.max_waiting))
    aengine = AsyncEngine(engine, config.max_waiting, on_finished=metrics.observe,
                          extra_metrics=(lambda: {"sessions": manager.metrics()}) if manager is not None else None,
                          admission=admission)
    state = ServerState(aengine, names, metrics, manager, calls_format, config.generation,
                        KeyPriorities(config.api_keys, config.api_key_priorities) if config.api_key_priorities else None)
    if manager is not None:
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
    add_outer_middleware(app, config)
    app.add_middleware(CountResponses, counter=metrics.http_responses)  # outermost: sees every answer
    for api in (admin, sessions, completions, chat, messages, responses, lora):
        app.include_router(api.router)
    return app
