"""Prefix-break diagnosis (server/prefix_break.py): one test per cause class
on prompts rendered by the embedded model's template, no break where a
conversation only grows (its reply re-encoded otherwise included), and the
server's report of it: the reply's prefix_break, the session's record,
/metrics."""
from __future__ import annotations

import copy
import json

import pytest

from trajserve.model.tokenizer import load_tokenizer
from trajserve.server.prefix_break import TurnShape, diagnose

TOOL = {"type": "function", "function": {"name": "run", "description": "Run a command", "parameters": {
    "type": "object", "properties": {"cmd": {"type": "string"}, "timeout": {"type": "integer"}}}}}
GREP = {"type": "function", "function": {"name": "grep", "description": "Search files", "parameters": {
    "type": "object", "properties": {"pattern": {"type": "string"}}}}}
SYSTEM = "You are a coding agent in a repository of Python files. Keep answers short. Today is 2026-12-03 09:14:07."


@pytest.fixture(scope="module")
def tok():
    t = copy.copy(load_tokenizer(None))
    t.tool_prompt = "hermes"  # the tools reach the prompt, as a template that renders them would
    return t


def turn(tok, messages, tools=(TOOL,), reply=None):
    """(prompt ids, shape, context: the prompt and the reply's ids)."""
    tools = list(tools)
    ids = tok.encode_chat(messages, tools=tools)
    shape = TurnShape.of(len(ids), messages, tools)
    return ids, shape, ids + tok.encode(reply or "Done.<|im_end|>", add_special_tokens=False)


def check(tok, first, second):
    _, before, context = first
    ids, now, _ = second
    return diagnose(1, context, before, ids, now, lambda t: tok.decode(t, skip_special_tokens=False))


CHAT = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": "Run the tests."}]
NEXT = CHAT + [{"role": "assistant", "content": "Done."}, {"role": "user", "content": "Now lint."}]


def test_a_conversation_that_only_grows_has_no_break(tok):
    assert check(tok, turn(tok, CHAT), turn(tok, NEXT)) is None
    # The reply's tokens were not its text's canonical encoding: re-encoded, the prompt still keeps
    # the previous prompt whole, which is no break.
    odd = [tok.encode("D", add_special_tokens=False)[0], *tok.encode("one.", add_special_tokens=False)]
    ids, shape, _ = turn(tok, CHAT)
    assert diagnose(1, ids + odd, shape, turn(tok, NEXT)[0], turn(tok, NEXT)[1], tok.decode) is None


def test_a_timestamp_in_the_system_prompt(tok):
    later = [{"role": "system", "content": SYSTEM.replace("2026-12-03 09:14:07", "2026-12-03 09:15:31")}] + NEXT[1:]
    b = check(tok, turn(tok, CHAT), turn(tok, later))
    assert b.cause == "volatile_field"
    assert "09:14" in b.previous and "09:15" in b.now
    ids = turn(tok, CHAT)[0]
    text_before = tok.decode(ids[:b.position], skip_special_tokens=False)
    assert text_before.endswith(("09:", "09:1", "09")) and b.position < len(ids)
    assert b.lost_tokens == len(turn(tok, CHAT)[2]) - b.position  # all of the previous context past it


def test_a_tool_added_mid_conversation(tok):
    b = check(tok, turn(tok, CHAT), turn(tok, NEXT, tools=(TOOL, GREP)))
    assert b.cause == "tools_changed"
    assert "</tools>" in b.previous and '{"type": "function"' in b.now.split("}}}}}")[1]  # where the new one starts


def test_tool_schemas_re_serialized_in_another_key_order(tok):
    props = TOOL["function"]["parameters"]["properties"]
    swapped = json.loads(json.dumps(TOOL))
    swapped["function"]["parameters"]["properties"] = dict(reversed(list(props.items())))
    b = check(tok, turn(tok, CHAT), turn(tok, NEXT, tools=(swapped,)))
    assert b.cause == "reserialized"


def test_compaction(tok):
    long = CHAT + [{"role": "assistant", "content": "Ran 40 tests."}, {"role": "user", "content": "Fix them."},
                   {"role": "assistant", "content": "Fixed three."}, {"role": "user", "content": "Go on."}]
    compacted = [CHAT[0], {"role": "user", "content": "Summary: tests ran, three fixed. Go on."}]
    b = check(tok, turn(tok, long), turn(tok, compacted))
    assert b.cause == "compaction"


def test_a_new_system_prompt(tok):
    other = [{"role": "system", "content": SYSTEM.replace("Keep answers short", "Explain every step")}] + NEXT[1:]
    assert check(tok, turn(tok, CHAT), turn(tok, other)).cause == "system_prompt"


def test_the_server_reports_a_break_to_its_client(engine_f32):
    """Codex-shaped requests on the real model: a growing thread reports no
    break; a turn whose developer message carries a new time reports one, in
    the reply, the session's record and /metrics."""
    from fastapi.testclient import TestClient

    from trajserve.server.app import build_app
    from trajserve.server.config import ServerConfig

    engine_f32.kv.clear_cache()
    app = build_app(engine_f32, ServerConfig(served_model_names=("m",)))
    app.state.engine.start()
    try:
        with TestClient(app) as client:
            def send(items):
                r = client.post("/v1/responses", json={"model": "m", "input": items, "store": False,
                                                       "prompt_cache_key": "t-1", "max_output_tokens": 8,
                                                       "temperature": 0})
                assert r.status_code == 200, r.text
                return r.json()

            dev = {"type": "message", "role": "developer", "content": SYSTEM}
            items = [dev, {"type": "message", "role": "user", "content": "Run the tests."}]
            first = send(items)
            text = "".join(c["text"] for o in first["output"] if o["type"] == "message" for c in o["content"])
            items += [{"type": "message", "role": "assistant", "content": text},
                      {"type": "message", "role": "user", "content": "Now lint."}]
            assert "prefix_break" not in send(items)
            items[0] = {**dev, "content": SYSTEM.replace("09:14:07", "09:20:45")}
            third = send(items)
            b = third["prefix_break"]
            assert b["cause"] == "volatile_field" and b["turn"] == 2 and b["lost_tokens"] > 20
            (s,) = client.get("/v1/sessions").json()["data"]
            info = client.get(f"/v1/sessions/{s['id']}").json()
            assert info["prefix_breaks"] == [b]
            hits = info["turn_hits"]  # H_prefix turn by turn (eq. 2)
            assert len(hits) == 3 and hits[0]["prompt_tokens"] == first["usage"]["input_tokens"]
            assert hits[1]["hit_rate"] > 0.5  # the grown thread was served from the cache
            assert hits[2]["cached_tokens"] <= b["position"]  # nothing past the break
            metrics = client.get("/metrics").text
            assert 'trajserve_prefix_breaks_total{cause="volatile_field"} 1.0' in metrics
            assert f'trajserve_prefix_break_lost_tokens_total{{cause="volatile_field"}} {float(b["lost_tokens"])}' \
                in metrics
    finally:
        app.state.engine.shutdown()
        app.state.sessions.shutdown()
