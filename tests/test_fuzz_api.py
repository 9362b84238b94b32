"""Hostile bodies against a live server: every API's request, mutated at
random (fields dropped, replaced by random JSON, unknown and known field
names added at every level, strings with lone surrogates, control
characters and hundreds of kilobytes), sent as JSON or as bytes that are not
UTF-8. Each must be answered 2xx or 4xx, never 5xx and never a reset
connection (one keep-alive client carries them all); a normal request right
after must succeed; when it is over the pool is idle and the server has
logged no traceback.

TRAJSERVE_FUZZ_EXAMPLES sets the cases per endpoint (default 25; CI's run; 150
for a longer one)."""
from __future__ import annotations

import json
import os
import urllib.parse

import httpx
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from pydantic import BaseModel

from server_util import ServerProcess
from test_server import wait_idle
from trajserve.server import anthropic, protocol, responses
from trajserve.sessions.ids import check_session_id

MODEL = "smol"
EXAMPLES = int(os.environ.get("TRAJSERVE_FUZZ_EXAMPLES", "25"))


def _field_names() -> list[str]:
    """Every field any request model declares, at any depth: the names a
    mutation adds, so nested models (messages, tools, blocks) get them too."""
    names = set()
    for module in (protocol, anthropic, responses):
        for obj in vars(module).values():
            if isinstance(obj, type) and issubclass(obj, BaseModel) and obj is not BaseModel:
                names.update(obj.model_fields)
    return sorted(names)


FIELDS = _field_names()

_WEATHER = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
_TREE = {"$defs": {"n": {"type": "object", "properties": {"kids": {"type": "array", "items": {"$ref": "#/$defs/n"}}}}},
         "$ref": "#/$defs/n"}
_CHAT = [{"role": "system", "content": "Be terse."},
         {"role": "user", "content": [{"type": "text", "text": "Weather?"}]},
         {"role": "assistant", "content": None, "tool_calls": [
             {"id": "c1", "type": "function", "function": {"name": "weather", "arguments": '{"city": "Oslo"}'}}]},
         {"role": "tool", "tool_call_id": "c1", "content": "sunny"}]
_OPENAI_TOOLS = [{"type": "function", "function": {"name": "weather", "parameters": _WEATHER}}]

# (method, path, base bodies): valid requests the mutations start from.
ENDPOINTS = {
    "completions": ("POST", "/v1/completions", [
        {"model": MODEL, "prompt": "Hello", "max_tokens": 4, "temperature": 0},
        {"prompt": [[1, 2, 3], "two"], "max_tokens": 2, "n": 2, "logprobs": 2, "echo": True, "stop": ["\n"],
         "logit_bias": {"12": -100}, "stream": True, "stream_options": {"include_usage": True}},
        {"prompt": "Hi", "max_tokens": 3, "session_id": "fuzz-a", "tool_wait_s": 5,
         "response_format": {"type": "json_schema", "json_schema": {"name": "t", "schema": _TREE}}}]),
    "chat": ("POST", "/v1/chat/completions", [
        {"model": MODEL, "messages": _CHAT, "max_tokens": 4, "tools": _OPENAI_TOOLS, "tool_choice": "required"},
        {"messages": [{"role": "user", "content": "Hi"}], "max_completion_tokens": 3, "top_logprobs": 2,
         "logprobs": True, "stream": True, "seed": 1, "temperature": 0.7, "top_p": 0.9,
         "tool_choice": {"type": "function", "function": {"name": "weather"}}, "tools": _OPENAI_TOOLS},
        {"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "response_format": {"type": "json_object"},
         "session_id": "fuzz-b", "tool_wait_s": 1}]),
    "messages": ("POST", "/v1/messages", [
        {"model": MODEL, "max_tokens": 4, "system": "Be terse.",
         "messages": [{"role": "user", "content": "Weather?"},
                      {"role": "assistant", "content": [{"type": "tool_use", "id": "t1", "name": "weather",
                                                         "input": {"city": "Oslo"}}]},
                      {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "t1", "content": "sunny"}]}],
         "tools": [{"name": "weather", "input_schema": _WEATHER}], "tool_choice": {"type": "any"}},
        {"max_tokens": 3, "messages": [{"role": "user", "content": "Hi"}], "stream": True, "stop_sequences": ["."],
         "temperature": 0.5, "top_k": 5}]),
    "count_tokens": ("POST", "/v1/messages/count_tokens", [
        {"model": MODEL, "system": [{"type": "text", "text": "Be terse."}],
         "messages": [{"role": "user", "content": "Hi"}], "tools": [{"name": "weather", "input_schema": _WEATHER}]}]),
    "responses": ("POST", "/v1/responses", [
        {"model": MODEL, "input": "Hi", "max_output_tokens": 4, "instructions": "Be terse."},
        {"input": [{"role": "user", "content": [{"type": "input_text", "text": "Weather?"}]},
                   {"type": "function_call", "call_id": "f1", "name": "weather", "arguments": '{"city": "Oslo"}'},
                   {"type": "function_call_output", "call_id": "f1", "output": "sunny"}],
         "tools": [{"type": "function", "name": "weather", "parameters": _WEATHER}], "max_output_tokens": 3,
         "stream": True, "store": True},
        {"input": "Hi", "max_output_tokens": 2, "previous_response_id": "resp_x",
         "text": {"format": {"type": "json_schema", "name": "t", "schema": _WEATHER}}}]),
    "tokenize": ("POST", "/tokenize", [
        {"model": MODEL, "prompt": "Hello world", "add_special_tokens": True, "return_token_strs": True},
        {"messages": _CHAT, "tools": _OPENAI_TOOLS, "add_generation_prompt": False, "continue_final_message": True}]),
    "detokenize": ("POST", "/detokenize", [{"model": MODEL, "tokens": [1, 2, 3]}]),
    "fork": ("POST", "/v1/sessions/fuzz-a/fork", [{"n": 2}]),
}

_SPECIAL = ["\ud800", "\udfff", "\x00", "\x1b[2J", "\u202e", "<|im_start|>", "<|im_end|>", "{{ 7*7 }}", "%s%n",
            "../../etc", "a/b", "\U0001f600", "é"]
_chars = st.one_of(st.characters(), st.characters(min_codepoint=0xD800, max_codepoint=0xDFFF, exclude_categories=()),
                   st.characters(max_codepoint=0x1F))
_texts = st.one_of(st.lists(st.one_of(_chars, st.sampled_from(_SPECIAL)), max_size=16).map("".join),
                   st.sampled_from(_SPECIAL),
                   st.builds(lambda s, n: s * n, st.sampled_from(["a", "\ud800", " é", "<|im_start|>"]),
                             st.sampled_from([300, 5000, 200_000])))
_ints = st.one_of(st.integers(-3, 300), st.integers(),
                  st.sampled_from([2**31, 2**53 + 1, 2**63, 2**64 + 1, -2**63, 10**40]))
_scalars = st.one_of(st.none(), st.booleans(), _ints, st.floats(), _texts)
JSON = st.recursive(_scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=3), st.dictionaries(st.one_of(st.sampled_from(FIELDS), _texts), inner, max_size=3)),
    max_leaves=8)


@st.composite
def mutated(draw, node, depth=0):
    """node with some of its parts dropped, replaced or added to."""
    if isinstance(node, dict):
        out = {}
        for k, v in node.items():
            roll = draw(st.integers(0, 11))
            if roll == 0:
                continue  # dropped
            out[k] = draw(JSON) if roll == 1 else draw(mutated(v, depth + 1))
        for k in draw(st.lists(st.sampled_from(FIELDS), max_size=2 if depth < 3 else 0)):
            out[k] = draw(JSON)
        return out
    if isinstance(node, list):
        out = [draw(mutated(v, depth + 1)) for v in node if draw(st.integers(0, 9))]
        return out + draw(st.lists(JSON, max_size=1))
    return draw(JSON) if draw(st.integers(0, 7)) == 0 else node


def _case(name: str):
    method, path, bases = ENDPOINTS[name]
    body = st.sampled_from(bases).flatmap(mutated)
    whole = st.one_of(body, body, body, body, JSON)  # now and then not an object at all
    raw = st.sampled_from([b"", b"{", b"\xff\xfe", b'{"prompt": "\xed\xa0\x80"}', b"[]" * 5000, b"null"])
    # (printable ASCII without outer spaces: what an HTTP client lets through)
    header = st.one_of(st.none(), st.text(st.characters(min_codepoint=0x20, max_codepoint=0x7E), max_size=40)
                       .map(str.strip), st.just("s" * 5000))
    return st.tuples(st.just(method), st.just(path), st.one_of(whole, whole, whole, raw),
                     st.booleans(), header)


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    root = tmp_path_factory.mktemp("fuzz")  # holds only the server's TMPDIR: nothing may appear beside it
    (root / "tmp").mkdir()
    s = ServerProcess("--dtype", "float32", "--max-model-len", "128", "--num-blocks", "64",
                      "--served-model-name", MODEL, "--kv-host-cache", "8MiB",
                      tmpdir=str(root / "tmp"))
    s.root = root
    s.sessions_seen = {"fuzz-a", "fuzz-b"}
    s.log = ""  # drained as it goes: a full stderr pipe would block the server
    yield s
    s.close()


@pytest.fixture(scope="module")
def http(server):
    with httpx.Client(base_url=server.url, timeout=120) as c:  # one keep-alive connection for every case
        c.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 2, "session_id": "fuzz-a", "tool_wait_s": 30})
        yield c


def _send(http, server, method, path, body, ascii_json, session_header):
    headers = {"content-type": "application/json"}
    if session_header is not None:
        headers["x-session-id"] = session_header
        server.sessions_seen.add(session_header)
    if isinstance(body, bytes):
        content = body
    else:
        if isinstance(body, dict) and isinstance(body.get("session_id"), str):
            server.sessions_seen.add(body["session_id"])
        # ensure_ascii=False writes lone surrogates as raw (invalid UTF-8) bytes
        content = json.dumps(body, ensure_ascii=ascii_json).encode("utf-8", "surrogatepass")
    return http.request(method, path, content=content, headers=headers)


def _check(http, server, case):
    r = _send(http, server, *case)
    assert r.status_code < 500, (case[:2], r.status_code, r.text[:500])
    if r.status_code == 200 and r.headers.get("content-type", "").startswith("text/event-stream"):
        assert "server_error" not in r.text and "api_error" not in r.text, r.text[-500:]
    if r.status_code == 200 and case[1].endswith("/fork"):
        server.sessions_seen.update(r.json()["forks"])
    ok = http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1})
    assert ok.status_code == 200, ok.text
    server.log += server.stderr_so_far()


@pytest.mark.parametrize("name", sorted(ENDPOINTS))
def test_fuzzed_bodies_get_2xx_or_4xx(server, http, name):
    @settings(max_examples=EXAMPLES, deadline=None, database=None,
              suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large, HealthCheck.large_base_example])
    @given(_case(name))
    def run(case):
        _check(http, server, case)
    run()


@settings(max_examples=EXAMPLES, deadline=None, database=None, suppress_health_check=[HealthCheck.too_slow])
@given(method=st.sampled_from(["GET", "DELETE"]), kind=st.sampled_from(["sessions", "responses", "models"]),
       ident=_texts)
def _fuzzed_ids(http, method, kind, ident):
    if kind == "models" and method == "DELETE":
        method = "GET"
    # (cut to 2000 characters: httpx refuses URLs past 64 KiB, and uvicorn's limit comes first anyway)
    quoted = urllib.parse.quote(ident[:2000].encode("utf-8", "surrogatepass"), safe="")
    r = http.request(method, f"/v1/{kind}/{quoted}")
    assert r.status_code < 500, (method, kind, ident[:80], r.status_code, r.text[:300])


def test_fuzzed_path_ids_get_2xx_or_4xx(server, http):
    _fuzzed_ids(http)
    assert http.post("/v1/completions", json={"prompt": "Hi", "max_tokens": 1}).status_code == 200


@pytest.mark.parametrize("sid", ["../../etc", "../x", "/tmp/x", "a/b", "x" * 10_000, "nul\0id", ".."])
def test_a_session_id_that_could_name_a_path_is_a_400(server, http, sid):
    for body, headers in (({"session_id": sid}, {}), ({}, {"x-session-id": sid.replace("\0", "%00")})):
        r = http.post("/v1/chat/completions", headers=headers,
                      json={"messages": [{"role": "user", "content": "Hi"}], "max_tokens": 2, "tool_wait_s": 60,
                            **body})
        assert r.status_code == 400 and r.json()["error"]["param"] == "session_id", r.text
    assert [p.name for p in server.root.iterdir()] == ["tmp"]


def test_after_the_fuzz_the_pool_is_idle_and_nothing_was_logged(server, http):
    for sid in server.sessions_seen:  # paused sessions hold blocks by design; closing them must free every one
        try:
            check_session_id(sid)
        except ValueError:
            continue  # refused when sent: no session has it
        r = http.delete("/v1/sessions/" + urllib.parse.quote(sid, safe=""))
        assert r.status_code in (200, 404), r.text
    wait_idle(server)
    assert [p.name for p in server.root.iterdir()] == ["tmp"], "no file outside the server's directories"
    log = server.log + server.stderr_so_far()
    assert "Traceback" not in log and " 500 " not in log, log[-3000:]
