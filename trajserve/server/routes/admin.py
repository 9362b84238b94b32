"""The plain routes: the base URL, health, models, metrics, version, and counting tokens
(vLLM's /tokenize and /detokenize, Anthropic's /v1/messages/count_tokens)."""
from __future__ import annotations

import importlib.metadata

from fastapi import APIRouter, Depends
from fastapi.responses import Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from trajserve.server import anthropic
from trajserve.server.errors import APIError, error_response, translated
from trajserve.server.protocol import DetokenizeRequest, TokenizeRequest
from trajserve.server.state import ServerState, server_state

router = APIRouter()


def _version() -> str:
    try:
        return importlib.metadata.version("trajserve")
    except importlib.metadata.PackageNotFoundError:  # run from a source tree without installing
        return "unknown"


@router.api_route("/", methods=["GET", "HEAD"])
async def root():
    """The base URL answers: clients probe it before their first call
    (Claude Code sends HEAD /). Nothing here needs the API key."""
    return {"server": "trajserve", "version": _version()}


@router.api_route("/health", methods=["GET", "HEAD"])
async def health(st: ServerState = Depends(server_state)):
    if not st.aengine.alive:
        return error_response(503, "engine loop is not running", "server_error")
    return {"status": "ok"}


@router.get("/v1/models")
async def models(st: ServerState = Depends(server_state)):
    return {"object": "list", "data": [st.model_card(name) for name in st.names + st.adapter_names]}


@router.get("/v1/models/{model:path}")
async def model(model: str, st: ServerState = Depends(server_state)):
    st.check_model(model)
    return st.model_card(model)


@router.get("/metrics")
async def prom(st: ServerState = Depends(server_state)):
    return Response(generate_latest(st.metrics.registry), media_type=CONTENT_TYPE_LATEST)


@router.get("/version")
async def version():
    return {"version": _version()}


@router.post("/tokenize")
async def tokenize(req: TokenizeRequest, st: ServerState = Depends(server_state)):
    st.check_model(req.model)
    if (req.prompt is None) == (req.messages is None):
        raise APIError(400, "tokenize takes either prompt (text) or messages (a chat), not both or neither",
                       param="prompt")
    if req.messages is not None:
        if not req.messages:
            raise APIError(400, "messages must not be empty", param="messages")
        ids = st.render_chat(req.chat())
    else:
        ids = st.tok.encode(req.prompt, add_special_tokens=req.add_special_tokens)
    return {"count": len(ids), "max_model_len": st.engine.max_model_len, "tokens": ids,
            "token_strs": [st.tok.id_to_token(i) for i in ids] if req.return_token_strs else None}


@router.post("/detokenize")
async def detokenize(req: DetokenizeRequest, st: ServerState = Depends(server_state)):
    st.check_model(req.model)
    bad = next((t for t in req.tokens if not 0 <= t < st.tok.vocab_size), None)
    if bad is not None:
        raise APIError(400, f"token id {bad} is outside the vocabulary [0, {st.tok.vocab_size})", param="tokens")
    return {"prompt": st.tok.decode(req.tokens, skip_special_tokens=False)}


@router.post("/v1/messages/count_tokens")
async def count_tokens(body: anthropic.CountTokensRequest, st: ServerState = Depends(server_state)):
    req = translated(body.to_chat)
    st.check_model(req.model)
    return {"input_tokens": len(st.render_chat(req))}
