"""Hints written for other engines (server/hints.py), on the real model:
vLLM's kv_hints envelope and Dynamo's nvext.agent_hints / agent_context
reach the session's pause and the request's priority; what is not applied, or
unknown, is counted."""
from __future__ import annotations

import pytest

from server_util import served
from trajserve.server.config import ServerConfig


@pytest.fixture
def client(engine_f32):
    with served(engine_f32, ServerConfig(served_model_names=("m",))) as c:
        yield c


def chat(client, text="Say hi.", **extra):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": text}],
                                                  "max_tokens": 4, "temperature": 0, **extra})
    assert r.status_code == 200, r.text
    return r.json()


def envelope(*actions):
    return {"protocol_version": "0.1", "message_id": "msg-1",
            "actions": [{"action_id": f"a{i}", "action_type": t, "action_version": "1", "payload": p}
                        for i, (t, p) in enumerate(actions)]}


def only_session(client):
    (s,) = client.get("/v1/sessions").json()["data"]
    return s


def counted(client, source, hint, outcome) -> float:
    want = f'trajserve_hints_total{{hint="{hint}",outcome="{outcome}",source="{source}"}} '
    lines = [ln for ln in client.get("/metrics").text.splitlines() if ln.startswith(want)]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_dynamo_agent_context_names_the_conversation_and_hints_reach_it(client):
    nvext = {"agent_context": {"session_type_id": "coding_agent", "session_id": "run-1", "trajectory_id": "run-1:main"},
             "agent_hints": {"priority": 5, "osl": 64, "speculative_prefill": True}}
    chat(client, nvext=nvext)
    s = only_session(client)
    assert s["origin"] == "nvext.agent_context" and s["state"] == "paused"
    assert s["decision"]["decision"] == "keep"  # speculative_prefill: warm for the next turn
    assert counted(client, "agent_hints", "speculative_prefill", "applied") == 1
    assert counted(client, "agent_hints", "priority", "applied") == 1  # the request's priority (-5)
    assert counted(client, "agent_hints", "osl", "not_applied") == 1


@pytest.mark.parametrize("action, payload, decision, waiting_for", [
    ("retain_full_prompt", {"ttl_seconds": 600}, "keep", None),
    ("tool_wait", {"expected_wait_s": 30, "tool": "pytest"}, None, "pytest"),
    ("release", {}, "drop", None),
])
def test_vllm_kv_hints_actions_set_the_pause(client, action, payload, decision, waiting_for):
    chat(client, prompt_cache_key="c-1", kv_hints=envelope((action, payload), ("prefetch_sibling", {"x": 1})))
    s = only_session(client)
    assert s["state"] == "paused"
    if decision is not None:
        assert s["decision"]["decision"] == decision
    # A hint's pause replaces the inferred one: it waits for the tool the hint names, if any.
    assert s["waiting_for"] == waiting_for
    assert counted(client, "kv_hints", action, "applied") == 1
    assert counted(client, "kv_hints", "unknown", "unknown") == 1  # ignored, counted, never a label of its own


def test_the_requests_own_fields_win_and_a_hint_without_a_session_is_counted(client):
    chat(client, prompt_cache_key="c-2", tool_decision="drop", kv_hints=envelope(("retain_full_prompt",
                                                                                   {"ttl_seconds": 600})))
    assert only_session(client)["decision"]["decision"] == "drop"
    chat(client, text="Another.", kv_hints=envelope(("release", {})))  # no conversation named: no session
    assert counted(client, "kv_hints", "release", "no_session") == 1


@pytest.mark.parametrize("bad", [
    {"kv_hints": {"protocol_version": "0.1", "actions": []}},  # no message_id
    {"kv_hints": {"protocol_version": "0.1", "message_id": "m", "actions": "all"}},
    {"kv_hints": envelope(*[("release", {})] * 65)},
    {"nvext": {"agent_hints": {"speculative_prefill": "yes"}}},
    {"nvext": {"agent_context": {"trajectory_id": "t" * 2000}}},
])
def test_a_malformed_envelope_is_a_4xx_naming_it(client, bad):
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 2, **bad})
    assert 400 <= r.status_code < 500 and next(iter(bad)) in r.text, r.text
