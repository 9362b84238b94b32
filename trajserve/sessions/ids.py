"""A session id a client chooses: bounded, and of characters that survive a
URL path unescaped, so GET / DELETE /v1/sessions/{id} reach every id a turn
accepted; it starts with neither a dot nor a dash ("..", "-rf"). Ids never
name files: saved blocks are named by their chained hashes."""
from __future__ import annotations

import re

SESSION_ID_MAX = 128
_SESSION_ID = re.compile(r"[A-Za-z0-9_][A-Za-z0-9_.:@-]*")


def check_session_id(sid: object) -> str:
    """The id, or a ValueError that names the field and the limit."""
    if not isinstance(sid, str) or not sid:
        raise ValueError(f"session_id must be a non-empty string, got {type(sid).__name__}")
    if len(sid) > SESSION_ID_MAX:
        raise ValueError(f"session_id is {len(sid):,} characters; at most {SESSION_ID_MAX} are allowed")
    if not _SESSION_ID.fullmatch(sid):
        raise ValueError("session_id may hold only letters, digits and _ . : @ - (starting with a letter, digit "
                         f"or _), at most {SESSION_ID_MAX} characters")
    return sid
