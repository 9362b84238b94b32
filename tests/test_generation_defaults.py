"""serve --override-generation-config: sampling defaults for what a request
leaves out, a request's own values winning, and max_new_tokens capping every
reply in each of the three APIs; bad values refused at start-up by name."""
from __future__ import annotations

import json

import pytest
from fastapi.testclient import TestClient

from trajserve.cli import build_parser
from trajserve.server.config import ServerConfig
from trajserve.server.generation_defaults import GenerationDefaults

DEFAULTS = '{"temperature": 0, "top_k": 5, "repetition_penalty": 1.1, "max_new_tokens": 7}'


@pytest.fixture(scope="module")
def client(scripted):
    config = ServerConfig(served_model_names=("m",), generation=GenerationDefaults.parse(DEFAULTS))
    return TestClient(scripted["app_over"](config))


def last_params(scripted):
    return scripted["params"][-1]


def test_the_flag_reaches_the_config():
    args = build_parser().parse_args(["serve", "--override-generation-config", DEFAULTS])
    g = ServerConfig.from_args(args).generation
    assert (g.temperature, g.top_p, g.top_k, g.repetition_penalty, g.max_new_tokens) == (0, None, 5, 1.1, 7)
    assert GenerationDefaults.parse(None) == GenerationDefaults.parse("  ") == GenerationDefaults()
    assert GenerationDefaults().describe() is None
    assert g.describe() == "temperature=0, top_k=5, repetition_penalty=1.1, max_new_tokens=7"


@pytest.mark.parametrize("text, named", [
    ('{"temprature": 0}', "unknown key 'temprature'"), ('[0]', "JSON object"), ("{temperature: 0}", "JSON object"),
    ('{"temperature": -1}', "temperature"), ('{"top_p": 0}', "top_p"), ('{"top_k": -2}', "top_k"),
    ('{"max_new_tokens": 0}', "max_new_tokens"), ('{"max_new_tokens": 2.5}', "max_new_tokens"),
    ('{"temperature": "hot"}', "temperature")])
def test_bad_values_are_refused_by_name(text, named):
    with pytest.raises(ValueError, match="--override-generation-config") as e:
        GenerationDefaults.parse(text)
    assert named in str(e.value)


def test_chat_gets_the_defaults_a_request_leaves_out_and_the_cap(client, scripted):
    scripted["reply"], scripted["end"] = "ok", ("stop", None)
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    sp = last_params(scripted)
    assert (sp.temperature, sp.top_k, sp.top_p, sp.repetition_penalty, sp.max_tokens) == (0, 5, 1.0, 1.1, 7)
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "temperature": 0.5, "top_k": 0, "max_tokens": 3})
    assert r.status_code == 200, r.text
    sp = last_params(scripted)  # the request's own values win; a smaller max_tokens stays
    assert (sp.temperature, sp.top_k, sp.max_tokens) == (0.5, 0, 3)
    # A max_tokens over the context is capped first, not refused (the cap leaves room).
    r = client.post("/v1/chat/completions", json={"model": "m", "messages": [{"role": "user", "content": "hi"}],
                                                  "max_tokens": 10**6})
    assert r.status_code == 200, r.text
    assert last_params(scripted).max_tokens == 7


def test_a_reply_cut_at_the_cap_says_max_tokens_in_each_api(client, scripted):
    scripted["reply"], scripted["end"] = "x" * 35, ("length", None)  # 7 deltas: 7 tokens, the cap
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 32000,
                                          "messages": [{"role": "user", "content": "hi"}]})
    assert r.status_code == 200, r.text
    assert last_params(scripted).max_tokens == 7 and r.json()["stop_reason"] == "max_tokens"
    with client.stream("POST", "/v1/messages", json={"model": "m", "max_tokens": 32000, "stream": True,
                                                     "messages": [{"role": "user", "content": "hi"}]}) as s:
        deltas = [json.loads(line[6:]) for line in s.iter_lines() if line.startswith("data: ")]
    assert [d["delta"]["stop_reason"] for d in deltas if d["type"] == "message_delta"] == ["max_tokens"]
    r = client.post("/v1/responses", json={"model": "m", "input": "hi"})
    assert r.status_code == 200, r.text
    assert last_params(scripted).max_tokens == 7
    assert r.json()["status"] == "incomplete" and r.json()["incomplete_details"]["reason"] == "max_output_tokens"
    r = client.post("/v1/completions", json={"model": "m", "prompt": "hi", "max_tokens": 100})
    assert r.status_code == 200 and last_params(scripted).max_tokens == 7
