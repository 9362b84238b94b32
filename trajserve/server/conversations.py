"""Conversations of clients that send no trajserve extension.

Agent harnesses as they ship (Codex CLI, Claude Code) never send
`session_id` / `tool_wait_s`, but each names its conversation in a field of
its own API. A request's conversation is, in order:

    session_id / X-Session-Id          explicit: the id itself (sessions/ids.py)
    prompt_cache_key                   OpenAI's (Responses and Chat; Codex sends its thread id)
    client_metadata.session_id         Codex's Responses requests
    metadata.user_id's session         Claude Code's Messages requests: a JSON object with
                                       session_id, or the older "..._session_<uuid>" string
    X-Claude-Code-Session-Id           the header Claude Code 2.x sends with each request

A key found in a request's fields is never used as it is: the sessions it
names are `conv-`, a digest of the key, the cache salt and the adapter, and
a lineage number. So one tenant's key cannot reach another salt's session,
and an id holds no client text (nor a path). Under one key a harness makes
calls beside its main loop (a title, a topic check: another system
prompt); each line of calls is a lineage of its own, so a side call does
not overwrite the main loop's history: a request continues the lineage
whose last prompt's head it shares (its first half, at most LINEAGE_TOKENS
tokens; SAME_HEAD of those tokens: a date changed in the system prompt
keeps the lineage, another system prompt does not), else opens a free one
(LINEAGES per key; with none free it runs without a session).

A turn of an inferred conversation pauses when its reply ends: on the
reply's first tool call, the wait estimated from that tool's history (the
wait estimator learns it from when the call's result arrives: the next
request of the conversation); on a reply that ends the turn, the human's
wait (REPLY_WAIT). An explicit tool_wait_s, tool or tool_decision still
decides.
"""
from __future__ import annotations

import hashlib
import json
import re
from collections import Counter
from collections.abc import Mapping

KEY_MAX = 1024  # characters of a client's conversation key (prompt_cache_key, ...)
LINEAGE_TOKENS = 256  # the prompt's leading tokens that tell a harness's side calls from its main loop
LINEAGES = 4  # lines of calls under one key (a main loop and its side calls)
SAME_HEAD = 0.9  # the share of a lineage's head tokens a prompt's head holds to continue it
CLAUDE_CODE_HEADER = "X-Claude-Code-Session-Id"
REPLY_WAIT = "(reply)"  # the wait estimator's name for a human reading a finished reply: no tool has it
_SESSION_IN_USER_ID = re.compile(r"session_([0-9A-Za-z-]{1,128})")


def claude_code_session(user_id: str | None) -> str | None:
    """The session Claude Code names in metadata.user_id: a JSON object's
    session_id, or the `_session_<uuid>` tail of the older string form."""
    if not user_id:
        return None
    try:
        parsed = json.loads(user_id)
    except ValueError:
        parsed = None
    if isinstance(parsed, dict):
        sid = parsed.get("session_id")
        return sid if isinstance(sid, str) and sid else None
    m = _SESSION_IN_USER_ID.search(user_id)
    return m.group(1) if m else None


def conversation_id(key: str, origin: str, cache_salt: str | None, lora: str | None) -> str:
    """The digest a key's sessions are named by (never the key itself)."""
    h = hashlib.blake2b(digest_size=16)
    for part in (origin, key, cache_salt or "", lora or ""):
        h.update(part.encode("utf-8", "surrogatepass"))
        h.update(b"\0")
    return "conv-" + h.hexdigest()


def lineage(sessions: Mapping[str, object], base: str, prompt: list[int]) -> str | None:
    """The session id, under base (conversation_id), this prompt is a turn
    of: the lineage whose last prompt's head (its first half, at most
    LINEAGE_TOKENS tokens) it shares best, SAME_HEAD of its tokens at least,
    else a free one; None when that lineage has a turn running (the
    harness's calls in parallel run without a session) or none is free."""
    free, best, best_share = None, None, SAME_HEAD
    for i in range(LINEAGES):
        sid = f"{base}-{i}"
        s = sessions.get(sid)
        if s is None:
            free = free or sid
            continue
        last = s.last_output.prompt_token_ids if s.last_output is not None else s.history
        # The head of the last prompt, not all of it: a short prompt's end
        # (the reply's header, a reminder a harness moves) may change. Its
        # tokens as a multiset: a field that changed length shifts the rest.
        head = min(LINEAGE_TOKENS, max(1, len(last) // 2))
        share = sum((Counter(last[:head]) & Counter(prompt[:head])).values()) / head
        if share >= best_share:
            best, best_share = s, share
    if best is not None:
        return None if best.in_flight else best.session_id
    return free


def inferred_tool(message: dict | None) -> str:
    """What a finished reply waits for: its first tool call's name, or the
    human reading it (REPLY_WAIT). message: the reply's message as the chat
    API returns it (openai_format.chat_message), None for a completion."""
    calls = (message or {}).get("tool_calls") or []
    return calls[0]["function"]["name"] if calls else REPLY_WAIT
