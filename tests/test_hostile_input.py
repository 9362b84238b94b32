"""Hostile input against `trajserve serve`: each case
is a clear 4xx naming the field (never a 5xx), and the server keeps serving."""
from __future__ import annotations

import json

import pytest

from trajserve.sampling import SamplingParams
from trajserve.sessions.ids import SESSION_ID_MAX, check_session_id
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.manager import SessionManager

SURROGATE = "h\ud800i"
ENDPOINTS = [
    ("/v1/completions", {"model": "m", "prompt": SURROGATE, "max_tokens": 2}, "prompt"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": SURROGATE}]},
     "messages.0.content"),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": SURROGATE}]},
     "messages.0.content"),
    ("/v1/messages/count_tokens", {"model": "m", "messages": [{"role": "user", "content": SURROGATE}]},
     "messages.0.content"),
    ("/v1/responses", {"model": "m", "input": SURROGATE}, "input"),
    ("/tokenize", {"model": "m", "prompt": SURROGATE}, "prompt"),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}],
                              "stop": ["\udfff"]}, "stop.0"),
]


@pytest.mark.parametrize("path,body,field", ENDPOINTS)
def test_a_lone_surrogate_is_a_400_naming_the_field(scripted, path, body, field):
    """JSON's \\ud800 escape decodes to a str no tokenizer can take: it was a
    500 (TypeError in the tokenizer) and reset the connection's next request."""
    http = scripted["http"]
    scripted["reply"] = "ok"
    r = http.post(path, content=json.dumps(body), headers={"content-type": "application/json"})
    assert r.status_code == 400, r.text
    assert field in r.text and "Unicode" in r.text
    # The same connection serves the next request.
    ok = http.post("/v1/completions", json={"model": "m", "prompt": "hello", "max_tokens": 2})
    assert ok.status_code == 200


def test_raw_surrogate_bytes_are_refused_too(scripted):
    body = b'{"model": "m", "prompt": "h\xed\xa0\x80i", "max_tokens": 2}'
    r = scripted["http"].post("/v1/completions", content=body, headers={"content-type": "application/json"})
    assert r.status_code == 400 and "prompt" in r.text


def test_the_tokenizer_names_a_lone_surrogate(scripted):
    with pytest.raises(ValueError, match="not valid Unicode"):
        scripted["tok"].encode(SURROGATE)


@pytest.mark.parametrize("sid", ["../../etc", "a/b", "x" * (SESSION_ID_MAX + 1), "nul\0id", ".", "..", "-rf",
                                 "", "sp ace", "%2e%2e"])
def test_session_ids_that_could_name_a_path_are_refused(sid):
    with pytest.raises(ValueError, match="session_id"):
        check_session_id(sid)


@pytest.mark.parametrize("sid", ["agent-1", "a..b", "0f8e2c1a-77b4-4c1e-9d3b-2a6f9f0c1e55", "user@host:run.3",
                                 "x" * SESSION_ID_MAX])
def test_ordinary_session_ids_pass(sid):
    assert check_session_id(sid) == sid


@pytest.fixture
def mgr(engine_f32, tmp_path):
    """A session manager on the shared engine, its store in tmp_path/store."""
    engine_f32.kv.clear_cache()
    m = SessionManager(engine_f32, SessionConfig(disk_dir=str(tmp_path / "store")))
    yield m
    m.shutdown()


def test_a_session_saved_to_disk_writes_only_inside_its_store(mgr, tmp_path):
    """An id with dots (allowed) pauses to disk: every file is in the store's
    own directory, named by the manager's counter, and nothing names the id."""
    with pytest.raises(ValueError, match="session_id"):
        mgr.before_turn("../../escape", None)
    s = mgr.open("You are a coding agent. " * 8 + "List the files.", session_id="a..b")
    s.generate(SamplingParams(max_tokens=4, temperature=0))
    s.pause(decision="disk")
    mgr.flush()
    files = [p for p in tmp_path.rglob("*") if p.is_file()]
    assert s.saved_blocks > 0 and {p.parent.name for p in files} == {"store"}
    assert all("a..b" not in p.name for p in files)
    s.close()


def test_a_failed_session_write_leaves_a_working_session(mgr, engine_f32, caplog):
    """A disk write that fails (here: ENOSPC) was an exception on the writer
    thread that every later turn and DELETE re-raised (a 500 until the TTL).
    It is logged and counted, and the resumed turn recomputes what was lost."""
    greedy = SamplingParams(max_tokens=6, temperature=0)
    ref = mgr.open("You are a coding agent. " * 8 + "List the files.")
    want = ref.generate(greedy).outputs[0].token_ids
    s = mgr.open("You are a coding agent. " * 8 + "List the files.")
    engine_f32.kv.clear_cache()

    def full(*args):
        raise OSError(28, "No space left on device")
    mgr.disk.write_file = full
    first = s.generate(greedy)
    assert first.outputs[0].token_ids == want
    s.pause(decision="disk")
    mgr.flush()
    assert mgr.metrics()["write_errors"] >= 1 and "No space left" in caplog.text
    s.resume(" Now run the tests.")
    out = s.generate(greedy)
    assert out.num_cached_tokens == 0  # nothing was saved: recomputed
    ref.pause(decision="drop")
    ref.resume(" Now run the tests.")
    assert out.outputs[0].token_ids == ref.generate(greedy).outputs[0].token_ids
    assert mgr.describe(s)["turns"] == 2
    s.close()


def test_out_of_vocabulary_stop_token_ids_are_refused(engine_f32):
    vocab = engine_f32.model_config.vocab_size
    with pytest.raises(ValueError, match=r"stop_token_ids token id 1000000000 is outside the vocabulary"):
        engine_f32.add_request([1, 2, 3], SamplingParams(stop_token_ids=[1000000000]))
    with pytest.raises(ValueError, match="stop_token_ids"):
        engine_f32.add_request([1, 2, 3], SamplingParams(stop_token_ids=[vocab]))
    assert not engine_f32.has_unfinished_requests()


def test_n_sequences_the_pool_cannot_hold_at_once_are_refused(engine_f32):
    """n=128 x 512 tokens on a small pool preempted 249 times in 45 s with no
    end in sight; it is refused up front, naming n, max_tokens and the limit."""
    fit = engine_f32.max_tokens_within_pool(20, 128)
    with pytest.raises(ValueError, match=rf"^n is 128: .*max_tokens can be at most {fit:,}"):
        engine_f32.add_request(list(range(1, 21)), SamplingParams(n=128, max_tokens=512))
    # The largest that fits is taken, and finishes.
    rid = engine_f32.add_request(list(range(1, 21)), SamplingParams(n=4, max_tokens=8, temperature=0.8, seed=1))
    done = None
    while engine_f32.has_unfinished_requests():
        done = next((o for o in engine_f32.step() if o.request_id == rid and o.finished), done)
    assert done is not None and len(done.outputs) == 4
    assert engine_f32.max_tokens_within_pool(20, 4) >= 8 and fit < 512


def test_a_recursive_tool_schema_compiles_for_a_forced_call(engine_f32):
    """tool_choice "required" wraps each tool's schema: its "#/$defs/..."
    references pointed at the wrapper's root ("Pointer '/$defs/n' does not
    exist") while the same schema compiled in response_format."""
    from trajserve.server.tool_calls import forced_schema
    from trajserve.structured import StructuredOutput

    node = {"type": "object", "properties": {"v": {"type": "integer"}, "kids": {
        "type": "array", "items": {"$ref": "#/$defs/n"}}}, "required": ["v"]}
    params = {"type": "object", "properties": {"root": {"$ref": "#/$defs/n"}}, "required": ["root"],
              "$defs": {"n": node}}
    tools = [{"type": "function", "function": {"name": "tree", "parameters": params}},
             {"type": "function", "function": {"name": "echo", "parameters": {
                 "type": "object", "properties": {"self": {"$ref": "#"}}}}}]
    sp = SamplingParams(max_tokens=40, temperature=0,
                        structured=StructuredOutput(json_schema=forced_schema(tools, "required")))
    engine_f32.prepare_structured(sp)  # raised ValueError before
    sp_alone = SamplingParams(structured=StructuredOutput(json_schema=params))
    engine_f32.prepare_structured(sp_alone)


def test_a_fork_of_a_host_paused_session_hits_its_saved_blocks(mgr, engine_f32):
    """The probe's fork of a session paused on the host recomputed 618 of 618
    tokens: the saved blocks were the parent's alone. They are copied back as
    cold cache at the fork, the parent stays paused with its saved copy."""
    greedy = SamplingParams(max_tokens=4, temperature=0)
    s = mgr.open("You are a coding agent. " * 12 + "List the files.")
    s.generate(greedy)
    s.pause(decision="host")
    mgr.flush()
    assert s.saved_blocks > 0 and engine_f32.kv.cached_prefix(s.history, s.scope).num_tokens == 0
    (child,) = s.fork(1)
    out = child.generate(greedy)
    assert out.num_cached_tokens >= (len(s.history) - 1) // 16 * 16 - 16
    assert s.state.value == "paused" and s.saved_blocks > 0
    s.resume(" ok")
    s.generate(greedy)


# Every API's booleans are booleans: "yes", 1 or "true" is a 4xx naming the
# field (422 on OpenAI's endpoints, 400 where Anthropic's and the Responses
# API answer malformed bodies so), never a stream the client did not ask for.
STRICT_BOOLS = [
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, "stream", 422),
    ("/v1/completions", {"model": "m", "prompt": "hi", "max_tokens": 2}, "echo", 422),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "stream", 422),
    ("/v1/chat/completions", {"model": "m", "messages": [{"role": "user", "content": "hi"}]}, "logprobs", 422),
    ("/v1/messages", {"model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}]}, "stream",
     400),
    ("/v1/responses", {"model": "m", "input": "hi"}, "stream", 400),
    ("/v1/responses", {"model": "m", "input": "hi"}, "store", 400),
]


@pytest.mark.parametrize("path,body,field,status", STRICT_BOOLS)
@pytest.mark.parametrize("value", ["yes", 1, "true"])
def test_a_boolean_field_takes_only_a_boolean(scripted, path, body, field, status, value):
    scripted["reply"] = "ok"
    r = scripted["http"].post(path, json={**body, field: value})
    assert r.status_code == status, r.text
    assert field in r.text and "bool" in r.text.lower()
    assert scripted["http"].post(path, json={**body, field: False}).status_code == 200


BAD_SCHEMA_TOOLS = [{"type": "function", "function": {"name": "fine", "parameters": {"type": "object"}}},
                    {"type": "function", "function": {"name": "broken", "parameters": {"type": 12}}}]


def test_a_tool_schema_that_cannot_hold_a_forced_call_names_the_tool(scripted):
    r = scripted["http"].post("/v1/chat/completions", json={
        "model": "m", "messages": [{"role": "user", "content": "hi"}], "tools": BAD_SCHEMA_TOOLS,
        "tool_choice": "required"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == "tools.1.function.parameters" and "'broken'" in err["message"]
    assert "tools.1" in err["message"]
    # Anthropic's shape for the same tools says the same in its message.
    r = scripted["http"].post("/v1/messages", json={
        "model": "m", "max_tokens": 4, "messages": [{"role": "user", "content": "hi"}],
        "tools": [{"name": "fine", "input_schema": {"type": "object"}},
                  {"name": "broken", "input_schema": {"type": 12}}], "tool_choice": {"type": "any"}})
    assert r.status_code == 400 and "tools.1" in r.text and "'broken'" in r.text
