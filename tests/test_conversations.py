"""Conversations without extensions (server/conversations.py), on the real
model: a client that sends no session_id / tool_wait_s still gets a
session per conversation its own API names, paused on what its reply waits
for and resumed by its next request; keys are scoped by salt and never
become ids, paths or unbounded state."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from trajserve.server.config import ServerConfig
from trajserve.server.conversations import REPLY_WAIT, claude_code_session
from trajserve.sessions.config import SessionConfig

EXEC = {"type": "function", "name": "exec_command", "description": "Run a shell command",
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}
MAX_SESSIONS = 8


@pytest.fixture
def server(engine_f32):
    from trajserve.server.app import build_app

    engine_f32.kv.clear_cache()
    app = build_app(engine_f32, ServerConfig(served_model_names=("m",),
                                             sessions=SessionConfig(idle_ttl_s=600.0, max_sessions=MAX_SESSIONS)))
    app.state.engine.start()
    try:
        with TestClient(app) as client:
            yield client, app.state.sessions
    finally:
        app.state.engine.shutdown()
        app.state.sessions.shutdown()


def sessions(client, salt=None):
    r = client.get("/v1/sessions", params={"cache_salt": salt} if salt else {})
    assert r.status_code == 200, r.text
    return r.json()["data"]


def codex_turn(client, items, choice="required", key="thread-1", **kw):
    body = {"model": "m", "input": items, "tools": [EXEC], "tool_choice": choice, "store": False,
            "prompt_cache_key": key, "max_output_tokens": 24, "temperature": 0, **kw}
    r = client.post("/v1/responses", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_a_codex_thread_pauses_on_its_tool_call_and_resumes_on_the_result(server):
    client, mgr = server
    items = [{"type": "message", "role": "developer", "content": [{"type": "input_text", "text": "You run commands."}]},
             {"type": "message", "role": "user", "content": [{"type": "input_text", "text": "List the files."}]}]
    first = codex_turn(client, items, max_output_tokens=64)  # room for the whole call
    (call,) = [o for o in first["output"] if o["type"] == "function_call"]
    (s,) = sessions(client)
    assert s["origin"] == "prompt_cache_key" and s["id"].startswith("conv-") and "thread-1" not in s["id"]
    assert s["state"] == "paused" and s["waiting_for"] == "exec_command" and s["turns"] == 1
    assert s["decision"]["decision"] in ("keep", "host", "disk", "drop")
    # The result comes back: the same conversation resumes (the wait is learned for the tool), and the reply
    # that ends the turn pauses it for the human.
    items += [{k: call[k] for k in ("type", "call_id", "name", "arguments")},
              {"type": "function_call_output", "call_id": call["call_id"], "output": "README.md setup.py"}]
    second = codex_turn(client, items, choice="none")
    (s,) = sessions(client)
    assert s["turns"] == 2 and s["state"] == "paused" and s["waiting_for"] == REPLY_WAIT
    assert mgr.waits.count("exec_command") == 1
    assert second["usage"]["input_tokens"] > first["usage"]["input_tokens"]
    # An explicit hint still decides: a pause with the client's wait, no tool inferred.
    reply = "".join(c["text"] for o in second["output"] if o["type"] == "message" for c in o["content"])
    codex_turn(client, items + [{"type": "message", "role": "assistant", "content": reply},
                                {"type": "message", "role": "user", "content": "Again."}], choice="none",
               tool_wait_s=0.5)
    (s,) = sessions(client)
    assert s["turns"] == 3 and s["state"] == "paused" and s["waiting_for"] is None


def test_the_cached_prefix_serves_the_next_turn(server):
    """A kept (or reloaded) conversation: the next call reads its whole
    earlier context from the cache but the blocks its reply ends in."""
    client, mgr = server
    items = [{"type": "message", "role": "user", "content": "Say one word."}]
    first = codex_turn(client, items, choice="none", key="thread-2", tool_decision="keep")
    text = "".join(c["text"] for o in first["output"] if o["type"] == "message" for c in o["content"])
    items += [{"type": "message", "role": "assistant", "content": text},
              {"type": "message", "role": "user", "content": "And another."}]
    second = codex_turn(client, items, choice="none", key="thread-2")
    context = first["usage"]["input_tokens"] + first["usage"]["output_tokens"]
    assert second["usage"]["input_tokens_details"]["cached_tokens"] >= first["usage"]["input_tokens"] - 16
    assert second["usage"]["input_tokens_details"]["cached_tokens"] <= context


def claude_turn(client, system, user_id, salt=None):
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "system": system,
            "metadata": {"user_id": user_id}, "messages": [{"role": "user", "content": "Hello."}]}
    if salt is not None:
        body["cache_salt"] = salt
    r = client.post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    return r.json()


def test_claude_codes_session_side_calls_and_salts_are_conversations_of_their_own(server):
    client, _ = server
    uid = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "9c1e-main"})
    claude_turn(client, "You are a coding agent working in a repository of Python files. " * 8, uid)
    claude_turn(client, "Write a five-word title for this conversation. " * 8, uid)  # a side call, same session
    claude_turn(client, "You are a coding agent working in a repository of Python files. " * 8, uid, salt="t2")
    mine = sessions(client)
    assert len(mine) == 2 and {s["origin"] for s in mine} == {"metadata.user_id"}
    (other,) = sessions(client, "t2")
    assert other["id"] not in {s["id"] for s in mine}  # the same key under another salt shares nothing
    assert all(s["state"] == "paused" and s["waiting_for"] == REPLY_WAIT for s in mine + [other])
    # The older string form of user_id names the session too.
    assert claude_code_session("user_ab12_account__session_9c1e-main") == "9c1e-main"
    assert claude_code_session("plain-user") is None and claude_code_session('{"session_id": 5}') is None


def test_claude_codes_session_header_names_the_conversation_where_metadata_does_not(server):
    """Claude Code 2.x sends X-Claude-Code-Session-Id with every request;
    without a session in metadata.user_id it names the conversation (any
    value: digested, cut at KEY_MAX characters)."""
    client, _ = server
    body = {"model": "m", "max_tokens": 8, "temperature": 0, "cache_salt": "hdr",
            "system": "You are a coding agent working in a repository of Python files. " * 8,
            "messages": [{"role": "user", "content": "Hello."}]}
    for sid in ("e1667eb8-18f5-4730-8cbc-de0f1207abe8", "../" * 2000):
        r = client.post("/v1/messages", json=body, headers={"X-Claude-Code-Session-Id": sid})
        assert r.status_code == 200, r.text
    mine = sessions(client, "hdr")
    assert len(mine) == 2 and {s["origin"] for s in mine} == {"X-Claude-Code-Session-Id"}
    assert all(s["id"].startswith("conv-") and "/" not in s["id"] for s in mine)
    uid = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "from-metadata"})
    r = client.post("/v1/messages", json={**body, "cache_salt": "hdr2", "metadata": {"user_id": uid}},
                    headers={"X-Claude-Code-Session-Id": "from-header"})
    assert r.status_code == 200
    assert [s["origin"] for s in sessions(client, "hdr2")] == ["metadata.user_id"]  # metadata first


@pytest.mark.parametrize("key", ["../../etc/passwd", "a\x00b", "conv-" + "0" * 32, "😀" * 50, " "])
def test_keys_of_any_shape_never_become_ids_or_paths(server, key):
    client, _ = server
    codex_turn(client, [{"type": "message", "role": "user", "content": "hi"}], choice="none", key=key,
               max_output_tokens=2)
    (s,) = sessions(client)
    assert s["id"].startswith("conv-") and len(s["id"]) == 39 and key not in s["id"]


def test_many_keys_hold_bounded_state_and_a_long_key_is_a_400(server):
    client, mgr = server
    for i in range(3 * MAX_SESSIONS):
        codex_turn(client, [{"type": "message", "role": "user", "content": "hi"}], choice="none", key=f"k{i}",
                   max_output_tokens=1)
    assert len(sessions(client)) == len(mgr.sessions) == MAX_SESSIONS
    r = client.post("/v1/responses", json={"model": "m", "input": "hi", "prompt_cache_key": "k" * 10_000})
    assert r.status_code == 400 and "prompt_cache_key" in r.text
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 1, "metadata": {"user_id": "u" * 10_000},
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 400 and "metadata" in r.text


def test_a_million_conversation_keys_keep_sessions_and_memory_bounded(engine_f32):
    """The server's path for a request that names a conversation (digest,
    lineage, the session's turn) under a million distinct hostile keys: the
    sessions stay at the cap, their ids are digests, memory does not grow
    with the keys, and the same key under another salt is another session."""
    import re
    import tracemalloc

    from trajserve.server.conversations import conversation_id, lineage
    from trajserve.sessions.manager import SessionManager

    engine_f32.kv.clear_cache()
    mgr = SessionManager(engine_f32, SessionConfig(max_sessions=64))
    prompt = list(range(1, 40))
    shapes = ("../../etc/passwd", "\0\0", "🙂" * 200, "x" * 1000, "conv-0123456789abcdef0123456789abcdef-0", "%s%n")

    def turn(i: int, salt: str = "tenant-a") -> str:
        base = conversation_id(f"{i}{shapes[i % len(shapes)]}", "prompt_cache_key", salt, None)
        s = mgr.before_turn(lineage(mgr.sessions, base, prompt), salt, origin="prompt_cache_key")
        mgr.after_turn(s, prompt, None)
        return s.session_id

    try:
        for i in range(300_000):
            turn(i)
        tracemalloc.start()
        before = tracemalloc.take_snapshot()
        for i in range(300_000, 400_000):
            turn(i)
        grown = sum(d.size_diff for d in tracemalloc.take_snapshot().compare_to(before, "filename"))
        tracemalloc.stop()
        assert grown < 256 * 1024, f"memory grew {grown:,} bytes over 100,000 new keys"
        for i in range(400_000, 1_000_000):
            turn(i)
        assert len(mgr.sessions) == 64
        assert all(re.fullmatch(r"conv-[0-9a-f]{32}-[0-3]", sid) for sid in mgr.sessions)
        assert turn(7, "tenant-b") != turn(7, "tenant-a")  # a key shared across salts shares nothing
    finally:
        mgr.shutdown()
