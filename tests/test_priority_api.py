"""A request's priority and program through the four APIs: the body's
`priority` (lower first) or Dynamo's agent_hints.priority (higher first,
negated), the program a named conversation's session; bad priorities a 4xx
naming the field."""
from __future__ import annotations

import time

import pytest

from server_util import served
from trajserve.server.config import ServerConfig

ENDPOINTS = {
    "chat": ("/v1/chat/completions", lambda extra: {"messages": [{"role": "user", "content": "Say hi."}],
                                                    "max_tokens": 3, **extra}),
    "completions": ("/v1/completions", lambda extra: {"prompt": "Say hi.", "max_tokens": 3, **extra}),
    "messages": ("/v1/messages", lambda extra: {"messages": [{"role": "user", "content": "Say hi."}],
                                                "max_tokens": 3, **extra}),
    "responses": ("/v1/responses", lambda extra: {"input": "Say hi.", "max_output_tokens": 3, **extra}),
}


@pytest.fixture
def client(engine_f32, monkeypatch):
    seen = []
    add = engine_f32.add_request

    def recording(*a, **kw):
        seen.append((kw.get("priority"), kw.get("program")))
        return add(*a, **kw)
    monkeypatch.setattr(engine_f32, "add_request", recording)
    with served(engine_f32, ServerConfig(served_model_names=("m",))) as c:
        c.seen = seen
        yield c


def _post(client, api, **extra):
    path, body = ENDPOINTS[api]
    return client.post(path, json={"model": "m", "temperature": 0, **body(extra)})


@pytest.mark.parametrize("api", list(ENDPOINTS))
def test_the_bodys_priority_reaches_the_scheduler(client, api):
    r = _post(client, api, priority=-7)
    assert r.status_code == 200, r.text
    assert client.seen[-1] == (-7, None)
    assert _post(client, api).status_code == 200
    assert client.seen[-1] == (0, None)  # the default


def test_dynamos_hint_is_negated_and_the_body_wins(client):
    hinted = {"agent_hints": {"priority": 5}}
    assert _post(client, "chat", nvext=hinted).status_code == 200
    assert client.seen[-1][0] == -5  # higher first there, lower first here
    assert _post(client, "chat", nvext={"agent_hints": {"priority": 10**9}}).status_code == 200
    assert client.seen[-1][0] == -1000  # clamped into the range
    assert _post(client, "chat", nvext=hinted, priority=3).status_code == 200
    assert client.seen[-1][0] == 3


def test_a_conversations_calls_are_one_program(client):
    for _ in range(2):
        assert _post(client, "chat", prompt_cache_key="thread-1").status_code == 200
    (a, pa), (b, pb) = client.seen[-2:]
    assert pa is not None and pa == pb and pa.startswith("conv-")  # the session's id, never the client's key


def test_a_paused_sessions_state_keeps_its_turns_priority(client):
    """The turn's priority reaches the session's pause record, which the pause
    machine reclaims by (least urgent first)."""
    body = {"session_id": "s-urgent", "tool_wait_s": 5.0}
    assert _post(client, "chat", priority=-3, **body).status_code == 200
    sessions = client.app.state.sessions
    for _ in range(100):  # the turn's end is recorded on the engine thread
        s = sessions.sessions.get("s-urgent")
        if s is not None and s.record.priority == -3:
            break
        time.sleep(0.05)
    assert s.record.priority == -3 and s.state.value == "paused"


@pytest.mark.parametrize("api", list(ENDPOINTS))
@pytest.mark.parametrize("bad", [1.5, True, "1", 10**6, -10**6, [1], {"p": 1}])
def test_a_bad_priority_is_a_4xx_naming_the_field(client, api, bad):
    r = _post(client, api, priority=bad)
    # a field of the wrong type or range: 422 on the chat and completions endpoints, 400 on the others (their APIs')
    assert r.status_code == (422 if api in ("chat", "completions") else 400), r.text
    assert "priority" in r.json()["error"]["message"]
    assert client.seen == []  # nothing queued


def test_a_nan_priority_is_a_4xx(client):
    r = client.post("/v1/chat/completions", content=b'{"model": "m", "messages": [{"role": "user", "content": "x"}],'
                    b' "priority": NaN}', headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500 and "priority" in r.text, r.text


def test_an_api_key_sets_its_requests_default_and_best_priority(engine_f32, monkeypatch):
    seen = []
    add = engine_f32.add_request

    def recording(*a, **kw):
        seen.append(kw.get("priority"))
        return add(*a, **kw)
    monkeypatch.setattr(engine_f32, "add_request", recording)
    config = ServerConfig(served_model_names=("m",), api_keys=("interactive", "batch"), api_key_priorities=(-5, 100))
    with served(engine_f32, config) as client:
        def post(key, header="bearer", **extra):
            h = {"Authorization": f"Bearer {key}"} if header == "bearer" else {"x-api-key": key}
            path, body = ENDPOINTS["chat"]
            return client.post(path, headers=h, json={"model": "m", "temperature": 0, **body(extra)})
        assert post("interactive").status_code == 200  # none named: the key's
        assert post("batch").status_code == 200
        assert post("batch", priority=-1000).status_code == 200  # better than its key allows: the key's
        assert post("batch", priority=500).status_code == 200  # worse: as asked
        assert post("interactive", header="x-api-key", priority=-7).status_code == 200
        assert post("nobody").status_code == 401
    assert seen[-5:] == [-5, 100, 100, 500, -5]  # (before them: the sessions' start-up calibration)


@pytest.mark.parametrize("keys, priorities, message", [
    (("a", "b"), (1,), "one priority per --api-key: 1 priorities for 2 keys"),
    (None, (1,), "1 priorities for 0 keys"),
    (("a",), (5000,), r"--api-key-priority must be in \[-1000, 1000\], got 5000"),
])
def test_key_priorities_are_checked_by_name(keys, priorities, message):
    with pytest.raises(ValueError, match=message):
        ServerConfig(api_keys=keys, api_key_priorities=priorities)
