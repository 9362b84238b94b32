"""Agent sessions over HTTP: list them, read one, close it, fork it (a turn
is a request with a session_id, or of a conversation its API's own fields
name: server/state.py runs it, server/conversations.py names it)."""
from __future__ import annotations

from fastapi import APIRouter, Depends, Query

from trajserve.server.errors import APIError
from trajserve.server.protocol import ForkRequest
from trajserve.server.state import ServerState, server_state
from trajserve.sessions.manager import SessionBusy

router = APIRouter()


@router.get("/v1/sessions")
async def session_list(cache_salt: str | None = Query(default=None, max_length=256),
                       st: ServerState = Depends(server_state)):
    """The open sessions of one cache salt (default: none), newest activity
    last: explicit ones and the conversations inferred from clients' fields."""
    if st.sessions is None:
        return {"object": "list", "data": []}
    return {"object": "list", "data": await st.aengine.call(lambda _: [
        st.sessions.describe(s) for s in st.sessions.sessions.values() if s.cache_salt == cache_salt])}


@router.get("/v1/sessions/{session_id}")
async def session_info(session_id: str, st: ServerState = Depends(server_state)):
    """The session's state and hit rates, with its latest prefix breaks
    (server/prefix_break.py: where a turn's prompt left the context, why)."""
    info = await st.aengine.call(lambda _: st.sessions.describe(st.get_session(session_id)))
    record = st.turns.get(session_id)
    return {**info, "prefix_breaks": [b.as_dict() for b in record.breaks] if record is not None else []}


@router.delete("/v1/sessions/{session_id}")
async def session_close(session_id: str, st: ServerState = Depends(server_state)):
    await st.aengine.call(lambda _: st.sessions.close(st.get_session(session_id)))
    return {"id": session_id, "object": "session", "deleted": True}


@router.post("/v1/sessions/{session_id}/fork")
async def session_fork(session_id: str, body: ForkRequest | None = None, st: ServerState = Depends(server_state)):
    n = body.n if body is not None else 1

    def fork(_):
        try:
            return [c.session_id for c in st.sessions.fork(st.get_session(session_id), n)]
        except SessionBusy as e:
            raise APIError(409, str(e), param="session_id") from None
        except ValueError as e:
            raise APIError(400, str(e)) from None
    return {"id": session_id, "forks": await st.aengine.call(fork)}
