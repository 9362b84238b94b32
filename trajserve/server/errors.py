"""The API's errors: APIError (raised by handlers, answered in the API's
shape), error_response, the exception handlers every route shares, and the
helpers that turn a ValueError into a 400 naming its field.

OpenAI's shape {"error": {"message", "type", "param", "code"}}: 400 bad
JSON or values out of range (the message names the field and the limit),
404 unknown model, 413 body over the cap, 422 wrong types or missing
fields, 429 admission queue full (with Retry-After), 503 engine down. Under
/v1/messages Anthropic's {"type": "error", "error": {"type", "message"}};
there, and under /v1/responses, wrong types or missing fields are 400s."""
from __future__ import annotations

import dataclasses

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from trajserve.sampling import SamplingParams
from trajserve.server import anthropic
from trajserve.server.async_engine import StepFailed
from trajserve.server.protocol import ChatCompletionRequest

# Under these paths a malformed body is a 400 (Anthropic's and OpenAI's Responses API answer so).
TRANSLATED = ("/v1/messages", "/v1/responses")
SAMPLING_FIELDS = frozenset(f.name for f in dataclasses.fields(SamplingParams))


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


def install_handlers(app: FastAPI) -> None:
    """Every error a route or the framework raises, in the API's shape."""
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


def field_named(e: ValueError, fields) -> str | None:
    """The field a validation message is about: SamplingParams' and the
    engine's messages start with it ("temperature must be ...", "prompt has ...")."""
    name = str(e).split(" ", 1)[0]
    return name if name in fields else None


def translated(to_chat, *args) -> ChatCompletionRequest:
    """Another API's request as the chat request (a 400 naming what cannot
    be translated; pydantic's ValidationError is a ValueError)."""
    try:
        return to_chat(*args)
    except ValueError as e:
        raise APIError(400, str(e)) from None
