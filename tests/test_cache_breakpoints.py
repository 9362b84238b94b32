"""Anthropic's cache_control marks as usage counts them
(server/cache_breakpoints.py): a scripted write-then-read sequence gives
Anthropic's fields, the 5m / 1h split included; without marks, the
automatic count."""
from __future__ import annotations

import json

import pytest

from trajserve.server.cache_breakpoints import usage

SYSTEM = [{"type": "text", "text": "You are a coding agent. " * 20, "cache_control": {"type": "ephemeral"}}]


def body(user_ttl="1h", **kw):
    return {"model": "m", "max_tokens": 5, "system": SYSTEM, "messages": [
        {"role": "user", "content": [{"type": "text", "text": "Fix the failing test in tests/test_io.py. " * 10,
                                      "cache_control": {"type": "ephemeral", "ttl": user_ttl}}]},
        {"role": "assistant", "content": "On it."},
        {"role": "user", "content": "Go."}], **kw}


def test_the_arithmetic():
    # No marks: every cached token is a read, the rest input.
    assert usage(100, 48, [], 3) == {"input_tokens": 52, "cache_creation_input_tokens": 0,
                                     "cache_read_input_tokens": 48, "output_tokens": 3,
                                     "cache_creation": {"ephemeral_5m_input_tokens": 0, "ephemeral_1h_input_tokens": 0}}
    marks = [(30, "1h"), (70, "5m")]
    cold = usage(100, 0, marks, 1)
    assert (cold["cache_creation_input_tokens"], cold["cache_read_input_tokens"], cold["input_tokens"]) == (70, 0, 30)
    assert cold["cache_creation"] == {"ephemeral_1h_input_tokens": 30, "ephemeral_5m_input_tokens": 40}
    warm = usage(100, 96, marks, 1)  # served past the last mark: only up to it is a read, as Anthropic counts
    assert (warm["cache_creation_input_tokens"], warm["cache_read_input_tokens"], warm["input_tokens"]) == (0, 70, 30)
    part = usage(100, 48, marks, 1)
    assert (part["cache_creation_input_tokens"], part["cache_read_input_tokens"]) == (22, 48)
    assert part["cache_creation"] == {"ephemeral_1h_input_tokens": 0, "ephemeral_5m_input_tokens": 22}


@pytest.fixture
def s(scripted):
    scripted["reply"], scripted["end"], scripted["cached"] = "ok", ("stop", None), 0
    return scripted


def test_write_then_read(s):
    first = s["http"].post("/v1/messages", json=body()).json()["usage"]
    prompt = len(s["prompts"][-1])
    written = first["cache_creation_input_tokens"]
    assert first["cache_read_input_tokens"] == 0 and 0 < written < prompt
    assert first["input_tokens"] + written == prompt
    # The 1h mark is the last (the first user message): everything written counts as 1h.
    assert first["cache_creation"] == {"ephemeral_1h_input_tokens": written, "ephemeral_5m_input_tokens": 0}
    # The same prompt again, its whole prefix cached: reads up to the last mark, nothing written.
    s["cached"] = prompt - prompt % 16
    again = s["http"].post("/v1/messages", json=body()).json()["usage"]
    assert (again["cache_read_input_tokens"], again["cache_creation_input_tokens"], again["input_tokens"]) == \
        (written, 0, prompt - written)
    # Streamed, the same fields.
    with s["http"].stream("POST", "/v1/messages", json=body(stream=True)) as r:
        events = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: ")]
    start = next(e for e in events if e["type"] == "message_start")["message"]["usage"]
    end = next(e for e in events if e["type"] == "message_delta")["usage"]
    assert start["cache_read_input_tokens"] == end["cache_read_input_tokens"] == written


def test_the_split_follows_the_marks_ttls(s):
    u = s["http"].post("/v1/messages", json=body(user_ttl="5m")).json()["usage"]
    # Both marks 5m now.
    assert u["cache_creation"]["ephemeral_1h_input_tokens"] == 0
    assert u["cache_creation"]["ephemeral_5m_input_tokens"] == u["cache_creation_input_tokens"] > 0
    only_system = dict(body(), messages=[{"role": "user", "content": "Go."}])
    sys_written = s["http"].post("/v1/messages", json=only_system).json()["usage"]["cache_creation_input_tokens"]
    assert 0 < sys_written < u["cache_creation_input_tokens"]  # the system mark comes first
    plain = s["http"].post("/v1/messages", json={**body(), "system": "You are a coding agent.", "messages": [
        {"role": "user", "content": "Go."}]}).json()["usage"]
    assert plain["cache_creation_input_tokens"] == 0  # no marks: the automatic count
