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

Errors use OpenAI's shape {"error": {"message", "type", "param", "code"}}:
400 bad JSON or values out of range (the message names the field and the
limit), 404 unknown model, 413 body over the cap, 422 wrong types or missing
fields, 429 admission queue full (with Retry-After), 503 engine down. Under
/v1/messages they use Anthropic's {"type": "error", "error": {"type",
"message"}}, and wrong types or missing fields are 400s, as there.
"""
from __future__ import annotations

import asyncio
import dataclasses
import importlib.metadata
import itertools
import json
import logging
import time
import uuid
from collections.abc import AsyncIterator

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.middleware.cors import CORSMiddleware
from fastapi.responses import JSONResponse, Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest
from starlette.exceptions import HTTPException as StarletteHTTPException

from trajserve.engine.memory import bytes_per_block
from trajserve.outputs import CompletionOutput, RequestOutput
from trajserve.server import anthropic, responses
from trajserve.server.async_engine import AsyncEngine, EngineDead, QueueFull, StepFailed
from trajserve.server.auth import ApiKeyAuth
from trajserve.server.body_cap import BodyCap
from trajserve.server.unicode_guard import UnicodeGuard
from trajserve.server.tap import Tap, sse_event
from trajserve.server.metrics import ServerMetrics
from trajserve.engine.session import SessionBusy, SessionManager, check_session_id
from trajserve.server.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, ForkRequest,
                                       TokenizeRequest)
from trajserve.server.tool_calls import (FORMATS, ForcedStream, call_stream, forced_schema, format_for_template,
                                        parse_calls, parse_forced)
from trajserve.sampling import SamplingParams
from trajserve.structured import StructuredOutput

log = logging.getLogger("trajserve")
# The APIs translated into the chat path: wrong types and missing fields are
# 400s there, as Anthropic's and OpenAI's Responses API answer.
TRANSLATED = ("/v1/messages", "/v1/responses")


def _version() -> str:
    try:
        return importlib.metadata.version("trajserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


def _calibrate(sessions: SessionManager) -> None:
    # A failed measurement leaves the default rates; it must not stop the engine loop.
    try:
        sessions.calibrate()  # logs what it measured and what it checked
    except Exception:  # noqa: BLE001
        log.exception("keep policy calibration failed; using default rates")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None, headers: dict | None = None) -> None:
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code
        self.headers = headers


def error_response(status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                   code: str | None = None, headers: dict | None = None, path: str = "") -> JSONResponse:
    if path.startswith("/v1/messages"):  # Anthropic's shape for Anthropic's endpoint
        return JSONResponse(anthropic.error_body(status, message), status_code=status, headers=headers)
    return JSONResponse({"error": {"message": message, "type": type_, "param": param, "code": code}},
                        status_code=status, headers=headers)


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
    served_model_name = names[0]
    engine = aengine.engine
    tok = engine.tokenizer
    if tool_call_parser not in ("auto", *FORMATS):
        raise ValueError(f"tool call parser must be auto or one of {', '.join(FORMATS)}, got {tool_call_parser!r}")
    calls_format = format_for_template(tok.chat_template) if tool_call_parser == "auto" else tool_call_parser
    metrics = ServerMetrics(lambda: aengine.snapshot,
                            bytes_per_block(engine.model_config, engine.kv.block_size, engine.dtype))
    aengine.on_finished = metrics.observe
    # Touched only on the engine thread (through aengine.call / submit).
    sessions = SessionManager(engine, idle_ttl_s=session_ttl_s, max_sessions=max_sessions) \
        if engine.kv.radix is not None else None
    if sessions is not None:
        aengine.extra_metrics = lambda: {"sessions": sessions.metrics()}
        aengine.on_idle = sessions.tick  # its step hooks run around every engine step; this, while idle
        # On the engine thread, before the first request (calibrate skips its
        # prefill if one got in first: it must not step other requests).
        aengine.submit(lambda _: _calibrate(sessions))
    app = FastAPI(title="trajserve", docs_url=None, redoc_url=None)
    app.state.engine = aengine
    app.state.sessions = sessions

    # ---------------------------------------------------------------- errors
    @app.exception_handler(APIError)
    async def _api_error(request: Request, e: APIError):
        return error_response(e.status, e.message, e.type, e.param, e.code, e.headers, request.url.path)

    @app.exception_handler(RequestValidationError)
    async def _validation(request: Request, e: RequestValidationError):
        path = request.url.path
        errs = e.errors()
        if any(err.get("type") == "json_invalid" for err in errs):
            return error_response(400, f"request body is not valid JSON: {errs[0].get('msg')}", path=path)
        first = errs[0]
        ctype = request.headers.get("content-type", "")
        if tuple(first.get("loc", ())) == ("body",) and "json" not in ctype:
            return error_response(400 if path.startswith(TRANSLATED) else 422,
                                  f"the body must be a JSON object sent with Content-Type: application/json "
                                  f"(got {ctype or 'no Content-Type'})", path=path)
        loc = ".".join(str(x) for x in first.get("loc", ()) if x != "body")
        more = f" (and {len(errs) - 1} more)" if len(errs) > 1 else ""
        return error_response(400 if path.startswith(TRANSLATED) else 422,
                              f"{loc or 'body'}: {first.get('msg')}{more}", param=loc or None, path=path)

    @app.exception_handler(StepFailed)
    async def _step_failed(request: Request, e: StepFailed):
        return error_response(500, str(e), "server_error", path=request.url.path)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request: Request, e: StarletteHTTPException):
        what = {404: f"no route {request.method} {request.url.path}",
                405: f"{request.method} is not allowed on {request.url.path}"}.get(e.status_code, str(e.detail))
        return error_response(e.status_code, what, path=request.url.path, headers=getattr(e, "headers", None))

    app.add_middleware(UnicodeGuard, respond=lambda status, message, param, path: error_response(
        status, message, param=param, path=path))
    app.add_middleware(BodyCap, max_bytes=max_body_bytes,
                       respond=lambda status, message, path: error_response(status, message, path=path))
    if api_keys:
        app.add_middleware(ApiKeyAuth, keys=list(api_keys), respond=lambda status, message, path: error_response(
            status, message, code="invalid_api_key", path=path))
    app.add_middleware(CORSMiddleware, allow_origins=list(allowed_origins), allow_methods=["*"],
                       allow_headers=["*"])

    # ---------------------------------------------------------------- plain
    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not aengine.alive:
            return error_response(503, "engine loop is not running", "server_error")
        return {"status": "ok"}

    def model_card(name: str) -> dict:
        return {"id": name, "object": "model", "created": int(time.time()), "owned_by": "trajserve",
                "max_model_len": engine.max_model_len}

    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [model_card(name) for name in names]}

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(model)
        return model_card(model)

    @app.get("/metrics")
    async def prom():
        return Response(generate_latest(metrics.registry), media_type=CONTENT_TYPE_LATEST)

    @app.get("/version")
    async def version():
        return {"version": _version()}

    @app.post("/tokenize")
    async def tokenize(req: TokenizeRequest):
        check_model(req.model)
        if (req.prompt is None) == (req.messages is None):
            raise APIError(400, "tokenize takes either prompt (text) or messages (a chat), not both or neither",
                           param="prompt")
        if req.messages is not None:
            if not req.messages:
                raise APIError(400, "messages must not be empty", param="messages")
            ids = render_chat(req.chat())
        else:
            ids = tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
        return {"count": len(ids), "max_model_len": engine.max_model_len, "tokens": ids,
                "token_strs": [tok.id_to_token(i) for i in ids] if req.return_token_strs else None}

    @app.post("/detokenize")
    async def detokenize(req: DetokenizeRequest):
        check_model(req.model)
        bad = next((t for t in req.tokens if not 0 <= t < tok.vocab_size), None)
        if bad is not None:
            raise APIError(400, f"token id {bad} is outside the vocabulary [0, {tok.vocab_size})", param="tokens")
        return {"prompt": tok.decode(req.tokens, skip_special_tokens=False)}

    # ------------------------------------------------------------ completion
    def reply_model(req) -> str:
        """The name a reply carries: the one the request used (an alias
        included), else the first served name."""
        return req.model or served_model_name

    def check_model(model: str | None) -> None:
        if model is not None and model not in names:
            raise APIError(404, f"the model `{model}` does not exist; this server serves "
                                f"{', '.join(f'`{n}`' for n in names)}", param="model", code="model_not_found")

    def sampling(req, max_tokens, default_max, logprobs, structured=None):
        try:
            structured = structured or req.structured()
            return req.sampling_params(max_tokens, default_max, logprobs, structured)
        except ValueError as e:
            raise APIError(400, str(e), param=_field_named(e, type(req).model_fields)) from None

    async def compile_constraint(sp) -> None:
        """A structured output compiles here, on a worker thread (llguidance
        releases the GIL), so the engine thread only copies the compiled
        matcher: a large schema does not hold up everyone else's steps."""
        if sp.structured is not None:
            try:
                await asyncio.to_thread(engine.prepare_structured, sp)
            except ValueError as e:
                raise APIError(400, str(e)) from None

    def check_room(n_prompt: int, sp, explicit: bool) -> None:
        """A max_tokens the client gave that the context cannot hold after the
        prompt is a 400 (as OpenAI and vLLM answer; agent frameworks compact
        their history on it), not a reply cut short without notice. A prompt
        over the context is the engine's error, below."""
        limit = engine.max_model_len
        if explicit and n_prompt < limit and n_prompt + sp.max_tokens > limit:
            raise APIError(400, f"max_tokens is too large: {sp.max_tokens:,}. The context holds {limit:,} tokens "
                                f"and the prompt has {n_prompt:,} ({sp.max_tokens:,} > {limit:,} - {n_prompt:,})",
                           param="max_tokens", code="context_length_exceeded")

    async def start(prompt, sp, salt, request: Request, stream: bool, param: str = "messages"
                    ) -> _Outputs:
        """Queue the request now (so bad input fails before a stream starts)
        and return its output iterator. param: the request's prompt field
        (named by a context error)."""
        try:
            gen = aengine.generate(prompt, sp, salt, None if stream else request.is_disconnected)
            first = await anext(gen)
        except StopAsyncIteration:  # the client left before the first output: nothing to send
            first = None
        except QueueFull as e:
            raise APIError(429, str(e), "rate_limit_error",
                           headers={"Retry-After": str(max(1, round(e.retry_after_s)))}) from None
        except EngineDead as e:
            raise APIError(503, str(e), "server_error") from None
        except ValueError as e:
            code = "context_length_exceeded" if "tokens" in str(e) else None
            name = _field_named(e, _SAMPLING_FIELDS | {"prompt"})
            raise APIError(400, str(e), param=param if name == "prompt" else name, code=code) from None

        return _Outputs(first, gen)

    # -------------------------------------------------------------- sessions
    async def begin_session(req, request: Request, n_prompts: int = 1):
        sid = req.session_id or request.headers.get("x-session-id")
        if sid is None:
            if req.tool_wait_s is not None:
                raise APIError(400, "tool_wait_s needs a session_id (field or X-Session-Id header)",
                               param="tool_wait_s")
            return None
        if sessions is None:
            raise APIError(400, "sessions keep their state in the prefix cache, which this server runs without",
                           param="session_id")
        if req.n != 1 or n_prompts != 1:
            raise APIError(400, "a session turn takes one prompt and n=1", param="session_id")
        try:
            check_session_id(sid)
        except ValueError as e:
            raise APIError(400, str(e), param="session_id") from None
        try:
            return await aengine.call(lambda _: sessions.before_turn(sid, req.cache_salt))
        except SessionBusy as e:
            raise APIError(409, str(e), param="session_id") from None

    def end_session(sess, final: RequestOutput | None, req) -> None:
        if sess is not None:
            aengine.submit(lambda _: sessions.after_turn(sess, final.prompt_token_ids if final else [], final,
                                                         req.tool_wait_s, req.tool))

    async def session_stream(outs, sess, req):
        final = None
        try:
            async for out in outs:
                final = out
                yield out
        finally:
            end_session(sess, final, req)

    def get_session(session_id: str):
        s = sessions.sessions.get(session_id) if sessions is not None else None
        if s is None:
            raise APIError(404, f"no session {session_id!r}", param="session_id", code="session_not_found")
        return s

    @app.get("/v1/sessions/{session_id}")
    async def session_info(session_id: str):
        return await aengine.call(lambda _: sessions.describe(get_session(session_id)))

    @app.delete("/v1/sessions/{session_id}")
    async def session_close(session_id: str):
        await aengine.call(lambda _: sessions.close(get_session(session_id)))
        return {"id": session_id, "object": "session", "deleted": True}

    @app.post("/v1/sessions/{session_id}/fork")
    async def session_fork(session_id: str, body: ForkRequest | None = None):
        n = body.n if body is not None else 1

        def fork(_):
            try:
                return [c.session_id for c in sessions.fork(get_session(session_id), n)]
            except SessionBusy as e:
                raise APIError(409, str(e), param="session_id") from None
            except ValueError as e:
                raise APIError(400, str(e)) from None
        return {"id": session_id, "forks": await aengine.call(fork)}

    @app.post("/v1/completions")
    async def completions(req: CompletionRequest, request: Request):
        check_model(req.model)
        # echo with max_tokens 0 scores the prompt and generates nothing (the
        # legacy API's scoring request): the engine samples the one token
        # the prefill gives anyway, and the reply leaves it out.
        score_only = req.echo and req.max_tokens == 0
        if req.max_tokens == 0 and not score_only:
            raise APIError(400, "max_tokens must be >= 1; 0 is allowed only with echo=true (the prompt is scored, "
                                "nothing is generated)", param="max_tokens")
        sp = sampling(req, 1 if score_only else req.max_tokens, 16, req.logprobs)
        if req.echo and req.logprobs is not None:
            # echo + logprobs scores the prompt's tokens too (the legacy API's
            # way to score text, e.g. lm-evaluation-harness's loglikelihood).
            sp.prompt_logprobs = max(sp.prompt_logprobs or 0, req.logprobs)
        # Text prompts are encoded here (as the engine would) to check each
        # one's room for max_tokens before any is queued.
        given = _prompts(req.prompt)
        prompts = [tok.encode(p) if isinstance(p, str) else p for p in given]
        # echo: the prompt as sent (token prompts decoded, special tokens kept).
        echoed = [(p if isinstance(p, str) else tok.decode(p, skip_special_tokens=False)) if req.echo else ""
                  for p in given]
        for p in prompts:
            check_room(len(p), sp, "max_tokens" in req.model_fields_set and req.max_tokens is not None)
        await compile_constraint(sp)
        rid, created = f"cmpl-{uuid.uuid4().hex}", int(time.time())
        sess = await begin_session(req, request, len(prompts))
        if req.stream:
            # Every prompt is queued before the stream starts: one the engine
            # refuses is a 400 for the request, and the others are aborted.
            started = await asyncio.gather(*(start(p, sp, req.cache_salt, request, True, "prompt")
                                             for p in prompts), return_exceptions=True)
            failed = [r for r in started if isinstance(r, BaseException)]
            if failed:
                for r in started:
                    if not isinstance(r, BaseException):
                        await r.aclose()
                end_session(sess, None, req)
                raise next((e for e in failed if isinstance(e, APIError)), failed[0])
            if sess is not None:  # a session turn has one prompt
                started[0] = session_stream(started[0], sess, req)
            outs = _merge(started)
            if score_only:
                outs = ((i, _prompt_only(out)) async for i, out in outs)
            return _sse(_completion_chunks(outs, rid, created, reply_model(req), req, tok, echoed, sp.n))

        async def one(p):
            final = None
            try:
                final = await _last(await start(p, sp, req.cache_salt, request, False, "prompt"))
                return final
            finally:
                end_session(sess, final, req)

        try:  # all prompts run in the same batches; a failure cancels (aborts) the rest
            async with asyncio.TaskGroup() as tg:
                tasks = [tg.create_task(one(p)) for p in prompts]
        except ExceptionGroup as eg:
            raise next((e for e in eg.exceptions if isinstance(e, APIError)), eg.exceptions[0]) from None
        finals = [t.result() for t in tasks]
        if any(f is None for f in finals):
            return Response(status_code=499)  # client went away
        if score_only:
            finals = [_prompt_only(f) for f in finals]
        choices = []
        for i, final in enumerate(finals):
            for c in final.outputs:
                scored = _echo_logprobs(final, c.token_ids, c.logprobs, req.echo)
                choice = {"index": i * sp.n + c.index, "text": echoed[i] + c.text,
                          "finish_reason": c.finish_reason,
                          "logprobs": _completion_logprobs(*scored, tok, req.logprobs)
                          if req.logprobs is not None else None}
                if req.prompt_logprobs is not None:
                    choice["prompt_logprobs"] = _prompt_logprobs(final, tok, req.prompt_logprobs)
                choices.append(choice)
        return {"id": rid, "object": "text_completion", "created": created, "model": reply_model(req),
                "choices": choices, "usage": _usage(finals)}

    def render_chat(req: ChatCompletionRequest) -> list[int]:
        """The prompt ids for a chat request through the model's template."""
        # A template that does not render tool_calls (SmolLM2's) gets them as text.
        calls_as_text = "tool_calls" not in (tok.chat_template or "")
        try:
            for i, m in enumerate(req.messages):
                m.check_parts(f"messages.{i}")
        except ValueError as e:
            raise APIError(400, str(e), param="messages") from None
        try:
            text = tok.apply_chat_template([m.as_template_dict(calls_as_text) for m in req.messages],
                                           add_generation_prompt=req.add_generation_prompt,
                                           continue_final_message=req.continue_final_message,
                                           **({"tools": [t.model_dump(exclude_none=True) for t in req.tools]}
                                              if req.tools else {}))
        except Exception as e:  # noqa: BLE001 - template errors (raise_exception in jinja) are the client's
            raise APIError(400, f"chat template failed on these messages: {e}", param="messages") from None
        return tok.encode(text, add_special_tokens=False)

    async def open_chat(req: ChatCompletionRequest, request: Request, room_checked: bool = True
                        ) -> AsyncIterator[RequestOutput]:
        """Check, render and queue a chat request; its outputs, the session
        (if any) updated when they end. Shared by /v1/chat/completions and
        /v1/messages (room_checked=False: a max_tokens over what the context
        leaves is not an error; the reply stops at the context's end)."""
        check_model(req.model)
        if req.top_logprobs is not None and not req.logprobs:
            raise APIError(400, "top_logprobs requires logprobs=true", param="top_logprobs")
        if req.top_logprobs is not None and not 0 <= req.top_logprobs <= 20:
            raise APIError(400, f"top_logprobs must be in [0, 20], got {req.top_logprobs}", param="top_logprobs")
        forced = None  # tool_choice "required" or a named function: the reply is held to the call's JSON
        if req.forced_tool is not None:
            names = [t.function.name for t in req.tools or []]
            if not names:
                raise APIError(400, f"tool_choice {req.forced_tool!r} needs tools", param="tool_choice")
            if req.forced_tool != "required" and req.forced_tool not in names:
                raise APIError(400, f"tool_choice names the function {req.forced_tool!r}, which is not among "
                                    f"the tools ({', '.join(names)})", param="tool_choice")
            if req.structured_given:
                raise APIError(400, "a forced tool_choice and an output constraint (response_format, "
                                    "structured_outputs, guided_*) cannot both hold", param="tool_choice")
            forced = StructuredOutput(json_schema=forced_schema([t.model_dump() for t in req.tools],
                                                                req.forced_tool, req.parallel_tool_calls is not False))
        ids = render_chat(req)
        # Without max_tokens a reply may fill the context, as OpenAI's API allows.
        # n > 1: no more than the pool holds for all n at once (the engine refuses more).
        default_max = max(1, engine.max_model_len - len(ids))
        if req.n > 1:
            default_max = max(1, min(default_max, engine.max_tokens_within_pool(len(ids), req.n)))
        sp = sampling(req, req.requested_max_tokens, default_max,
                      (req.top_logprobs or 0) if req.logprobs else None, forced)
        check_room(len(ids), sp, room_checked and req.requested_max_tokens is not None)
        await compile_constraint(sp)
        sess = await begin_session(req, request)
        try:
            outs = await start(ids, sp, req.cache_salt, request, req.stream)
        except APIError:
            end_session(sess, None, req)
            raise
        return session_stream(outs, sess, req)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatCompletionRequest, request: Request):
        outs = await open_chat(req, request)
        rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
        if req.stream:
            return _sse(_chat_chunks(outs, rid, created, reply_model(req), req, tok, calls_format))
        final = await _last(outs)
        if final is None:
            return Response(status_code=499)
        choices = [{"index": c.index, **_chat_message(c, req, calls_format),
                    "logprobs": _chat_logprobs(c.token_ids, c.logprobs, tok) if req.logprobs else None}
                   for c in final.outputs]
        body = {"id": rid, "object": "chat.completion", "created": created, "model": reply_model(req),
                "choices": choices, "usage": _usage([final])}
        if req.prompt_logprobs is not None:
            body["prompt_logprobs"] = _prompt_logprobs(final, tok, req.prompt_logprobs)  # vLLM's place
        return body

    @app.post("/v1/messages")
    async def messages(body: anthropic.MessagesRequest, request: Request):
        req = _translated(body.to_chat)
        try:
            outs = Tap(await open_chat(req, request, room_checked=False))
        except APIError as e:
            if e.code == "context_length_exceeded":  # in Anthropic's words (error path: rendered again)
                e.message = anthropic.too_long(len(render_chat(req)), engine.max_model_len, e.message)
            raise
        if req.stream:
            chunks = _chat_chunks(outs, "", 0, body.model, req, tok, calls_format)
            return _event_stream(anthropic.events(chunks, outs, body.model, body.max_tokens),
                                 lambda e: sse_event("error", anthropic.error_body(500, e)))
        final = await _last(outs)
        if final is None:
            return Response(status_code=499)
        return anthropic.message(final, _chat_message(final.outputs[0], req, calls_format), body.model,
                                 body.max_tokens)

    store = responses.ResponseStore()

    def stored(response_id: str, param: str):
        got = store.get(response_id)
        if got is None:
            raise APIError(404, f"no stored response {response_id!r} (responses are kept in memory while "
                                f"store is true, the latest {store.limit:,})", param=param,
                           code="previous_response_not_found" if param == "previous_response_id" else None)
        return got

    @app.post("/v1/responses")
    async def create_response(body: responses.ResponsesRequest, request: Request):
        history = stored(body.previous_response_id, "previous_response_id")[1] \
            if body.previous_response_id is not None else []
        req = _translated(body.to_chat, history)
        shell = responses.Shell(body, body.model or served_model_name)
        try:
            outs = Tap(await open_chat(req, request))
        except APIError as e:  # in this API's words: max_output_tokens, input
            e.message = e.message.replace("max_tokens", "max_output_tokens")
            e.param = {"max_tokens": "max_output_tokens", "messages": "input"}.get(e.param, e.param)
            raise

        def keep(resp: dict) -> None:
            if body.store:
                store.put(resp, responses.conversation_after(req, resp["output"], bool(body.instructions)))
        if req.stream:
            chunks = _chat_chunks(outs, "", 0, shell.fields["model"], req, tok, calls_format)
            return _event_stream(responses.events(chunks, outs, shell, keep),
                                 lambda e: sse_event("error", {"message": e}))
        final = await _last(outs)
        if final is None:
            return Response(status_code=499)
        resp = responses.response(shell, final, _chat_message(final.outputs[0], req, calls_format))
        keep(resp)
        return resp

    @app.get("/v1/responses/{response_id}")
    async def get_response(response_id: str):
        return stored(response_id, "response_id")[0]

    @app.delete("/v1/responses/{response_id}")
    async def delete_response(response_id: str):
        stored(response_id, "response_id")
        store.delete(response_id)
        return {"id": response_id, "object": "response", "deleted": True}

    @app.post("/v1/messages/count_tokens")
    async def count_tokens(body: anthropic.CountTokensRequest):
        req = _translated(body.to_chat)
        check_model(req.model)
        return {"input_tokens": len(render_chat(req))}

    return app


# --------------------------------------------------------------- helpers
_SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


def _field_named(e: ValueError, fields) -> str | None:
    """The field a validation message is about: SamplingParams' and the
    engine's messages start with it ("temperature must be ...", "prompt has ...")."""
    name = str(e).split(" ", 1)[0]
    return name if name in fields else None


def _prompts(prompt) -> list[str | list[int]]:
    if isinstance(prompt, str):
        return [prompt]
    if not prompt:
        raise APIError(400, "prompt is empty: at least 1 token is required", param="prompt")
    if isinstance(prompt[0], int):
        return [list(prompt)]
    return list(prompt)


async def _last(outs: AsyncIterator[RequestOutput]) -> RequestOutput | None:
    final = None
    async for out in outs:
        final = out
    return final if final is not None and final.finished else None


def _usage(finals: list[RequestOutput]) -> dict:
    prompt = sum(len(f.prompt_token_ids) for f in finals)
    completion = sum(len(c.token_ids) for f in finals for c in f.outputs)
    return {"prompt_tokens": prompt, "completion_tokens": completion, "total_tokens": prompt + completion,
            "prompt_tokens_details": {"cached_tokens": sum(f.num_cached_tokens for f in finals)}}


def _token_str(tok, t: int) -> str:
    return tok.decode([t], skip_special_tokens=False)


def _completion_logprobs(ids: list[int], lps, tok, k: int, start: int = 0) -> dict | None:
    """The legacy logprobs object. An entry of lps is (logprob, {token: logprob}
    top alternatives, ...) or None (an echoed prompt's first token, which
    nothing predicts). top_logprobs: the k likeliest and the token itself,
    as vLLM gives them; text_offset counts from `start` (the text before)."""
    if lps is None:
        return None
    tokens = [_token_str(tok, t) for t in ids]
    offsets, pos = [], start
    for s in tokens:
        offsets.append(pos)
        pos += len(s)
    top = []
    for t, s, e in zip(ids, tokens, lps):
        if e is None:
            top.append(None)
            continue
        d = {_token_str(tok, a): v for a, v in itertools.islice(e[1].items(), k)}
        d.setdefault(s, e[0])
        top.append(d)
    return {"tokens": tokens, "token_logprobs": [e and e[0] for e in lps], "top_logprobs": top,
            "text_offset": offsets}


def _echo_logprobs(out: RequestOutput, ids: list[int], lps: list | None, echo: bool) -> tuple[list[int], list]:
    """A choice's tokens and their logprobs, the prompt's first when echoed."""
    if not echo or lps is None:
        return ids, lps
    return out.prompt_token_ids + ids, out.prompt_logprobs + lps


def _prompt_logprobs(final: RequestOutput, tok, k: int) -> list | None:
    """vLLM's prompt_logprobs: per prompt token None (the first) or {token id:
    {logprob, rank, decoded_token}} for the token itself and the top k (the
    engine may hold more: echo + logprobs asked for them too)."""
    if final.prompt_logprobs is None:
        return None
    out: list = [None]
    for t, (lp, alts, rank) in zip(final.prompt_token_ids[1:], final.prompt_logprobs[1:]):
        d = {a: {"logprob": v, "rank": r, "decoded_token": _token_str(tok, a)}
             for r, (a, v) in enumerate(itertools.islice(alts.items(), k), 1)}
        d[t] = {"logprob": lp, "rank": rank, "decoded_token": _token_str(tok, t)}
        out.append(d)
    return out


def _chat_logprobs(ids: list[int], lps, tok) -> dict | None:
    if lps is None:
        return None
    content = []
    for t, (lp, alts) in zip(ids, lps):
        s = _token_str(tok, t)
        content.append({"token": s, "logprob": lp, "bytes": list(s.encode()),
                        "top_logprobs": [{"token": _token_str(tok, a), "logprob": v,
                                          "bytes": list(_token_str(tok, a).encode())} for a, v in alts.items()]})
    return {"content": content}


def _chat_message(c: CompletionOutput, req: ChatCompletionRequest, fmt: str) -> dict:
    """A finished choice's message and finish_reason; with tools, its tool
    calls (fmt: the model's tool-call format, server/tool_calls.py)."""
    if req.forced_tool is not None:
        parsed = parse_forced(c.text, req.forced_tool)
    else:
        parsed = parse_calls(c.text, fmt) if req.parses_tool_calls else None
    parsed = _one_call_if_asked(parsed, req)
    if parsed is None or not parsed.tool_calls:
        return {"message": {"role": "assistant", "content": c.text}, "finish_reason": c.finish_reason}
    return {"message": {"role": "assistant", "content": parsed.content, "tool_calls": parsed.tool_calls},
            "finish_reason": _calls_finish(req)}


def _one_call_if_asked(parsed, req: ChatCompletionRequest):
    """parallel_tool_calls=false: a reply that calls several tools keeps the
    first (a forced "required" reply is held to one call by its schema)."""
    if parsed is not None and req.parallel_tool_calls is False and len(parsed.tool_calls) > 1:
        parsed.tool_calls = parsed.tool_calls[:1]
    return parsed


def _calls_finish(req: ChatCompletionRequest) -> str:
    # OpenAI's: a call the client named ends as "stop", one the model chose as "tool_calls".
    return "stop" if req.forced_tool not in (None, "required") else "tool_calls"


def _call_stream(req: ChatCompletionRequest, fmt: str):
    """A choice's streaming parser when the reply may hold tool calls, else None."""
    if req.forced_tool is not None:
        return ForcedStream(req.forced_tool)
    return call_stream(fmt) if req.parses_tool_calls else None


def _translated(to_chat, *args) -> ChatCompletionRequest:
    """Another API's request as the chat request (a 400 naming what cannot
    be translated; pydantic's ValidationError is a ValueError)."""
    try:
        return to_chat(*args)
    except ValueError as e:
        raise APIError(400, str(e)) from None


def _event_stream(events: AsyncIterator[str], error_event) -> StreamingResponse:
    """Server-sent events; a request that fails after the headers went out
    (its step raised, the engine stopped) ends with error_event(message)."""
    async def body():
        try:
            async for event in events:
                yield event
        except (StepFailed, EngineDead) as e:
            yield error_event(str(e))
    return StreamingResponse(body(), media_type="text/event-stream")


def _sse(chunks: AsyncIterator[dict]) -> StreamingResponse:
    """OpenAI's stream: data lines, [DONE]; an error is a data line too (as vLLM)."""
    async def lines():
        async for chunk in chunks:
            yield f"data: {json.dumps(chunk)}\n\n"
        yield "data: [DONE]\n\n"

    def error(message: str) -> str:
        body = {"message": message, "type": "server_error", "param": None, "code": None}
        return f"data: {json.dumps({'error': body})}\n\ndata: [DONE]\n\n"
    return _event_stream(lines(), error)


def _prompt_only(out: RequestOutput) -> RequestOutput:
    """A scoring request's output (echo, max_tokens 0): the token sampled
    past the prompt is not part of the reply."""
    comps = [dataclasses.replace(c, text="", token_ids=[], delta_text="", delta_token_ids=[],
                                 logprobs=None if c.logprobs is None else [],
                                 finish_reason="length" if c.finish_reason in ("stop", "length")
                                 else c.finish_reason, stop_reason=None)
             for c in out.outputs]
    return dataclasses.replace(out, outputs=comps)


def _new_logprobs(c: CompletionOutput, sent: dict[int, int], index: int | None = None
                  ) -> tuple[list[int], list] | None:
    """The choice's tokens and logprobs not sent yet (sent: per choice index, how many were)."""
    if c.logprobs is None:
        return None
    index = c.index if index is None else index
    k = sent.get(index, 0)
    sent[index] = len(c.logprobs)
    return c.token_ids[k:len(c.logprobs)], c.logprobs[k:]


class _Outputs:
    """A request's outputs, the first of which start() has awaited (None: the
    client left before it). aclose() aborts the request if it still runs."""

    def __init__(self, first: RequestOutput | None, gen: AsyncIterator[RequestOutput]) -> None:
        self._first, self._gen, self._done = first, gen, first is None

    def __aiter__(self) -> _Outputs:
        return self

    async def __anext__(self) -> RequestOutput:
        if self._first is not None:
            out, self._first = self._first, None
            return out
        if self._done:
            raise StopAsyncIteration
        return await anext(self._gen)

    async def aclose(self) -> None:
        self._done, self._first = True, None
        await self._gen.aclose()


async def _merge(streams: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(i, output) from several requests' outputs as they arrive. Leaving
    early (the client went) cancels the readers, which aborts what still runs."""
    q: asyncio.Queue = asyncio.Queue()

    async def pump(i: int, outs) -> None:
        try:
            async for out in outs:
                q.put_nowait((i, out))
            q.put_nowait((i, None))
        except Exception as e:  # noqa: BLE001 - the stream's reader raises it
            q.put_nowait((i, e))

    tasks = [asyncio.create_task(pump(i, outs)) for i, outs in enumerate(streams)]
    try:
        left = len(tasks)
        while left:
            i, item = await q.get()
            if item is None:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()


async def _completion_chunks(outs: AsyncIterator[tuple[int, RequestOutput]], rid, created, model,
                             req: CompletionRequest, tok, echoed: list[str], n: int) -> AsyncIterator[dict]:
    """Chunks of prompt i's choices (index i * n + choice, as the reply
    without stream numbers them), interleaved as the steps produce them."""
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent: dict[int, int] = {}
    at: dict[int, int] = {}  # per choice: text_offset of its next token (the echo and tokens sent before)
    finals: dict[int, RequestOutput] = {}
    async for i, out in outs:
        finals[i] = out
        for c in out.outputs:
            index = i * n + c.index
            first = index not in at  # the choice's first chunk carries the echo
            if not c.delta_token_ids and not (first and req.echo):
                continue
            new = _new_logprobs(c, sent, index)
            if new:
                new = _echo_logprobs(out, *new, first and req.echo)
            lp = _completion_logprobs(*new, tok, req.logprobs, at.get(index, 0)) \
                if new and req.logprobs is not None else None
            if lp is not None and lp["tokens"]:
                at[index] = lp["text_offset"][-1] + len(lp["tokens"][-1])
            else:
                at.setdefault(index, 0)
            choice = {"index": index, "text": (echoed[i] if first else "") + c.delta_text, "logprobs": lp,
                      "finish_reason": c.finish_reason}
            chunk = {"id": rid, "object": "text_completion", "created": created, "model": model,
                     "choices": [choice]}
            if include_usage:
                chunk["usage"] = None
            yield chunk
    if include_usage and finals:
        yield {"id": rid, "object": "text_completion", "created": created, "model": model, "choices": [],
               "usage": _usage(list(finals.values()))}


async def _chat_chunks(outs, rid, created, model, req: ChatCompletionRequest, tok, fmt: str
                       ) -> AsyncIterator[dict]:
    include_usage = bool(req.stream_options and req.stream_options.include_usage)
    sent: dict[int, int] = {}
    started: set[int] = set()
    parsers = {}  # per choice, with tools: _call_stream's parser (holds back what may be a call)
    final = None

    def chunk(index: int, delta: dict, finish: str | None, logprobs=None) -> dict:
        d = {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model,
             "choices": [{"index": index, "delta": delta, "logprobs": logprobs, "finish_reason": finish}]}
        if include_usage:
            d["usage"] = None
        return d

    async for out in outs:
        final = out
        for c in out.outputs:
            if c.index not in started:
                started.add(c.index)
                p = _call_stream(req, fmt)
                if p is not None:
                    parsers[c.index] = p
                yield chunk(c.index, {"role": "assistant", "content": ""}, None)
            if not c.delta_token_ids:
                continue
            new = _new_logprobs(c, sent)
            lp = _chat_logprobs(*new, tok) if new and req.logprobs else None
            text = parsers[c.index].feed(c.delta_text) if c.index in parsers else c.delta_text
            if text or lp:
                yield chunk(c.index, {"content": text}, None, lp)
            if c.finished:
                finish = c.finish_reason
                if c.index in parsers:
                    rest = _one_call_if_asked(parsers[c.index].finish(), req)
                    if rest.content:
                        yield chunk(c.index, {"content": rest.content}, None)
                    if rest.tool_calls:
                        finish = _calls_finish(req)
                        yield chunk(c.index, {"tool_calls": [{"index": i, **call}
                                                             for i, call in enumerate(rest.tool_calls)]}, None)
                yield chunk(c.index, {}, finish)
    if include_usage and final is not None:
        yield {"id": rid, "object": "chat.completion.chunk", "created": created, "model": model, "choices": [],
               "usage": _usage([final])}
