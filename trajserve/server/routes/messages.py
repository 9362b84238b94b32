"""POST /v1/messages: Anthropic's Messages API, translated to a chat
request (server/anthropic.py) and its reply and events back."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from trajserve.server import anthropic, cache_breakpoints, context_edits, streams
from trajserve.server import openai_format as oai
from trajserve.server.conversations import CLAUDE_CODE_HEADER, KEY_MAX
from trajserve.server.errors import APIError, translated
from trajserve.server.state import ServerState, render_chat, server_state
from trajserve.server.tap import Tap, sse_event

router = APIRouter()


@router.post("/v1/messages")
async def messages(body: anthropic.MessagesRequest, request: Request, st: ServerState = Depends(server_state)):
    req = translated(body.to_chat)
    edits = body.context_management.edits if body.context_management is not None else None
    rendered: list[list[int]] = []  # the request as the edits last counted it: rendered once, not again

    def count() -> int:
        rendered[:] = [st.render_chat(req)]
        return len(rendered[0])
    if edits:  # clear_tool_uses: old tool results out of the prompt, as Anthropic's API does
        try:
            applied = context_edits.apply(edits, req, count,
                                          lambda text: len(st.tok.encode(text, add_special_tokens=False)))
        except ValueError as e:
            raise APIError(400, str(e), param="context_management") from None
        if applied:
            req.note("context_management", {"applied_edits": applied})
    header = request.headers.get(CLAUDE_CODE_HEADER)
    if header and req.conversation() is None:  # Claude Code's session, where metadata.user_id names none
        req.name_conversation(CLAUDE_CODE_HEADER, header[:KEY_MAX])
    try:
        outs = Tap(await st.open_chat(req, request, room_checked=False, ids=rendered[0] if rendered else None))
    except APIError as e:
        if e.code == "context_length_exceeded":  # in Anthropic's words (error path: rendered again)
            e.message = anthropic.too_long(len(st.render_chat(req)), st.engine.max_model_len, e.message)
        raise
    notes = {**({"ignored_tools": body.ignored_tools} if body.ignored_tools else {}), **req.notes}
    cache_marks, placed = body.cache_marks(), []

    def marks(prompt: list[int]) -> list:  # where the cache_control marks fall in the prompt's tokens (once)
        if not placed:
            placed.append(cache_breakpoints.positions(cache_marks, lambda n: render_chat(st.tok, req, n), prompt))
            st.retain(prompt, placed[0], req.cache_salt, st.check_model(req.model))  # each mark for its ttl
        return placed[0]
    max_tokens = st.generation.cap(body.max_tokens)  # a reply cut at the server's cap ends "max_tokens"
    if req.stream:
        chunks = oai.chat_chunks(outs, "", 0, body.model, req, st.tok, st.calls_format)
        return streams.event_stream(anthropic.events(chunks, outs, body.model, max_tokens, notes, marks),
                             lambda e: sse_event("error", anthropic.error_body(500, e)))
    final = await streams.last(outs)
    if final is None:
        return Response(status_code=499)
    return anthropic.message(final, oai.chat_message(final.outputs[0], req, st.calls_format), body.model,
                             max_tokens, notes, marks)
