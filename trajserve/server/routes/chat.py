"""POST /v1/chat/completions: the model's chat template, tools, logprobs."""
from __future__ import annotations

import time
import uuid

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from trajserve.server import openai_format as oai
from trajserve.server import streams
from trajserve.server.protocol import ChatCompletionRequest
from trajserve.server.state import ServerState, server_state

router = APIRouter()


@router.post("/v1/chat/completions")
async def chat(req: ChatCompletionRequest, request: Request, st: ServerState = Depends(server_state)):
    outs = await st.open_chat(req, request)
    rid, created = f"chatcmpl-{uuid.uuid4().hex}", int(time.time())
    if req.stream:
        return streams.sse(oai.chat_chunks(outs, rid, created, st.reply_model(req), req, st.tok, st.calls_format))
    final = await streams.last(outs)
    if final is None:
        return Response(status_code=499)
    choices = [{"index": c.index, **oai.chat_message(c, req, st.calls_format),
                "logprobs": oai.chat_logprobs(c.token_ids, c.logprobs, st.tok) if req.logprobs else None}
               for c in final.outputs]
    body = {"id": rid, "object": "chat.completion", "created": created, "model": st.reply_model(req),
            "choices": choices, "usage": oai.usage([final])}
    if req.prompt_logprobs is not None:
        body["prompt_logprobs"] = oai.prompt_logprobs(final, st.tok, req.prompt_logprobs)  # vLLM's place
    return {**body, **req.notes}
