"""`trajserve doctor` over a recorded request log: conversations grouped as
the server groups them, no break where a harness's prefix is stable (a
Claude-Code-shaped and a Codex-shaped sequence that only grow), a break with
its cause where the system prompt's timestamp moved, a side call its own
lineage, unreadable lines reported."""
from __future__ import annotations

import json

from test_cli import trajserve

SYSTEM = "You are a command-line coding agent. Today is 2026-12-03 09:14:07. Work in the repository given."
USER_ID = json.dumps({"device_id": "d" * 64, "account_uuid": "", "session_id": "cc-1"})
TOOLS = [{"name": "Bash", "description": "Run a command", "input_schema": {
    "type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}]


def claude(messages, system=SYSTEM):
    return {"api": "messages", "body": {"model": "claude-x", "max_tokens": 32000, "system": [
        {"type": "text", "text": system, "cache_control": {"type": "ephemeral"}}], "tools": TOOLS,
        "metadata": {"user_id": USER_ID}, "messages": messages}}


def codex(items):
    return {"api": "responses", "body": {"model": "m", "store": False, "prompt_cache_key": "thread-9", "input": items,
                                         "tools": [{"type": "function", "name": "exec_command", "parameters": {
                                             "type": "object", "properties": {"cmd": {"type": "string"}}}}]}}


def test_doctor_over_a_recorded_log(tmp_path):
    m1 = [{"role": "user", "content": "Run the tests."}]
    m2 = m1 + [{"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "Bash",
                                                  "input": {"command": "pytest -q"}}]},
               {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "3 failed"}]}]
    m3 = m2 + [{"role": "assistant", "content": "Three tests fail."}, {"role": "user", "content": "Fix them."}]
    x1 = [{"type": "message", "role": "developer", "content": "You run commands."},
          {"type": "message", "role": "user", "content": "List the files."}]
    x2 = x1 + [{"type": "function_call", "call_id": "c1", "name": "exec_command", "arguments": '{"cmd": "ls"}'},
               {"type": "function_call_output", "call_id": "c1", "output": "README.md setup.py"}]
    x3 = x2 + [{"type": "message", "role": "assistant", "content": "Two files."},
               {"type": "message", "role": "user", "content": "Read the README."}]
    lines = [claude(m1), codex(x1), claude(m2), codex(x2),
             claude([{"role": "user", "content": "Title this conversation."}], system="Write a five-word title."),
             claude(m3), codex(x3), claude(m3, system=SYSTEM.replace("09:14:07", "09:31:55")), {"api": "chat"},
             {"api": "messages", "body": {"model": "m", "max_tokens": 5, "metadata": {"user_id": USER_ID},
                                          "messages": [{"role": "wizard", "content": "hi"}]}}]
    log = tmp_path / "requests.jsonl"
    log.write_text("\n".join(json.dumps(x) for x in lines) + "\n")
    r = trajserve("doctor", str(log), "--tool-prompt", "hermes", "--json", timeout=300)
    assert r.returncode == 0, r.stderr
    report = json.loads(r.stdout)
    by_origin = {}
    for c in report["conversations"]:
        by_origin.setdefault(c["origin"], []).append(c)
    (thread,) = by_origin["prompt_cache_key"]
    assert thread["turns"] == 3 and thread["breaks"] == [] and thread["h_prefix_bound"] > 0.5
    main, side = sorted(by_origin["metadata.user_id"], key=lambda c: -c["turns"])
    assert (main["turns"], side["turns"]) == (4, 1)  # the title call is a lineage of its own
    (b,) = main["breaks"]  # only the moved timestamp
    assert (b["line"], b["cause"]) == (8, "volatile_field") and "09:1" in b["previous"] and "09:3" in b["now"]
    assert b["lost_tokens"] > 100
    assert report["breaks_by_cause"] == {"volatile_field": 1}
    assert [s["line"] for s in report["skipped"]] == [9, 10]


def test_doctor_finds_no_break_in_the_real_clients_sessions(tmp_path):
    """Request sequences captured from the real clients (tests/clients/:
    Claude Code 2.1.197 and Codex CLI 0.171.0, each a session of four calls
    with two executed shell calls and a continued turn, as
    tests/test_real_clients.py runs them): one conversation each, no break."""
    import gzip
    from pathlib import Path

    here = Path(__file__).parent / "clients"
    codex_log = tmp_path / "codex.jsonl"
    codex_log.write_bytes(gzip.decompress((here / "codex_0.171.0.jsonl.gz").read_bytes()))
    for log, origin in ((here / "claude_code_2.1.197.jsonl", "metadata.user_id"), (codex_log, "prompt_cache_key")):
        r = trajserve("doctor", str(log), "--tool-prompt", "hermes", "--json", timeout=300)
        assert r.returncode == 0, r.stderr
        (conv,) = json.loads(r.stdout)["conversations"]
        assert (conv["origin"], conv["turns"], conv["breaks"]) == (origin, 4, [])
        assert conv["h_prefix_bound"] > 0.9 and all(t["reusable_share"] > 0.9 for t in conv["turn_list"][1:])
