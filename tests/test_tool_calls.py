"""Tool calls (Hermes format, server/tool_calls.py): parsing a reply, the
same result when it streams in any pieces, the history a template gets back,
and the chat endpoint as the official openai client reads it.

The embedded 135M model does not write tool calls on its own, so the
endpoint tests script the model's reply (the engine's output stream is
replaced); everything from the reply to the client's objects is real."""
from __future__ import annotations

import json

import openai
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajserve.server.protocol import ChatMessage
from trajserve.server.tool_calls import (Llama3JsonStream, StreamParser, format_for_template, hermes_text, parse,
                                        parse_llama3_json)

CALL = '<tool_call>\n{"name": "run_tests", "arguments": {"path": "tests/", "k": 3}}\n</tool_call>'


def names_args(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_one_call_and_no_content():
    p = parse(CALL)
    assert p.content is None
    assert names_args(p) == [("run_tests", {"path": "tests/", "k": 3})]
    c = p.tool_calls[0]
    assert c["type"] == "function" and c["id"].startswith("call_") and len(c["id"]) == 29


def test_text_around_calls_is_the_content_and_ids_differ():
    text = "Running both.\n" + CALL + "\n" + CALL.replace("run_tests", "lint") + "\nDone."
    p = parse(text)
    assert p.content == "Running both.\n" + "\n" + "\nDone."  # before, between and after the blocks
    assert [n for n, _ in names_args(p)] == ["run_tests", "lint"]
    assert p.tool_calls[0]["id"] != p.tool_calls[1]["id"]


def test_arguments_written_as_a_json_string_holding_an_object_are_read():
    p = parse('<tool_call>{"name": "a", "arguments": "{\\"x\\": 1}"}</tool_call>')
    assert names_args(p) == [("a", {"x": 1})]
    assert parse_llama3_json('{"name": "a", "parameters": "ls"}').tool_calls == []


def test_a_json_list_in_one_block_is_several_calls():
    p = parse('<tool_call>[{"name": "a", "arguments": {}}, {"name": "b", "arguments": {"x": "ü"}}]</tool_call>')
    assert names_args(p) == [("a", {}), ("b", {"x": "ü"})]
    assert '"ü"' in p.tool_calls[1]["function"]["arguments"]  # not \\u00fc


@pytest.mark.parametrize("text", [
    "no call at all",
    "<tool_call>\n{\"name\": \"run_tests\", \"arguments\": {\"path\"",     # cut by max_tokens
    "<tool_call>not json</tool_call>",
    '<tool_call>{"arguments": {}}</tool_call>',                             # no name
    '<tool_call>{"name": "", "arguments": {}}</tool_call>',
    '<tool_call>[]</tool_call>',
    CALL + "<tool_call>{bad</tool_call>",                                   # one bad block spoils all
    # Arguments that are not a JSON object: clients read them as one (a
    # string here gave Anthropic's endpoint a 500 and a cut stream).
    '<tool_call>{"name": "Bash", "arguments": "ls"}</tool_call>',
    '<tool_call>{"name": "Bash", "arguments": null}</tool_call>',
    '<tool_call>{"name": "Bash", "arguments": ["ls"]}</tool_call>',
])
def test_anything_else_is_plain_content(text):
    p = parse(text)
    assert p.content == text and p.tool_calls == []


def stream(text: str, cuts: list[int]):
    sp, sent, at = StreamParser(), [], 0
    for c in sorted(set(cuts)) + [len(text)]:
        sent.append(sp.feed(text[at:c]))
        at = c
    return "".join(sent), sp.finish()


@settings(max_examples=300, deadline=None)
@given(st.sampled_from([CALL, "Let me check.\n" + CALL, "plain <tool_ text <tool_call", CALL + " trailing",
                        "<tool_call>{\"name\": \"x\"", "a<b<tool_call>[{\"name\": \"y\"}]</tool_call>",
                        "<tool_call>nope</tool_call> ok"]),
       st.lists(st.integers(min_value=0, max_value=80), max_size=12))
def test_streaming_in_any_pieces_gives_the_one_shot_result(text, cuts):
    live, rest = stream(text, [c for c in cuts if c <= len(text)])
    whole = parse(text)
    streamed = live + (rest.content or "")
    if whole.tool_calls:
        assert names_args(rest) == names_args(whole)
        assert streamed.strip() == (whole.content or "").strip()
        assert "<tool_call" not in streamed  # no piece of a call ever went out as text
    else:
        assert rest.tool_calls == [] and streamed == text


def test_streaming_sends_text_before_a_call_at_once_and_holds_back_a_possible_tag():
    sp = StreamParser()
    assert sp.feed("Checking") == "Checking"
    assert sp.feed(" now <tool") == " now "           # "<tool" may begin a call
    assert sp.feed("_call>{\"name\": \"a\"}") == ""
    assert sp.feed("</tool_call>") == ""
    rest = sp.finish()
    assert rest.content is None and names_args(rest) == [("a", {})]
    sp = StreamParser()
    assert sp.feed("a <b") == "a <b"                    # "<b" cannot begin one


def test_history_tool_calls_reach_the_template_as_objects_or_as_text():
    msg = ChatMessage.model_validate({"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}]})
    d = msg.as_template_dict()
    assert d["tool_calls"][0]["function"] == {"name": "run_tests", "arguments": {"path": "tests/"}}
    assert d["content"] == ""
    # A template without tool_calls support gets the call as the model wrote it,
    # and parsing that text gives the call back.
    d = msg.as_template_dict(calls_as_text=True)
    assert "tool_calls" not in d and d["content"] == hermes_text("run_tests", {"path": "tests/"})
    assert names_args(parse(d["content"])) == [("run_tests", {"path": "tests/"})]


# ------------------------------------------------------- Llama 3's JSON form
L3 = '{"name": "run_tests", "parameters": {"path": "tests/", "k": 3}}'


def test_llama3_json_calls():
    assert names_args(parse_llama3_json(L3)) == [("run_tests", {"path": "tests/", "k": 3})]
    p = parse_llama3_json('<|python_tag|>' + L3 + '; {"name": "lint", "parameters": {}}')
    assert p.content is None and [n for n, _ in names_args(p)] == ["run_tests", "lint"]
    for text in ("The tests pass.", L3 + " and then more", '{"name": "x", "parameters": {', '{"nome": "x"}',
                 '{"name": "Bob", "age": 3}'):  # JSON with a name is an answer, not a call
        assert parse_llama3_json(text).content == text and parse_llama3_json(text).tool_calls == []


@settings(max_examples=200, deadline=None)
@given(st.sampled_from([L3, "  " + L3, "<|python_tag|>" + L3, "Plain text { not a call", "<|python", '{"oops": 1}',
                        L3 + "; " + L3]),
       st.lists(st.integers(min_value=0, max_value=80), max_size=10))
def test_llama3_streaming_in_any_pieces_gives_the_one_shot_result(text, cuts):
    sp, sent, at = Llama3JsonStream(), [], 0
    for c in sorted({c for c in cuts if c <= len(text)}) + [len(text)]:
        sent.append(sp.feed(text[at:c]))
        at = c
    rest, whole = sp.finish(), parse_llama3_json(text)
    if whole.tool_calls:
        assert names_args(rest) == names_args(whole) and "".join(sent) == ""
    else:
        assert rest.tool_calls == [] and "".join(sent) + (rest.content or "") == text


def test_the_format_follows_the_template():
    assert format_for_template("{{ '<tool_call>' }}") == "hermes"
    assert format_for_template("{% if tools %}{{ '<|python_tag|>' }}{% endif %}") == "llama3_json"
    assert format_for_template(None) == "hermes"


# ------------------------------------------------------------ the endpoint
# The `scripted` fixture (conftest.py): an in-process server whose model says
# what scripted["reply"] holds.
TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "Run the tests."}]


def test_the_client_gets_tool_calls_and_finish_reason(scripted):
    scripted["reply"] = "Sure.\n" + CALL
    r = scripted["client"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
    ch = r.choices[0]
    assert ch.finish_reason == "tool_calls" and ch.message.content == "Sure.\n"
    (call,) = ch.message.tool_calls
    assert call.function.name == "run_tests" and json.loads(call.function.arguments) == {"path": "tests/", "k": 3}
    # Without tools, with tool_choice "none", or under an output constraint
    # (the client asked for the reply itself in a shape), the same reply is text.
    for kw in ({}, {"tools": TOOLS, "tool_choice": "none"},
               {"tools": TOOLS, "response_format": {"type": "json_object"}}):
        r = scripted["client"].chat.completions.create(model="m", messages=MSGS, **kw)
        assert r.choices[0].message.content == "Sure.\n" + CALL and not r.choices[0].message.tool_calls
        assert r.choices[0].finish_reason == "stop"


def test_streamed_tool_calls_as_the_client_assembles_them(scripted):
    scripted["reply"] = "Sure.\n" + CALL
    chunks = list(scripted["client"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=True))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
    assert text == "Sure.\n"
    assert [(tc.index, tc.function.name, json.loads(tc.function.arguments)) for tc in calls] == [
        (0, "run_tests", {"path": "tests/", "k": 3})]
    assert chunks[-1].choices[0].finish_reason == "tool_calls"
    scripted["reply"] = "No tool <tool_call>{oops</tool_call>"  # not a call: all of it arrives as text
    chunks = list(scripted["client"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == scripted["reply"]
    assert chunks[-1].choices[0].finish_reason == "stop"


def calls_text_finish(r, stream: bool) -> tuple[list, str | None, str]:
    """A chat reply's tool calls (name, arguments), text and finish_reason,
    as the client assembles them, streamed or not."""
    if stream:
        chunks = list(r)
        calls = [tc for c in chunks if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
        text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        finish = chunks[-1].choices[0].finish_reason
    else:
        calls, text, finish = r.choices[0].message.tool_calls, r.choices[0].message.content, r.choices[0].finish_reason
    return [(c.function.name, json.loads(c.function.arguments)) for c in calls or []], text, finish


def test_a_server_reading_llama3_json_returns_its_calls(scripted):
    scripted["reply"] = "<|python_tag|>" + L3
    for stream in (False, True):
        r = scripted["llama3"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=stream)
        calls, text, finish = calls_text_finish(r, stream)
        assert calls == [("run_tests", {"path": "tests/", "k": 3})]
        assert not text and finish == "tool_calls"
    scripted["reply"] = "No call here."
    r = scripted["llama3"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
    assert r.choices[0].message.content == "No call here." and not r.choices[0].message.tool_calls


def test_a_returned_call_goes_back_into_the_prompt(scripted):
    """The next turn sends the call and its result back; SmolLM2's template
    knows no tool_calls, so the call is written as the model wrote it."""
    scripted["reply"] = "3 passed."
    msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 passed"}]
    r = scripted["client"].chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    assert r.choices[0].message.content == "3 passed."
    prompt = scripted["tok"].decode(scripted["prompts"][-1], skip_special_tokens=False)
    assert hermes_text("run_tests", {"path": "tests/"}) in prompt and "3 passed" in prompt


@pytest.mark.parametrize("body, status, words", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, 400,
     "names the function 'nope', which is not among the tools (run_tests)"),
    ({"tool_choice": "required", "response_format": {"type": "json_object"}}, 400, "cannot both hold"),
    ({"tool_choice": "required", "tools": None}, 400, "tool_choice 'required' needs tools"),
    ({"tools": [{"type": "function", "function": {"description": "no name"}}]}, 422, "tools.0.function.name"),
    ({"tools": [{"type": "retrieval"}]}, 422, "tools.0.type"),
])
def test_what_cannot_be_honoured_is_refused_by_name(scripted, body, status, words):
    body = {"tools": TOOLS, **body}
    body = {k: v for k, v in body.items() if v is not None}
    with pytest.raises(openai.APIStatusError) as e:
        scripted["client"].chat.completions.create(model="m", messages=MSGS, **body)
    assert e.value.status_code == status and words in e.value.message


# A chat template in the shape of Qwen2.5's tool support (written for this
# test): tools as JSON in the system turn, each call as `arguments | tojson`.
TOOL_TEMPLATE = (
    "{% if tools %}<|im_start|>system\n<tools>{% for t in tools %}{{ t | tojson }}{% endfor %}</tools><|im_end|>\n"
    "{% endif %}{% for m in messages %}<|im_start|>{{ m.role }}\n{{ m.content }}"
    "{% for c in m.tool_calls or [] %}<tool_call>\n{\"name\": \"{{ c.function.name }}\", \"arguments\": "
    "{{ c.function.arguments | tojson }}}\n</tool_call>{% endfor %}<|im_end|>\n{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")


def test_a_template_that_knows_tools_gets_them_and_the_calls_as_objects(scripted):
    tok = scripted["tok"]
    saved = tok.chat_template, tok._compiled_template
    tok.chat_template, tok._compiled_template = TOOL_TEMPLATE, None
    try:
        scripted["reply"] = "ok"
        msgs = MSGS + [{"role": "assistant", "content": None, "tool_calls": [
            {"id": "c1", "type": "function", "function": {"name": "run_tests", "arguments": '{"path": "tests/"}'}}]},
            {"role": "tool", "tool_call_id": "c1", "content": "3 passed"}]
        scripted["client"].chat.completions.create(model="m", messages=msgs, tools=TOOLS)
    finally:
        tok.chat_template, tok._compiled_template = saved
    prompt = tok.decode(scripted["prompts"][-1], skip_special_tokens=False)
    assert '"name": "run_tests", "description": "Run the test suite"' in prompt
    # The arguments arrive as an object (a string would be written "{\"path\": ...}").
    assert '<tool_call>\n{"name": "run_tests", "arguments": {"path": "tests/"}}\n</tool_call>' in prompt


def test_parallel_tool_calls_false_gives_one_call(scripted):
    from trajserve.server.tool_calls import forced_schema

    scripted["reply"] = CALL + "\n" + CALL.replace("run_tests", "lint")
    for stream in (False, True):
        for parallel, names in ((None, ["run_tests", "lint"]), (False, ["run_tests"])):
            kw = {} if parallel is None else {"parallel_tool_calls": parallel}
            r = scripted["client"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=stream, **kw)
            if stream:
                calls = [tc for c in r if c.choices for tc in (c.choices[0].delta.tool_calls or [])]
            else:
                calls = r.choices[0].message.tool_calls
            assert [c.function.name for c in calls] == names
    # A forced "required" reply is held to one call by its schema.
    assert forced_schema(TOOLS, "required", parallel=False)["maxItems"] == 1
    assert "maxItems" not in forced_schema(TOOLS, "required")
