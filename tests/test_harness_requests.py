"""The requests agent harnesses send as they ship, accepted as they are:
the fields of Codex CLI's Responses requests (namespace tools, a hosted
tool, include, store false, reasoning, prompt_cache_key, client_metadata),
Claude Code's Messages requests (thinking, context_management,
cache_control with ttl, metadata.user_id, anthropic-beta) and OpenAI's
prompt-cache fields on chat; a malformed known field is a 4xx naming it.
Shapes as the clients send them, with this project's own text.

The model's reply is scripted (the `scripted` fixture, conftest.py)."""
from __future__ import annotations

import json

import pytest

NAMESPACE = {"type": "namespace", "name": "agents", "description": "Sub-agents.", "tools": [
    {"type": "function", "name": "spawn", "description": "Start a sub-agent", "strict": False,
     "parameters": {"type": "object", "properties": {"task": {"type": "string"}}, "required": ["task"]}},
    {"type": "function", "name": "close", "strict": False,
     "parameters": {"type": "object", "properties": {"id": {"type": "string"}}}}]}
EXEC = {"type": "function", "name": "exec_command", "description": "Run a shell command", "strict": False,
        "parameters": {"type": "object", "properties": {"cmd": {"type": "string"}}, "required": ["cmd"]}}


def codex_body(**kw) -> dict:
    """A Responses request as Codex CLI sends it (its fields; our text)."""
    return {"model": "m", "stream": False, "tool_choice": "auto", "parallel_tool_calls": True,
            "reasoning": {"summary": "auto"}, "store": False, "include": ["reasoning.encrypted_content"],
            "prompt_cache_key": "0a1b-thread", "client_metadata": {"session_id": "0a1b-thread", "turn_id": "t1"},
            "tools": [EXEC, NAMESPACE, {"type": "web_search", "external_web_access": False}],
            "input": [{"type": "message", "id": "msg_1", "role": "developer",
                       "content": [{"type": "input_text", "text": "You are a coding agent."}]},
                      {"type": "message", "id": "msg_2", "role": "user",
                       "content": [{"type": "input_text", "text": "List the files."}]}], **kw}


@pytest.fixture
def s(scripted):
    scripted["end"], scripted["cached"] = ("stop", None), 0
    return scripted


def test_a_codex_request_is_served(s):
    s["reply"] = "Listing."
    r = s["http"].post("/v1/responses", json=codex_body(), headers={"session-id": "0a1b", "originator": "codex_exec"})
    assert r.status_code == 200, r.text
    body = r.json()
    assert body["status"] == "completed" and body["output"][0]["content"][0]["text"] == "Listing."
    # The hosted tool is left out and named; the namespace's functions reach the model by qualified name.
    assert body["ignored_tools"] == [{"index": 2, "type": "web_search"}]
    prompt = s["tok"].decode(s["prompts"][-1], skip_special_tokens=False)
    assert "web_search" not in prompt
    assert body["store"] is False and s["http"].get(f"/v1/responses/{body['id']}").status_code == 404


def test_a_namespaced_call_comes_back_under_its_own_name_and_goes_in_again_unchanged(s):
    s["reply"] = '<tool_call>\n{"name": "agents.spawn", "arguments": {"task": "lint"}}\n</tool_call>'
    body = codex_body(tools=[EXEC, NAMESPACE])
    r = s["http"].post("/v1/responses", json=body).json()
    (call,) = r["output"]
    assert (call["type"], call["name"], call["namespace"], json.loads(call["arguments"])) == \
        ("function_call", "spawn", "agents", {"task": "lint"})
    first = s["prompts"][-1]
    # The client sends the call back with its result: the history renders as
    # the model wrote it (agents.spawn), so the prefix cache still matches.
    s["reply"] = "Started."
    follow = codex_body(tools=[EXEC, NAMESPACE], input=body["input"] + [
        {k: call[k] for k in ("type", "call_id", "name", "namespace", "arguments")},
        {"type": "function_call_output", "call_id": call["call_id"], "output": "agent 7"}])
    assert s["http"].post("/v1/responses", json=follow).status_code == 200
    second = s["prompts"][-1]
    assert second[:len(first)] == first
    assert '"name": "agents.spawn"' in s["tok"].decode(second[len(first):], skip_special_tokens=False)
    # Streamed, the same item.
    s["reply"] = '<tool_call>\n{"name": "agents.close", "arguments": {"id": "7"}}\n</tool_call>'
    with s["http"].stream("POST", "/v1/responses", json={**body, "stream": True}) as resp:
        events = [json.loads(line[6:]) for line in resp.iter_lines() if line.startswith("data: ")]
    done = [e["item"] for e in events if e.get("type") == "response.output_item.done"]
    assert [(d["name"], d["namespace"]) for d in done] == [("close", "agents")]


@pytest.mark.parametrize("field, value, named", [
    ("prompt_cache_key", 5, "prompt_cache_key"), ("prompt_cache_key", "k" * 2000, "prompt_cache_key"),
    ("include", "reasoning.encrypted_content", "include"), ("client_metadata", {"turn": 1}, "client_metadata"),
    ("reasoning", "high", "reasoning"), ("prompt_cache_retention", "1y", "prompt_cache_retention"),
    ("store", "no", "store"), ("tools", [{"type": "namespace", "name": "agents"}], "tools.0"),
    ("tools", [{"type": "namespace", "name": "x", "tools": [{"type": "web_search"}]}], "tools.0.tools.0"),
    ("tools", [EXEC, {**EXEC}], "tools.1"),
])
def test_a_malformed_known_responses_field_is_a_400_naming_it(s, field, value, named):
    r = s["http"].post("/v1/responses", json=codex_body(**{field: value}))
    assert r.status_code == 400 and named in r.text, r.text


def claude_body(**kw) -> dict:
    """A Messages request as Claude Code sends it (its fields; our text)."""
    return {"model": "claude-test", "max_tokens": 32000, "stream": False,
            "thinking": {"type": "enabled", "budget_tokens": 31999},
            "context_management": {"edits": [{"type": "clear_thinking_20251015", "keep": "all"}]},
            "metadata": {"user_id": json.dumps({"device_id": "d" * 64, "account_uuid": "",
                                                "session_id": "5f0c-session"})},
            "system": [{"type": "text", "text": "You are a CLI agent.", "cache_control": {"type": "ephemeral"}}],
            "tools": [{"name": "Bash", "description": "Run a command", "input_schema": {
                "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]},
                "cache_control": {"type": "ephemeral", "ttl": "1h"}}],
            "messages": [{"role": "user", "content": [
                {"type": "text", "text": "List the files.", "cache_control": {"type": "ephemeral", "ttl": "5m"}}]}],
            **kw}


def test_claude_codes_mid_conversation_system_message(s):
    """Claude Code 2.1's first request: a user message, then a system one
    (its beta mid-conversation-system), adaptive thinking, an effort."""
    s["reply"] = "ok"
    body = claude_body(thinking={"type": "adaptive"}, output_config={"effort": "high"}, messages=[
        {"role": "user", "content": [{"type": "text", "text": "List the files."}]},
        {"role": "system", "content": "Agent types available: explore, review."}])
    r = s["http"].post("/v1/messages", json=body)
    assert r.status_code == 200, r.text
    prompt = s["tok"].decode(s["prompts"][-1], skip_special_tokens=False)
    assert prompt.index("List the files.") < prompt.index("Agent types available") < prompt.rindex("assistant")
    bad = claude_body(messages=[{"role": "system", "content": [{"type": "image", "source": {}}]}])
    assert s["http"].post("/v1/messages", json=bad).status_code == 400


def test_a_claude_code_request_is_served(s):
    s["reply"] = "Listing."
    r = s["http"].post("/v1/messages", json=claude_body(), headers={
        "anthropic-beta": "claude-code-20250219,context-management-2025-06-27", "anthropic-version": "2023-06-01"})
    assert r.status_code == 200, r.text
    assert r.json()["content"] == [{"type": "text", "text": "Listing."}] and "ignored_tools" not in r.json()
    # Anthropic's own tool types are left out and named, never a 400.
    s["reply"] = "ok"
    body = claude_body(tools=claude_body()["tools"] + [{"type": "web_search_20250305", "name": "web_search"}])
    r = s["http"].post("/v1/messages", json=body)
    assert r.status_code == 200 and r.json()["ignored_tools"] == [{"index": 1, "type": "web_search_20250305"}]
    assert "web_search" not in s["tok"].decode(s["prompts"][-1], skip_special_tokens=False)


@pytest.mark.parametrize("field, value, named", [
    ("thinking", {"type": "on"}, "thinking"), ("thinking", {"type": "enabled", "budget_tokens": 10}, "thinking"),
    ("metadata", {"user_id": 5}, "metadata"), ("context_management", {"edits": "all"}, "context_management"),
    ("system", [{"type": "text", "text": "x", "cache_control": {"type": "ephemeral", "ttl": "2h"}}], "system"),
    ("tools", [{"name": "Bash", "cache_control": {"type": "forever"}}], "tools"),
])
def test_a_malformed_known_messages_field_is_a_400_naming_it(s, field, value, named):
    r = s["http"].post("/v1/messages", json=claude_body(**{field: value}))
    assert r.status_code == 400 and named in r.text, r.text


def test_chat_takes_openais_prompt_cache_fields(s):
    s["reply"] = "ok"
    msgs = [{"role": "user", "content": "hi"}]
    r = s["client"].chat.completions.create(model="m", messages=msgs, prompt_cache_key="conv-1",
                                            prompt_cache_retention="24h", store=False, metadata={"app": "x"},
                                            user="u1", safety_identifier="h")
    assert r.choices[0].message.content == "ok"
    for field, value in (("metadata", {"app": 1}), ("prompt_cache_key", ["a"]), ("store", "yes"),
                         ("prompt_cache_retention", "forever")):
        r = s["http"].post("/v1/chat/completions", json={"model": "m", "messages": msgs, field: value})
        assert 400 <= r.status_code < 500 and field in r.text, r.text
