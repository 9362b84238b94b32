"""gpt-oss's harmony replies (server/harmony.py): the reasoning, the answer
and the tool calls read back from the messages the model writes, the same
when the reply streams in any pieces; a harmony vocabulary ends a reply at
<|return|> or <|call|>, not at the <|end|> of its reasoning, and keeps the
markers in the reply's text; the three APIs as their official clients read
them (the model's reply scripted, as in tests/test_tool_calls.py)."""
from __future__ import annotations

import json
from pathlib import Path

import gguf
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from test_tool_calls import calls_text_finish
from trajserve.model.tokenizer import IncrementalDetokenizer, load_tokenizer
from trajserve.server.harmony import (
    REQUIRED_OPENING,
    HarmonyStream,
    held_body,
    held_opening,
    parse,
    required_grammar,
)
from trajserve.server.tool_calls import format_for_template

THINK = "<|channel|>analysis<|message|>The user wants the tests run.<|end|>"
ANSWER = "<|start|>assistant<|channel|>final<|message|>All 3 passed.<|return|>"
CALL = ('<|start|>assistant<|channel|>commentary to=functions.run_tests <|constrain|>json<|message|>'
        '{"path": "tests/", "k": 3}<|call|>')
# The recipient before the channel, as the model may also write it.
CALL_FIRST = '<|start|>assistant to=functions.run_tests<|channel|>commentary json<|message|>{"path": "x"}<|call|>'


def calls_of(parsed):
    return [(c["function"]["name"], json.loads(c["function"]["arguments"])) for c in parsed.tool_calls]


def test_reasoning_and_answer_are_separate():
    p = parse(THINK + ANSWER)
    assert (p.content, p.reasoning, p.tool_calls) == ("All 3 passed.", "The user wants the tests run.", [])


@pytest.mark.parametrize("call, args", [(CALL, {"path": "tests/", "k": 3}), (CALL_FIRST, {"path": "x"})])
def test_a_call_to_a_function_is_a_tool_call(call, args):
    p = parse(THINK + call)
    assert p.content is None and p.reasoning == "The user wants the tests run."
    assert calls_of(p) == [("run_tests", args)]
    # The request asked for no tool calls: what the model wrote is content.
    p = parse(THINK + call, calls=False)
    assert p.tool_calls == [] and json.loads(p.content) == args


@pytest.mark.parametrize("text, content", [
    # Cut by max_tokens: no <|call|>, so not a call; its body is content.
    (THINK + CALL[:-len("<|call|>")], '{"path": "tests/", "k": 3}'),
    # Not a JSON object.
    (THINK + CALL.replace('{"path": "tests/", "k": 3}', "ls -la"), "ls -la"),
    # A preamble to the user on the commentary channel, then the answer.
    ("<|channel|>commentary<|message|>Running them.<|end|>" + ANSWER, "Running them.All 3 passed."),
    # A built-in tool's message (not a function the client gave) is not passed on.
    (THINK + "<|start|>assistant<|channel|>analysis to=browser.search<|message|>{}<|call|>", None),
    # No harmony at all: the text as it came.
    ("Just text.", "Just text."),
    ("", None),
])
def test_what_is_not_a_finished_call_is_not_handed_over_as_one(text, content):
    p = parse(text)
    assert p.tool_calls == [] and p.content == content


def _streamed(text: str, cuts: list[int], calls: bool = True):
    s = HarmonyStream(calls=calls)
    content = reasoning = ""
    at = 0
    for cut in sorted(set(cuts)) + [len(text)]:
        content += s.feed(text[at:cut])
        reasoning += s.take_reasoning()
        at = cut
    rest = s.finish()
    return content + (rest.content or ""), reasoning + (rest.reasoning or ""), rest


REPLIES = [THINK + ANSWER, THINK + CALL, THINK + CALL_FIRST, THINK + CALL[:-8], "Just text.",
           "<|channel|>commentary<|message|>Running them.<|end|>" + CALL + ANSWER]


@settings(max_examples=60, deadline=None)
@given(st.sampled_from(REPLIES), st.lists(st.integers(0, 200), max_size=12), st.booleans())
def test_streaming_in_any_pieces_gives_the_one_shot_result(text, cuts, calls):
    content, reasoning, rest = _streamed(text, [c for c in cuts if c < len(text)], calls)
    whole = parse(text, calls)
    assert (content or None) == whole.content or (content.strip() == "" and whole.content is None)
    assert (reasoning or None) == whole.reasoning
    assert calls_of(rest) == calls_of(whole)


def test_streaming_sends_reasoning_and_answer_as_they_come():
    s = HarmonyStream()
    assert s.feed("<|channel|>analysis<|message|>Think") == "" and s.take_reasoning() == "Think"
    assert s.feed("ing.<|end|><|start|>assistant<|channel|>final<|message|>Hi") == "Hi"
    assert s.take_reasoning() == "ing."
    assert s.feed(" there<|") == " there"  # "<|" may start a marker: held back
    assert s.feed("return|>") == ""


def test_a_harmony_template_is_read_as_harmony():
    assert format_for_template("{{ '<|start|>assistant<|channel|>final<|message|>' }}") == "harmony"
    assert format_for_template("{{ '<tool_call>' }}") == "hermes"


def _harmony_vocabulary(path: Path) -> list[str]:
    """A gpt-oss-like GGUF vocabulary: letters, harmony's control tokens, <|end|> named eot."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    specials = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|return|>", "<|call|>", "<|endoftext|>",
                "<|constrain|>"]
    tokens = list(bytes_to_unicode().values()) + specials
    w = gguf.GGUFWriter(str(path), "gpt-oss")
    w.add_tokenizer_model("gpt2")
    w.add_tokenizer_pre("gpt-4o")
    w.add_token_list(tokens)
    w.add_token_types([1] * (len(tokens) - len(specials)) + [3] * len(specials))
    w.add_token_merges([])
    w.add_eos_token_id(tokens.index("<|return|>"))
    w.add_eot_token_id(tokens.index("<|end|>"))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    return tokens


def test_a_harmony_vocabulary_ends_replies_at_return_or_call_and_keeps_its_markers(tmp_path: Path):
    tokens = _harmony_vocabulary(tmp_path / "v.gguf")
    tok = load_tokenizer(tmp_path / "v.gguf")
    assert tok.harmony
    assert tok.eos_token_ids == {tokens.index(t) for t in ("<|return|>", "<|call|>", "<|endoftext|>")}
    ids = tok.encode(THINK + ANSWER, add_special_tokens=False)
    assert tokens.index("<|end|>") in ids  # the markers are single tokens
    detok = IncrementalDetokenizer(tok)
    detok.extend(ids)
    detok.flush()
    assert detok.text == THINK + ANSWER and parse(detok.text).content == "All 3 passed."
    plain = IncrementalDetokenizer(tok, skip_special_tokens=True)
    plain.extend(ids)
    assert "<|channel|>" not in plain.text


# ------------------------------------------------------------ the endpoints
TOOLS = [{"type": "function", "function": {"name": "run_tests", "description": "Run the test suite",
                                           "parameters": {"type": "object",
                                                          "properties": {"path": {"type": "string"}}}}}]
MSGS = [{"role": "user", "content": "Run the tests."}]


@pytest.fixture
def harmony_client(scripted):
    import openai
    from fastapi.testclient import TestClient

    from trajserve.server.config import ServerConfig

    app = scripted["app_over"](ServerConfig(served_model_names=("m",), tool_call_parser="harmony"))
    scripted["harmony"] = openai.OpenAI(base_url="http://testserver/v1", api_key="x", max_retries=0,
                                        http_client=TestClient(app))
    scripted["harmony_http"] = TestClient(app)
    return scripted


def test_chat_completions_give_the_answer_as_content_and_the_reasoning_beside_it(harmony_client):
    s = harmony_client
    s["reply"] = THINK + ANSWER
    r = s["harmony"].chat.completions.create(model="m", messages=MSGS)
    msg = r.choices[0].message
    assert msg.content == "All 3 passed." and msg.model_extra["reasoning_content"] == "The user wants the tests run."
    assert r.choices[0].finish_reason == "stop"
    chunks = list(s["harmony"].chat.completions.create(model="m", messages=MSGS, stream=True))
    deltas = [c.choices[0].delta for c in chunks if c.choices]
    assert "".join(d.content or "" for d in deltas) == "All 3 passed."
    assert "".join((d.model_extra or {}).get("reasoning_content") or "" for d in deltas) == \
        "The user wants the tests run."


def test_chat_completions_give_a_harmony_call_as_a_tool_call(harmony_client):
    s = harmony_client
    s["reply"] = THINK + CALL
    for stream in (False, True):
        r = s["harmony"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS, stream=stream)
        calls, text, finish = calls_text_finish(r, stream)
        assert calls == [("run_tests", {"path": "tests/", "k": 3})]
        assert not text and finish == "tool_calls"


def test_the_responses_and_messages_apis_send_only_the_answer_as_text(harmony_client):
    s = harmony_client
    s["reply"] = THINK + ANSWER
    r = s["harmony_http"].post("/v1/responses", json={"model": "m", "input": "Run the tests."})
    assert r.status_code == 200
    texts = [c["text"] for it in r.json()["output"] if it["type"] == "message" for c in it["content"]]
    assert texts == ["All 3 passed."]
    s["reply"] = THINK + CALL
    r = s["harmony_http"].post("/v1/responses", json={"model": "m", "input": "Run the tests.", "tools": [
        {"type": "function", "name": "run_tests", "parameters": TOOLS[0]["function"]["parameters"]}]})
    calls = [it for it in r.json()["output"] if it["type"] == "function_call"]
    assert [(c["name"], json.loads(c["arguments"])) for c in calls] == [("run_tests", {"path": "tests/", "k": 3})]
    s["reply"] = THINK + ANSWER
    r = s["harmony_http"].post("/v1/messages", json={"model": "m", "max_tokens": 64, "messages": MSGS})
    assert r.status_code == 200
    assert [b["text"] for b in r.json()["content"] if b["type"] == "text"] == ["All 3 passed."]


def test_reasoning_reaches_the_other_apis_as_their_reasoning_and_thinking(harmony_client):
    """Responses: a reasoning item (its raw text) before the message;
    Messages: a thinking block before the text; streamed the same."""
    s = harmony_client
    s["reply"] = THINK + ANSWER
    out = s["harmony_http"].post("/v1/responses", json={"model": "m", "input": "Run the tests."}).json()["output"]
    assert [it["type"] for it in out] == ["reasoning", "message"]
    assert out[0]["content"] == [{"type": "reasoning_text", "text": "The user wants the tests run."}]
    stream = s["harmony"].responses.create(model="m", input="Run the tests.", stream=True)
    events = list(stream)
    deltas = {}
    for e in events:
        if e.type.endswith(".delta"):
            deltas[e.type] = deltas.get(e.type, "") + e.delta
    assert deltas == {"response.reasoning_text.delta": "The user wants the tests run.",
                      "response.output_text.delta": "All 3 passed."}
    final = events[-1].response
    assert [it.type for it in final.output] == ["reasoning", "message"]
    assert final.output[1].content[0].text == "All 3 passed."
    import anthropic

    client = anthropic.Anthropic(base_url="http://testserver", api_key="x", max_retries=0,
                                 http_client=s["harmony_http"])
    msg = client.messages.create(model="m", max_tokens=64, messages=MSGS)
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == [
        ("thinking", "The user wants the tests run."), ("text", "All 3 passed.")]
    with client.messages.stream(model="m", max_tokens=64, messages=MSGS) as st_:
        streamed = st_.get_final_message()
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in streamed.content] == [
        ("thinking", "The user wants the tests run."), ("text", "All 3 passed.")]
    s["reply"] = THINK + CALL
    with client.messages.stream(model="m", max_tokens=64, messages=MSGS, tools=[
            {"name": "run_tests", "input_schema": {"type": "object"}}]) as st_:
        streamed = st_.get_final_message()
    assert [b.type for b in streamed.content] == ["thinking", "tool_use"]
    assert streamed.content[1].input == {"path": "tests/", "k": 3} and streamed.stop_reason == "tool_use"


# A template that shows what it is given: a message's thinking, role, content, first call.
SHOWS = ("{% for m in messages %}{% if m.thinking is defined %}[thinking:{{ m.thinking }}]{% endif %}"
         "{{ m.role }}:{{ m.content }}{% if m.tool_calls %}[call:{{ m.tool_calls[0].function.name }}]{% endif %}\n"
         "{% endfor %}")


@pytest.fixture
def shows_thinking(harmony_client):
    tok = harmony_client["tok"]
    kept, tok.chat_template = tok.chat_template, SHOWS
    yield harmony_client
    tok.chat_template = kept


def _last_prompt(s) -> str:
    return s["tok"].decode(s["prompts"][-1], skip_special_tokens=False)


def test_the_thoughts_before_a_call_go_back_into_the_prompt_from_each_api(shows_thinking):
    """What a reply thought before its tool call, sent back by the client as
    each API returned it, reaches the template as the call's `thinking`
    (gpt-oss's template writes it before the call); beside text, or with no
    call, it does not."""
    s = shows_thinking
    s["reply"] = THINK + ANSWER
    call = {"id": "call_1", "type": "function", "function": {"name": "run_tests", "arguments": "{}"}}
    s["harmony"].chat.completions.create(model="m", messages=MSGS + [
        {"role": "assistant", "content": None, "tool_calls": [call], "reasoning_content": "Run them first."},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 passed"}])
    assert "[thinking:Run them first.]assistant:[call:run_tests]" in _last_prompt(s)
    s["harmony"].chat.completions.create(model="m", messages=MSGS + [
        {"role": "assistant", "content": "Running.", "tool_calls": [call], "reasoning_content": "Run them first."},
        {"role": "tool", "tool_call_id": "call_1", "content": "3 passed"},
        {"role": "assistant", "content": "Done.", "reasoning_content": "All passed."},
        {"role": "user", "content": "Thanks."}])
    assert "[thinking:" not in _last_prompt(s)
    r = s["harmony_http"].post("/v1/messages", json={"model": "m", "max_tokens": 16, "messages": MSGS + [
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "Run them first.", "signature": ""},
                                          {"type": "tool_use", "id": "toolu_1", "name": "run_tests", "input": {}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": "3 passed"}]}]})
    assert r.status_code == 200 and "[thinking:Run them first.]assistant:[call:run_tests]" in _last_prompt(s)
    r = s["harmony_http"].post("/v1/responses", json={"model": "m", "input": [
        {"role": "user", "content": "Run the tests."},
        {"type": "reasoning", "id": "rs_1", "summary": [],
         "content": [{"type": "reasoning_text", "text": "Run them first."}]},
        {"type": "function_call", "call_id": "call_1", "name": "run_tests", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "call_1", "output": "3 passed"}]})
    assert r.status_code == 200 and "[thinking:Run them first.]assistant:[call:run_tests]" in _last_prompt(s)
    # A stored response's own reasoning goes with its calls into the next turn (previous_response_id).
    s["reply"] = THINK + CALL
    first = s["harmony_http"].post("/v1/responses", json={"model": "m", "input": "Run the tests.", "tools": [
        {"type": "function", "name": "run_tests", "parameters": {"type": "object"}}]}).json()
    s["reply"] = THINK + ANSWER
    r = s["harmony_http"].post("/v1/responses", json={"model": "m", "previous_response_id": first["id"], "input": [
        {"type": "function_call_output", "call_id": first["output"][1]["call_id"], "output": "3 passed"}]})
    assert r.status_code == 200
    assert "[thinking:The user wants the tests run.]assistant:[call:run_tests]" in _last_prompt(s)


# ------------------------------------------------------- replies held to JSON
NAMED = "<|channel|>commentary to=functions.run_tests <|constrain|>json<|message|>"


def test_a_held_reply_opens_on_the_header_the_model_writes_there():
    assert held_opening("run_tests") == NAMED
    assert held_opening(None) == "<|channel|>final<|message|>"
    # "required": the header up to the function's name, which the model writes; where a name cannot stand
    # in the header (a marker in it would read as one), the JSON names the calls in a commentary message.
    assert held_opening("required", ["run_tests", "lint"]) == REQUIRED_OPENING == "<|channel|>commentary to=functions."
    commentary = "<|channel|>commentary<|message|>"
    assert held_opening("required", ["run_tests", "x<|call|>"]) == held_opening("x<|call|>") == commentary
    assert held_opening("required") == commentary
    # The body, without the marker that ended it (any of them: the JSON was held, the end was the model's).
    for end in ("<|call|>", "<|return|>", "<|end|>", ""):
        assert held_body(NAMED, '{"path": "x"}' + end) == '{"path": "x"}'


@pytest.mark.parametrize("stream", [False, True])
def test_a_forced_call_on_a_harmony_model_is_a_call(harmony_client, stream):
    s = harmony_client
    s["reply"] = THINK + ANSWER
    s["harmony"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS)
    plain = _last_prompt(s)  # what the template renders, ending on the assistant's turn
    for tool_choice, reply, opening in [
            ({"type": "function", "function": {"name": "run_tests"}}, '{"path": "tests/"}<|call|>', NAMED),
            ({"type": "function", "function": {"name": "run_tests"}}, '{"path": "tests/"}<|return|>', NAMED),
            ("required", 'run_tests <|constrain|>json<|message|>{"path": "tests/"}<|call|>', REQUIRED_OPENING)]:
        s["reply"] = reply
        r = s["harmony"].chat.completions.create(model="m", messages=MSGS, tools=TOOLS, tool_choice=tool_choice,
                                                 stream=stream)
        calls, text, _ = calls_text_finish(r, stream)
        assert calls == [("run_tests", {"path": "tests/"})] and not text
        assert _last_prompt(s) == plain + opening
    # "required" among two tools: the model names the one it calls; a reply cut short in its JSON stays text.
    lint = {"type": "function", "function": {"name": "lint", "parameters": {"type": "object"}}}
    for reply, want in [('lint <|constrain|>json<|message|>{}<|call|>', [("lint", {})]),
                        ('run_tests <|constrain|>json<|message|>{"pa', [])]:
        s["reply"] = reply
        r = s["harmony"].chat.completions.create(model="m", messages=MSGS, tools=[*TOOLS, lint],
                                                 tool_choice="required", stream=stream)
        calls, text, _ = calls_text_finish(r, stream)
        assert calls == want and bool(text) == (not want)


def test_a_required_reply_is_held_to_one_tools_name_header_and_arguments(tmp_path: Path):
    """The grammar after REQUIRED_OPENING, run by llguidance over a harmony
    vocabulary: a tool's name, the header's markers as their control
    tokens, that tool's arguments; nothing else."""
    import llguidance

    tokens = _harmony_vocabulary(tmp_path / "v.gguf")
    tok = load_tokenizer(tmp_path / "v.gguf")
    lint = {"type": "function", "function": {"name": "lint", "parameters": {
        "type": "object", "properties": {"fix": {"type": "boolean"}}}}}
    lltok = llguidance.LLTokenizer(tok.backend.to_str(), n_vocab=len(tokens), eos_token=sorted(tok.eos_token_ids))
    grammar = required_grammar([*TOOLS, lint], tok.is_special)
    held = llguidance.LLMatcher(lltok, llguidance.LLMatcher.grammar_from_lark(grammar), log_level=0)
    assert not held.is_error(), held.get_error()

    def accepts(text: str) -> bool:
        m = held.deep_copy()
        return all(m.consume_token(t) for t in tok.encode(text, add_special_tokens=False)) and m.is_accepting()
    assert accepts('run_tests <|constrain|>json<|message|>{"path": "x"}')
    assert accepts('lint <|constrain|>json<|message|>{"fix": true}')
    assert not accepts('lint <|constrain|>json<|message|>{"path": "x"}')  # another tool's arguments (objects closed)
    assert not accepts('deploy <|constrain|>json<|message|>{}')
    # The markers must be the control tokens, not their text spelled in ordinary tokens.
    spelled = [tokens.index(c) for c in "<|constrain|>"]
    m = held.deep_copy()
    assert all(m.consume_token(t) for t in tok.encode("lint ", add_special_tokens=False))
    assert not all(m.consume_token(t) for t in spelled)


def test_a_response_format_on_a_harmony_model_gives_the_json_alone(harmony_client):
    s = harmony_client
    s["reply"] = THINK + ANSWER
    s["harmony"].chat.completions.create(model="m", messages=MSGS)
    plain = _last_prompt(s)
    s["reply"] = '{"n": 4}<|return|>'
    fmt = {"type": "json_schema", "json_schema": {"name": "n", "schema": {
        "type": "object", "properties": {"n": {"type": "integer"}}, "required": ["n"]}}}
    r = s["harmony"].chat.completions.create(model="m", messages=MSGS, response_format=fmt)
    assert r.choices[0].message.content == '{"n": 4}' and _last_prompt(s) == plain + "<|channel|>final<|message|>"
    chunks = list(s["harmony"].chat.completions.create(model="m", messages=MSGS, response_format=fmt, stream=True))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == '{"n": 4}'
    # The other APIs read the same reply: Responses' text.format, Messages' forced tool.
    r = s["harmony_http"].post("/v1/responses", json={"model": "m", "input": "n?", "text": {"format": {
        "type": "json_schema", "name": "n", "schema": fmt["json_schema"]["schema"]}}})
    assert r.status_code == 200 and r.json()["output"][-1]["content"][0]["text"] == '{"n": 4}'
    s["reply"] = '{"path": "tests/"}<|call|>'
    r = s["harmony_http"].post("/v1/messages", json={
        "model": "m", "max_tokens": 32, "messages": MSGS, "tool_choice": {"type": "tool", "name": "run_tests"},
        "tools": [{"name": "run_tests", "input_schema": TOOLS[0]["function"]["parameters"]}]})
    assert r.status_code == 200
    assert [(b["name"], b["input"]) for b in r.json()["content"] if b["type"] == "tool_use"] == \
        [("run_tests", {"path": "tests/"})]
