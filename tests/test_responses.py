"""OpenAI's Responses API (server/responses.py) as the official openai client
reads it: the prompt a request becomes (the chat endpoint's for the same
conversation), text and function_call output streamed and not,
previous_response_id, the store, incomplete replies, and errors.

The model's reply is scripted (the `scripted` fixture, conftest.py); a test
against the real model over HTTP is in test_server.py."""
from __future__ import annotations

import json

import openai
import pytest
from server_util import agent_turns

CALL = '<tool_call>\n{"name": "run_tests", "arguments": {"path": "tests/", "k": 3}}\n</tool_call>'
TOOLS = [{"type": "function", "name": "run_tests", "description": "Run the test suite",
          "parameters": {"type": "object", "properties": {"path": {"type": "string"}, "k": {"type": "integer"}}}}]
CHAT_TOOLS = [{"type": "function", "function": {k: v for k, v in t.items() if k != "type"}} for t in TOOLS]


@pytest.fixture
def s(scripted):
    scripted["end"], scripted["cached"] = ("stop", None), 0
    return scripted


def create(s, **kw):
    return s["client"].responses.create(**{"model": "m", "input": "Run the tests.", **kw})


def test_a_text_reply_and_its_usage(s):
    s["reply"], s["cached"] = "All good.", 5
    r = create(s, instructions="Be terse.")
    assert r.object == "response" and r.id.startswith("resp_") and r.status == "completed"
    assert r.output_text == "All good." and [o.type for o in r.output] == ["message"]
    n = len(s["prompts"][-1])
    assert (r.usage.input_tokens, r.usage.input_tokens_details.cached_tokens, r.usage.output_tokens) == (n, 5, 2)
    assert r.instructions == "Be terse." and r.model == "m"
    assert r.usage.input_tokens_details.cache_write_tokens == 0  # a field the client's types require


def test_the_prompt_is_the_chat_endpoints_for_the_same_conversation(s):
    s["reply"] = "ok"
    create(s, instructions="You are terse.", tools=TOOLS, input=[
        {"role": "user", "content": [{"type": "input_text", "text": "Run the tests"},
                                     {"type": "input_text", "text": "in tests/."}]},
        {"type": "reasoning", "id": "rs_1", "summary": []},
        {"role": "assistant", "content": "Running."},
        {"type": "function_call", "call_id": "call_1", "name": "run_tests", "arguments": '{"path": "tests/"}'},
        {"type": "function_call_output", "call_id": "call_1", "output": "3 passed"},
        {"type": "message", "role": "user", "content": "Summarise."}])
    via_responses = s["prompts"][-1]
    s["client"].chat.completions.create(model="m", tools=CHAT_TOOLS, messages=agent_turns("call_1"))
    assert via_responses == s["prompts"][-1]


def test_function_calls_streamed_and_not(s):
    s["reply"] = "Sure.\n" + CALL
    r = create(s, tools=TOOLS)
    assert [o.type for o in r.output] == ["message", "function_call"] and r.output_text == "Sure.\n"
    call = r.output[1]
    assert call.name == "run_tests" and json.loads(call.arguments) == {"path": "tests/", "k": 3}
    assert call.call_id.startswith("call_") and call.status == "completed"
    with s["client"].responses.stream(model="m", input="Run the tests.", tools=TOOLS) as st:
        kinds, text = [], ""
        for ev in st:
            kinds.append(ev.type)
            if ev.type == "response.output_text.delta":
                text += ev.delta
        final = st.get_final_response()
    assert text == "Sure.\n"  # the call never streams as text
    assert kinds[:2] == ["response.created", "response.in_progress"] and kinds[-1] == "response.completed"
    assert kinds.index("response.output_item.done") < kinds.index("response.function_call_arguments.done")
    assert [(o.type, getattr(o, "name", None)) for o in final.output] == [("message", None),
                                                                          ("function_call", "run_tests")]
    assert json.loads(final.output[1].arguments) == {"path": "tests/", "k": 3}
    assert final.output_text == "Sure.\n" and final.usage.output_tokens == r.usage.output_tokens


def test_previous_response_id_continues_the_conversation(s):
    """The second request's prompt is the first's conversation, its call and
    the call's output: what the chat endpoint renders for the whole history
    (so the prefix cache serves the first part). Instructions are not
    carried over, as OpenAI's are not."""
    s["reply"] = CALL
    first = create(s, tools=TOOLS, instructions="First instructions.")
    call = first.output[0]
    s["reply"] = "3 passed."
    second = create(s, tools=TOOLS, previous_response_id=first.id, instructions="Second instructions.",
                    input=[{"type": "function_call_output", "call_id": call.call_id, "output": "3 passed"}])
    assert second.output_text == "3 passed." and second.previous_response_id == first.id
    via_responses = s["prompts"][-1]
    s["client"].chat.completions.create(model="m", tools=CHAT_TOOLS, messages=[
        {"role": "system", "content": "Second instructions."},
        {"role": "user", "content": "Run the tests."},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": call.call_id, "type": "function", "function": {"name": "run_tests", "arguments": call.arguments}}]},
        {"role": "tool", "tool_call_id": call.call_id, "content": "3 passed"}])
    assert via_responses == s["prompts"][-1]
    assert "First instructions" not in s["tok"].decode(via_responses)
    # Stored: retrieve, then delete; a deleted or unstored response cannot be continued.
    assert s["client"].responses.retrieve(second.id).output_text == "3 passed."
    s["client"].responses.delete(second.id)
    unstored = create(s, store=False)
    for rid in (second.id, unstored.id):
        with pytest.raises(openai.NotFoundError, match="no stored response"):
            create(s, previous_response_id=rid)
        with pytest.raises(openai.NotFoundError):
            s["client"].responses.retrieve(rid)


def test_a_reply_cut_by_max_output_tokens_is_incomplete(s):
    s["reply"], s["end"] = "partial answer", ("length", None)
    r = create(s, max_output_tokens=3)
    assert r.status == "incomplete" and r.incomplete_details.reason == "max_output_tokens"
    assert s["params"][-1].max_tokens == 3
    with s["http"].stream("POST", "/v1/responses", json={"model": "m", "input": "hi", "max_output_tokens": 3,
                                                         "stream": True}) as resp:
        lines = [ln for ln in resp.iter_lines() if ln.startswith("data: ")]
    events = [json.loads(ln[6:]) for ln in lines]
    assert events[-1]["type"] == "response.incomplete" and events[-1]["response"]["status"] == "incomplete"
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


def test_text_format_and_tool_choice(s):
    schema = {"type": "object", "properties": {"ok": {"type": "boolean"}}, "required": ["ok"]}
    s["reply"] = '{"ok": true}'
    r = create(s, text={"format": {"type": "json_schema", "name": "verdict", "schema": schema}})
    assert s["params"][-1].structured.json_schema == schema and r.output_text == '{"ok": true}'
    assert r.text.format.type == "json_schema"
    s["reply"] = '[{"name": "run_tests", "arguments": {"path": "a"}}]'
    r = create(s, tools=TOOLS, tool_choice="required")
    assert s["params"][-1].structured is not None
    assert [(o.type, o.name, json.loads(o.arguments)) for o in r.output] == [("function_call", "run_tests",
                                                                              {"path": "a"})]


@pytest.mark.parametrize("body, status, words", [
    ({"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "data:,"}]}]}, 400,
     "input.0.content.0: input_image parts are not supported"),
    ({"input": [{"type": "computer_call_output", "call_id": "x"}]}, 400,
     "input.0: input item type 'computer_call_output' is not supported"),
    ({"input": [{"role": "wizard", "content": "hi"}]}, 400, "input.0: role must be"),
    ({"previous_response_id": "resp_nope"}, 404, "no stored response 'resp_nope'"),
    ({"model": "gpt-9"}, 404, "the model `gpt-9` does not exist"),
    ({"input": [{"type": "function_call", "call_id": "c1", "arguments": "{}"}]}, 400,
     "input.0: a function_call item needs name"),
    # In this API's words, and a 400 (not 422) for wrong types, as OpenAI's.
    ({"max_output_tokens": 0}, 400, "max_output_tokens must be an integer >= 1"),
    ({"max_output_tokens": 10**6}, 400, "max_output_tokens is too large"),
    ({"input": 5}, 400, "input"),
    # A result for a call never made (OpenAI's 400); the call's own id answers it (test above).
    ({"input": [{"type": "function_call_output", "call_id": "call_zz", "output": "3 passed"}]}, 400,
     "no tool call found for function call output with call_id 'call_zz'"),
    ({"input": [{"type": "function_call", "call_id": "call_1", "name": "run_tests", "arguments": "{}"},
                {"type": "function_call_output", "call_id": "call_2", "output": "3 passed"}]}, 400,
     "call_id 'call_2'"),
])
def test_what_cannot_be_honoured_is_refused_by_name(s, body, status, words):
    r = s["http"].post("/v1/responses", json={"model": "m", "input": "hi", **body})
    assert r.status_code == status and words in r.json()["error"]["message"], r.text


PATCH = "*** Begin Patch\n*** Add File: a.txt\n+hi\n*** End Patch"
CUSTOM = [{"type": "custom", "name": "apply_patch", "description": "Apply a patch",
           "format": {"type": "grammar", "syntax": "lark", "definition": "start: /.+/"}}]


def test_custom_tools_as_codex_sends_them(s):
    """Codex sends apply_patch as a custom (freeform) tool: the model sees a
    function with one string argument, and its call comes back as a
    custom_tool_call whose input is that string (streamed too); the call and
    its output go back in as custom_tool_call / _output items."""
    s["reply"] = '<tool_call>{"name": "apply_patch", "arguments": {"input": %s}}</tool_call>' % json.dumps(PATCH)
    r = create(s, tools=CUSTOM + TOOLS)
    (call,) = r.output
    assert (call.type, call.name, call.input) == ("custom_tool_call", "apply_patch", PATCH)
    with s["http"].stream("POST", "/v1/responses", json={"model": "m", "input": "patch", "tools": CUSTOM,
                                                         "stream": True}) as resp:
        events = [json.loads(ln[6:]) for ln in resp.iter_lines() if ln.startswith("data: ")]
    kinds = [e["type"] for e in events]
    assert "response.custom_tool_call_input.delta" in kinds and "response.function_call_arguments.delta" not in kinds
    assert events[-1]["response"]["output"][0]["input"] == PATCH
    # Sent back: the same history as a function call with {"input": ...} through the chat endpoint.
    s["reply"] = "done"
    create(s, tools=CUSTOM, input=[
        {"role": "user", "content": "patch"},
        {"type": "custom_tool_call", "call_id": "call_9", "name": "apply_patch", "input": PATCH},
        {"type": "custom_tool_call_output", "call_id": "call_9", "output": "Done!"}])
    via_responses = s["prompts"][-1]
    s["client"].chat.completions.create(model="m", tools=[{"type": "function", "function": {
        "name": "apply_patch", "description": "Apply a patch",
        "parameters": {"type": "object", "properties": {"input": {"type": "string"}}, "required": ["input"],
                       "additionalProperties": False}}}], messages=[
        {"role": "user", "content": "patch"},
        {"role": "assistant", "content": None, "tool_calls": [{"id": "call_9", "type": "function", "function": {
            "name": "apply_patch", "arguments": json.dumps({"input": PATCH})}}]},
        {"role": "tool", "tool_call_id": "call_9", "content": "Done!"}])
    assert via_responses == s["prompts"][-1]
    # Forced: held to {"input": string}.
    s["reply"] = json.dumps({"input": PATCH})
    r = create(s, tools=CUSTOM, tool_choice={"type": "custom", "name": "apply_patch"})
    assert s["params"][-1].structured.json_schema["required"] == ["input"]
    assert [(o.type, o.input) for o in r.output] == [("custom_tool_call", PATCH)]
