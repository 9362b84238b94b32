"""OpenAI's Responses API: POST /v1/responses (translated to a chat request,
server/responses.py), and GET / DELETE of a stored response."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Request
from fastapi.responses import Response

from trajserve.server import openai_format as oai
from trajserve.server import responses, responses_events, streams
from trajserve.server.errors import APIError, translated
from trajserve.server.state import ServerState, server_state
from trajserve.server.tap import Tap, sse_event

router = APIRouter()


@router.post("/v1/responses")
async def create_response(body: responses.ResponsesRequest, request: Request, st: ServerState = Depends(server_state)):
    history = st.stored(body.previous_response_id, "previous_response_id")[1] \
        if body.previous_response_id is not None else []
    req = translated(body.to_chat, history)
    try:
        outs = Tap(await st.open_chat(req, request))
    except APIError as e:  # in this API's words: max_output_tokens, input
        e.message = e.message.replace("max_tokens", "max_output_tokens")
        e.param = {"max_tokens": "max_output_tokens", "messages": "input"}.get(e.param, e.param)
        raise
    shell = responses.Shell(body, body.model or st.served_model_name, req.notes)

    def keep(resp: dict) -> None:
        if body.store:
            st.store.put(resp, responses.conversation_after(req, resp["output"], bool(body.instructions)))
    if req.stream:
        chunks = oai.chat_chunks(outs, "", 0, shell.fields["model"], req, st.tok, st.calls_format)
        return streams.event_stream(responses_events.events(chunks, outs, shell, keep),
                             lambda e: sse_event("error", {"message": e}))
    final = await streams.last(outs)
    if final is None:
        return Response(status_code=499)
    resp = responses.response(shell, final, oai.chat_message(final.outputs[0], req, st.calls_format))
    keep(resp)
    return resp


@router.get("/v1/responses/{response_id}")
async def get_response(response_id: str, st: ServerState = Depends(server_state)):
    return st.stored(response_id, "response_id")[0]


@router.delete("/v1/responses/{response_id}")
async def delete_response(response_id: str, st: ServerState = Depends(server_state)):
    st.stored(response_id, "response_id")
    st.store.delete(response_id)
    return {"id": response_id, "object": "response", "deleted": True}
