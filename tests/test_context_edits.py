"""Anthropic's context_management edits (server/context_edits.py): past its
trigger, clear_tool_uses replaces the oldest tool results with a
placeholder in the prompt the model sees, keeps the most recent and the
excluded tools', honours clear_at_least, clears inputs when asked, and the
reply says what it did; clear_thinking is accepted and has nothing to do."""
from __future__ import annotations

import pytest

from trajserve.server.context_edits import PLACEHOLDER

TOOLS = [{"name": n, "description": f"the {n} tool", "input_schema": {
    "type": "object", "properties": {"arg": {"type": "string"}}}} for n in ("Bash", "Read")]


def conversation(n_uses: int) -> list[dict]:
    msgs = [{"role": "user", "content": "Look around the repository."}]
    for i in range(n_uses):
        name = "Read" if i == 1 else "Bash"
        msgs.append({"role": "assistant", "content": [
            {"type": "tool_use", "id": f"t{i}", "name": name, "input": {"arg": f"secret-input-{i}"}}]})
        msgs.append({"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": f"t{i}", "content": f"result-{i} " + "line of output " * 40}]})
    return msgs


def ask(scripted, edits, n_uses=5):
    scripted["reply"], scripted["end"] = "ok", ("stop", None)
    r = scripted["http"].post("/v1/messages", json={
        "model": "m", "max_tokens": 4, "tools": TOOLS, "messages": conversation(n_uses),
        "context_management": {"edits": edits}})
    return r, scripted["tok"].decode(scripted["prompts"][-1])


def edit(**kw):
    return {"type": "clear_tool_uses_20250919", **kw}


def test_past_the_trigger_the_oldest_results_are_cleared_and_the_reply_says_so(scripted):
    r, prompt = ask(scripted, [edit(trigger={"type": "input_tokens", "value": 100},
                                    keep={"type": "tool_uses", "value": 2})])
    assert r.status_code == 200, r.text
    (applied,) = r.json()["context_management"]["applied_edits"]
    assert applied["type"] == "clear_tool_uses_20250919" and applied["cleared_tool_uses"] == 3
    assert applied["cleared_input_tokens"] > 3 * 60  # three results of ~80 tokens each, less the placeholders
    assert prompt.count(PLACEHOLDER) == 3
    assert all(f"result-{i}" not in prompt for i in range(3)) and all(f"result-{i}" in prompt for i in (3, 4))
    assert "secret-input-0" in prompt  # inputs stay unless asked


def test_below_the_trigger_nothing_changes(scripted):
    r, prompt = ask(scripted, [edit(), {"type": "clear_thinking_20251015", "keep": "all"}])  # 100,000 by default
    assert r.status_code == 200 and "context_management" not in r.json()
    assert PLACEHOLDER not in prompt and all(f"result-{i}" in prompt for i in range(5))
    r, _ = ask(scripted, [edit(trigger={"type": "tool_uses", "value": 5})])  # five uses: not past it
    assert "context_management" not in r.json()


def test_excluded_tools_inputs_and_clear_at_least(scripted):
    r, prompt = ask(scripted, [edit(trigger={"type": "tool_uses", "value": 1}, keep={"type": "tool_uses", "value": 1},
                                    exclude_tools=["Read"], clear_tool_inputs=True)])
    assert r.json()["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 3  # 0, 2, 3: not Read's 1
    assert "result-1" in prompt and "secret-input-1" in prompt and "result-4" in prompt
    assert all(f"secret-input-{i}" not in prompt for i in (0, 2, 3))
    # clear_at_least: oldest first, only as many as that takes ...
    r, prompt = ask(scripted, [edit(trigger={"type": "tool_uses", "value": 1},
                                    clear_at_least={"type": "input_tokens", "value": 150})])
    assert r.json()["context_management"]["applied_edits"][0]["cleared_tool_uses"] == 2
    assert "result-2" in prompt
    # ... and nothing when the eligible results do not hold that much.
    r, prompt = ask(scripted, [edit(trigger={"type": "tool_uses", "value": 1},
                                    clear_at_least={"type": "input_tokens", "value": 10**6})])
    assert "context_management" not in r.json() and PLACEHOLDER not in prompt


@pytest.mark.parametrize("bad", [edit(keep={"type": "input_tokens", "value": 2}),
                                 edit(trigger={"type": "tokens", "value": 2}),
                                 edit(clear_at_least={"type": "tool_uses", "value": 2}),
                                 edit(keep={"type": "tool_uses", "value": -1})])
def test_a_malformed_edit_is_a_400_naming_it(scripted, bad):
    r, _ = ask(scripted, [bad])
    assert r.status_code == 400, r.text
    assert "context_management" in r.json()["error"]["message"]
