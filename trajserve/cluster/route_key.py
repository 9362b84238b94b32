"""What the front end routes a request by (cluster/frontend.py).

A generation request (chat, completions, Anthropic messages, responses) is
rendered to prompt token ids exactly as a replica would (the replicas' own
tokenizer and chat template, server/state.py render_chat), so its full
blocks hash to the chained hashes the replicas' radix caches report. Its
session (the session_id field or X-Session-Id header), cache_salt and
model (base or a LoRA adapter: both are part of the cache namespace) come
along. A request that does not parse is not refused here: it goes to any
replica, whose server gives the proper 4xx naming the field.

Requests about one session or one stored response go where it lives; LoRA
loads and unloads go to every replica; the rest to any.
"""
from __future__ import annotations

import json
import re
from dataclasses import dataclass

from trajserve.server import anthropic, responses
from trajserve.server.protocol import ChatCompletionRequest, CompletionRequest
from trajserve.server.state import render_chat

PROMPT_PATHS = ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/responses")
BROADCAST_PATHS = ("/v1/load_lora_adapter", "/v1/unload_lora_adapter")
_SESSION_PATH = re.compile(r"^/v1/sessions/([^/]+)(/fork)?$")
_RESPONSE_PATH = re.compile(r"^/v1/responses/([^/]+)$")


@dataclass(slots=True)
class RouteKey:
    kind: str  # "prompt", "session", "response", "all" or "any"
    token_ids: list[int] | None = None  # prompt: the rendered prompt (None: it did not parse)
    session_id: str | None = None
    response_id: str | None = None  # a stored response the request reads (previous_response_id included)
    cache_salt: str | None = None
    model: str | None = None
    stream: bool = False
    max_tokens: int = 0  # what the client asked for (0: not given)


def _json(body: bytes) -> dict | None:
    try:
        got = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        return None
    return got if isinstance(got, dict) else None


def _str(v) -> str | None:
    return v if isinstance(v, str) else None


def _prompt_ids(path: str, body: dict, tok) -> list[int] | None:
    """The prompt as a replica renders it; None where it would refuse it (it says why)."""
    try:
        if path == "/v1/chat/completions":
            return render_chat(tok, ChatCompletionRequest.model_validate(body))
        if path == "/v1/messages":
            return render_chat(tok, anthropic.MessagesRequest.model_validate(body).to_chat())
        if path == "/v1/responses":  # the previous response's conversation is where it lives: routed by its id
            return render_chat(tok, responses.ResponsesRequest.model_validate(body).to_chat([]))
        req = CompletionRequest.model_validate(body)
        first = req.prompt if not isinstance(req.prompt, list) or not req.prompt or isinstance(
            req.prompt[0], int) else req.prompt[0]
        return tok.encode(first) if isinstance(first, str) else list(first)
    except Exception:  # noqa: BLE001 - any refusal is the replica's to give, in its words
        return None


def route_key(method: str, path: str, body: bytes, headers: dict[str, str], tok) -> RouteKey:
    """headers: lower-case names."""
    if method == "POST" and path in PROMPT_PATHS:
        got = _json(body) or {}
        max_tokens = next((v for k in ("max_tokens", "max_completion_tokens", "max_output_tokens")
                           if isinstance(v := got.get(k), int) and v > 0), 0)
        return RouteKey("prompt", _prompt_ids(path, got, tok) if got else None,
                        _str(got.get("session_id")) or headers.get("x-session-id"),
                        _str(got.get("previous_response_id")), _str(got.get("cache_salt")), _str(got.get("model")),
                        got.get("stream") is True, max_tokens)
    if path in BROADCAST_PATHS:
        return RouteKey("all")
    m = _SESSION_PATH.match(path)
    if m:
        return RouteKey("session", session_id=m.group(1))
    m = _RESPONSE_PATH.match(path)
    if m:
        return RouteKey("response", response_id=m.group(1))
    return RouteKey("any")
