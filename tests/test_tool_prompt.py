"""Tools for a chat template that renders none (model/tool_prompt.py): with
--tool-prompt hermes they reach the model in the system message, the same
text every turn; without it the reply and the log say they were not shown."""
from __future__ import annotations

import copy
import json
import logging

import pytest

from trajserve.model.tokenizer import load_tokenizer
from trajserve.model.tool_prompt import template_shows_tools

TOOL = {"type": "function", "function": {"name": "list_files", "description": "List a directory",
                                         "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}}}


@pytest.fixture
def tok():
    t = load_tokenizer(None)  # the embedded model's: its template renders no tools
    assert not template_shows_tools(t.chat_template) and not t.shows_tools
    return t


def test_without_the_option_the_embedded_template_drops_tools(tok):
    msgs = [{"role": "user", "content": "List /tmp."}]
    assert tok.apply_chat_template(msgs, tools=[TOOL]) == tok.apply_chat_template(msgs)


def test_hermes_writes_the_tools_into_the_system_message(tok):
    tok = copy.copy(tok)
    tok.tool_prompt = "hermes"
    assert tok.shows_tools
    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "List /tmp."}]
    text = tok.apply_chat_template(msgs, tools=[TOOL])
    system = text[:text.index("<|im_start|>user")]
    assert system.startswith("<|im_start|>system\nYou are terse.\n\n# Tools")
    assert f"<tools>\n{json.dumps(TOOL)}\n</tools>" in system and "<tool_call>" in system
    # No system message: one is made for the tools; no tools: nothing changes.
    assert tok.apply_chat_template(msgs[1:], tools=[TOOL]).startswith("<|im_start|>system\n# Tools")
    assert tok.apply_chat_template(msgs) == copy.copy(tok).apply_chat_template(msgs)
    # The next turn's prompt starts with this one's text: the prefix cache still serves it.
    first = tok.apply_chat_template(msgs, tools=[TOOL])
    later = tok.apply_chat_template(msgs + [{"role": "assistant", "content": "a b"},
                                            {"role": "user", "content": "More."}], tools=[TOOL])
    assert later.startswith(first[:first.rindex("<|im_start|>assistant")])


def test_a_template_that_renders_tools_is_left_alone(tok):
    tok = copy.copy(tok)
    tok.chat_template = "{% for t in tools %}{{ t.function.name }};{% endfor %}{{ messages[0].content }}"
    tok.tool_prompt = "hermes"
    assert tok.apply_chat_template([{"role": "user", "content": "hi"}], tools=[TOOL]) == "list_files;hi"


def test_the_reply_says_the_tools_were_not_shown(scripted, caplog):
    s = scripted
    s["reply"], s["end"], s["cached"] = "ok", ("stop", None), 0
    msgs = [{"role": "user", "content": "List /tmp."}]
    with caplog.at_level(logging.WARNING, logger="trajserve.server"):
        chat = s["http"].post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [TOOL]}).json()
        s["http"].post("/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [TOOL]})
    assert "1 tool definitions were not shown" in chat["tools_not_shown"] and "--tool-prompt" in chat["tools_not_shown"]
    assert sum("tools_not_shown" in r.getMessage() for r in caplog.records) == 1  # once per server, not per request
    assert "tools_not_shown" not in s["http"].post("/v1/chat/completions", json={"model": "m", "messages": msgs}).json()
    with s["http"].stream("POST", "/v1/chat/completions", json={"model": "m", "messages": msgs, "tools": [TOOL],
                                                                 "stream": True, "max_tokens": 4}) as r:
        chunks = [json.loads(line[6:]) for line in r.iter_lines() if line.startswith("data: {")]
    assert "not shown" in chunks[0]["tools_not_shown"]  # a stream says it in its first chunk, once
    assert all("tools_not_shown" not in c for c in chunks[1:])
    msg = s["http"].post("/v1/messages", json={"model": "m", "max_tokens": 5, "messages": msgs, "tools": [
        {"name": "list_files", "input_schema": {"type": "object"}}]}).json()
    assert "not shown" in msg["tools_not_shown"]
    resp = s["http"].post("/v1/responses", json={"model": "m", "input": "List /tmp.", "tools": [
        {"type": "function", "name": "list_files", "parameters": {"type": "object"}}]}).json()
    assert "not shown" in resp["tools_not_shown"]
