"""Anthropic's Messages API (server/anthropic.py) as the official anthropic
client reads it: the prompt a request becomes (the same as the chat
endpoint's for the same conversation), text and tool_use replies streamed
and not, stop reasons, usage with cached tokens, prefill, count_tokens and
errors in Anthropic's shape.

The model's reply is scripted (the `scripted` fixture, conftest.py);
everything from the reply to the client's objects is real. A test against
the real model over HTTP is in test_server.py."""
from __future__ import annotations

import json

import anthropic
import pytest
from server_util import agent_turns

from trajserve.server.tool_calls import hermes_text

CALL = '<tool_call>\n{"name": "run_tests", "arguments": {"path": "tests/", "k": 3}}\n</tool_call>'
TOOLS = [{"name": "run_tests", "description": "Run the test suite",
          "input_schema": {"type": "object", "properties": {"path": {"type": "string"}, "k": {"type": "integer"}}}}]
OPENAI_TOOLS = [{"type": "function", "function": {"name": t["name"], "description": t["description"],
                                                  "parameters": t["input_schema"]}} for t in TOOLS]


@pytest.fixture
def s(scripted):
    scripted["end"], scripted["cached"] = ("stop", None), 0
    return scripted


def create(s, **kw):
    kw = {"model": "claude-test", "max_tokens": 64, "messages": [{"role": "user", "content": "Run the tests."}], **kw}
    return s["anthropic"].messages.create(**kw)


def test_a_text_reply_and_its_usage(s):
    s["reply"], s["cached"] = "All good.", 5
    r = create(s)
    assert r.type == "message" and r.role == "assistant" and r.id.startswith("msg_")
    assert [(b.type, b.text) for b in r.content] == [("text", "All good.")]
    assert r.stop_reason == "end_turn" and r.stop_sequence is None
    prompt_len = len(s["prompts"][-1])
    # Anthropic counts input_tokens without the tokens read from the cache.
    assert (r.usage.input_tokens, r.usage.cache_read_input_tokens) == (prompt_len - 5, 5)
    assert r.usage.output_tokens == 2  # two 5-character pieces, one token each
    assert r.model == "claude-test"  # the name the request used
    # "claude-test" is an alias of the served model (serve --served-model-name m claude-test).
    assert [m["id"] for m in s["http"].get("/v1/models").json()["data"]] == ["m", "claude-test"]


def test_the_prompt_is_the_chat_endpoints_for_the_same_conversation(s):
    """System, text blocks, an assistant tool_use and the user's tool_result
    become the system / user / assistant tool_calls / tool messages that the
    OpenAI endpoint renders: the same token ids reach the engine."""
    s["reply"] = "3 passed."
    create(s, system=[{"type": "text", "text": "You are terse."}], tools=TOOLS, messages=[
        {"role": "user", "content": [{"type": "text", "text": "Run the tests"},
                                     {"type": "text", "text": "in tests/."}]},
        {"role": "assistant", "content": [
            {"type": "thinking", "thinking": "dropped", "signature": "x"},
            {"type": "text", "text": "Running."},
            {"type": "tool_use", "id": "toolu_1", "name": "run_tests", "input": {"path": "tests/"}}]},
        {"role": "user", "content": [
            {"type": "tool_result", "tool_use_id": "toolu_1", "content": [{"type": "text", "text": "3 passed"}]},
            {"type": "text", "text": "Summarise."}]}])
    via_messages = s["prompts"][-1]
    s["client"].chat.completions.create(model="m", tools=OPENAI_TOOLS, messages=agent_turns("toolu_1"))
    assert via_messages == s["prompts"][-1]
    text = s["tok"].decode(via_messages, skip_special_tokens=False)
    assert "dropped" not in text and hermes_text("run_tests", {"path": "tests/"}) in text


def test_sampling_fields_reach_the_engine(s):
    s["reply"] = "x"
    # This client version has no temperature / top_p / top_k arguments; the
    # API and older clients (and Claude Code) send them.
    create(s, max_tokens=7, stop_sequences=["END", "\n\n"], extra_body={"temperature": 0.5, "top_p": 0.9, "top_k": 20})
    p = s["params"][-1]
    assert (p.max_tokens, p.temperature, p.top_p, p.top_k, p.stop) == (7, 0.5, 0.9, 20, ["END", "\n\n"])
    assert p.structured is None
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    s["reply"] = '{"ok": true}'
    r = create(s, output_config={"format": {"type": "json_schema", "schema": schema}, "effort": "low"})
    assert s["params"][-1].structured.json_schema == schema and r.content[0].text == '{"ok": true}'


@pytest.mark.parametrize("end, max_tokens, reason, seq", [
    (("stop", "END"), 64, "stop_sequence", "END"),
    (("length", None), 3, "max_tokens", None),          # the reply is 3 tokens long (3 pieces)
    # Cut short of max_tokens: the context ran out (Claude Code asks for 32,000 whatever the prompt).
    (("length", None), 20_000, "model_context_window_exceeded", None),
    (("stop", 2), 64, "end_turn", None)])               # an EOS token id
def test_stop_reasons(s, end, max_tokens, reason, seq):
    s["reply"], s["end"] = "partial answer", end
    r = create(s, stop_sequences=["END"], max_tokens=max_tokens)
    assert (r.stop_reason, r.stop_sequence) == (reason, seq)
    with s["anthropic"].messages.stream(model="m", max_tokens=max_tokens, stop_sequences=["END"],
                                        messages=[{"role": "user", "content": "hi"}]) as st:
        final = st.get_final_message()
    assert (final.stop_reason, final.stop_sequence) == (reason, seq)
    assert final.content[0].text == "partial answer"


def test_a_tool_call_streamed_and_not(s):
    s["reply"], s["cached"] = "Sure.\n" + CALL, 3
    r = create(s, tools=TOOLS)
    assert [b.type for b in r.content] == ["text", "tool_use"] and r.stop_reason == "tool_use"
    assert r.content[0].text == "Sure.\n"
    use = r.content[1]
    assert use.name == "run_tests" and use.input == {"path": "tests/", "k": 3} and use.id.startswith("toolu_")
    with s["anthropic"].messages.stream(model="m", max_tokens=64, tools=TOOLS,
                                        messages=[{"role": "user", "content": "Run the tests."}]) as st:
        texts = list(st.text_stream)
        final = st.get_final_message()
    assert "".join(texts) == "Sure.\n"  # the call never streams as text
    assert [(b.type, getattr(b, "text", None), getattr(b, "input", None)) for b in final.content] == [
        ("text", "Sure.\n", None), ("tool_use", None, {"path": "tests/", "k": 3})]
    assert final.stop_reason == "tool_use" and final.content[1].name == "run_tests"
    assert (final.usage.input_tokens, final.usage.cache_read_input_tokens) == (r.usage.input_tokens, 3)
    assert final.usage.output_tokens == r.usage.output_tokens


def test_the_event_sequence(s):
    """Raw events, in Anthropic's order, each `event:` name matching its data's type."""
    s["reply"] = "Hi " + CALL
    with s["http"].stream("POST", "/v1/messages", json={
            "model": "m", "max_tokens": 32, "stream": True, "tools": TOOLS,
            "messages": [{"role": "user", "content": "hi"}]}) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
        lines = [ln for ln in r.iter_lines() if ln]
    names = [ln.removeprefix("event: ") for ln in lines[0::2]]
    datas = [json.loads(ln.removeprefix("data: ")) for ln in lines[1::2]]
    assert [d["type"] for d in datas] == names
    assert names[:2] == ["message_start", "ping"] and names[-2:] == ["message_delta", "message_stop"]
    blocks = [(d["index"], d["content_block"]["type"]) for d in datas if d["type"] == "content_block_start"]
    assert blocks == [(0, "text"), (1, "tool_use")]
    stops = [d["index"] for d in datas if d["type"] == "content_block_stop"]
    assert stops == [0, 1]
    assert datas[-2]["delta"]["stop_reason"] == "tool_use"


def test_tool_choice(s):
    s["reply"] = '[{"name": "run_tests", "arguments": {"path": "a"}}]'
    r = create(s, tools=TOOLS, tool_choice={"type": "any", "disable_parallel_tool_use": True})
    assert s["params"][-1].structured is not None  # held to the call's JSON, one call at most
    assert "maxItems" in json.dumps(s["params"][-1].structured.json_schema)
    assert [(b.type, b.name, b.input) for b in r.content] == [("tool_use", "run_tests", {"path": "a"})]
    assert r.stop_reason == "tool_use"
    s["reply"] = '{"path": "b"}'
    r = create(s, tools=TOOLS, tool_choice={"type": "tool", "name": "run_tests"})
    assert [(b.name, b.input) for b in r.content] == [("run_tests", {"path": "b"})] and r.stop_reason == "tool_use"
    s["reply"] = CALL
    r = create(s, tools=TOOLS, tool_choice={"type": "none"})
    assert [b.type for b in r.content] == ["text"] and r.stop_reason == "end_turn"


def test_a_last_assistant_message_is_continued(s):
    s["reply"] = " 42."
    r = create(s, messages=[{"role": "user", "content": "The answer?"},
                            {"role": "assistant", "content": "The answer is"}])
    assert r.content[0].text == " 42."  # the continuation only, as Anthropic returns it
    assert s["tok"].decode(s["prompts"][-1], skip_special_tokens=False).endswith("assistant\nThe answer is")


def test_prefill_edges_as_anthropic_answers(s):
    s["reply"] = "ok"
    create(s, messages=[{"role": "user", "content": "The answer?"}])
    plain = s["prompts"][-1]
    # An empty final assistant message asks for a reply from the start.
    create(s, messages=[{"role": "user", "content": "The answer?"}, {"role": "assistant", "content": ""}])
    assert s["prompts"][-1] == plain
    for text in ("The answer is ", "  "):
        r = s["http"].post("/v1/messages", json={"model": "m", "max_tokens": 8, "messages": [
            {"role": "user", "content": "The answer?"}, {"role": "assistant", "content": text}]})
        assert r.status_code == 400 and r.json()["error"]["message"] == \
            "final assistant content cannot end with trailing whitespace"


def test_count_tokens(s):
    msgs = [{"role": "user", "content": "Count me."}]
    n = s["anthropic"].messages.count_tokens(model="m", messages=msgs, system="Be brief.", tools=TOOLS)
    s["reply"] = "ok"
    create(s, messages=msgs, system="Be brief.", tools=TOOLS)
    assert n.input_tokens == len(s["prompts"][-1]) > 0


@pytest.mark.parametrize("body, status, words", [
    ({"messages": [{"role": "user", "content": [{"type": "image", "source": {}}]}]}, 400,
     "messages.0.content.0: image content is not supported"),
    ({"tool_choice": {"type": "tool"}, "tools": TOOLS}, 400, "tool_choice of type tool needs a name"),
    ({"tool_choice": {"type": "tool", "name": "nope"}, "tools": TOOLS}, 400, "'nope', which is not among"),
    ({"model": "claude-other"}, 404, "the model `claude-other` does not exist"),
    ({"max_tokens": None}, 400, "max_tokens: Field required"),
    ({"max_tokens": 0}, 400, "max_tokens"),
    ({"messages": []}, 400, "messages"),
    # A tool_result for a tool_use the previous message did not make (Anthropic's 400, its words).
    ({"messages": [{"role": "user", "content": "Run the tests"},
                   {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "run_tests",
                                                      "input": {}}]},
                   {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_2",
                                                 "content": "3 passed"}]}]}, 400,
     "messages.2.content.0: unexpected tool_use_id found in tool_result blocks: toolu_2"),
    ({"messages": [{"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                                 "content": "3 passed"}]}]}, 400,
     "messages.0.content.0: unexpected tool_use_id"),
])
def test_errors_in_anthropics_shape(s, body, status, words):
    body = {"model": "m", "max_tokens": 16, "messages": [{"role": "user", "content": "hi"}], **body}
    body = {k: v for k, v in body.items() if v is not None}
    r = s["http"].post("/v1/messages", json=body)
    assert r.status_code == status, r.text
    err = r.json()
    assert err["type"] == "error" and words in err["error"]["message"], err
    assert err["error"]["type"] == ("not_found_error" if status == 404 else "invalid_request_error")
    if "max_tokens" in body:  # and as the client raises it (it requires max_tokens itself)
        with pytest.raises(anthropic.APIStatusError) as e:
            s["anthropic"].messages.create(**body)
        assert e.value.status_code == status
