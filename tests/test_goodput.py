"""Goodput, live (server/goodput.py, 8.6.2): each finished request counted
by its outcome against the server's SLO and its own deadline, R_good over
the last minute on /metrics; bad deadlines a 4xx naming the field."""
from __future__ import annotations

import math

import pytest

from trajserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from server_util import served
from trajserve.server.config import ServerConfig
from trajserve.server.goodput import SLO, WINDOW_S, Goodput, check_deadline_ms, outcome


def _out(ttft=0.1, itl=(0.02, 0.04), e2e=1.0, reason="stop") -> RequestOutput:
    m = RequestMetrics(arrival_time=10.0, first_token_time=10.0 + ttft, finished_time=10.0 + e2e, ttft=ttft,
                       inter_token_times=list(itl))
    return RequestOutput("r", None, [1, 2], [CompletionOutput(0, "x", [3, 4, 5], reason, None)], True, m)


def test_the_first_target_missed_names_the_outcome():
    slo = SLO(ttft_s=0.5, itl_s=0.05)
    assert outcome(_out(), slo, None) == "met"
    assert outcome(_out(ttft=0.6), slo, None) == "ttft"
    assert outcome(_out(itl=(0.02, 0.09)), slo, None) == "itl"  # the mean, 0.055
    assert outcome(_out(itl=(0.01, 0.09)), slo, None) == "met"  # one slow gap, mean 0.05
    assert outcome(_out(e2e=2.0), slo, 1.5) == "deadline" and outcome(_out(e2e=1.0), slo, 1.5) == "met"
    assert outcome(_out(reason="abort"), slo, None) == "unfinished"
    assert outcome(_out(ttft=9.0, e2e=9.5), SLO(), None) == "met"  # no target: every finished request is good


def test_r_good_counts_the_last_window():
    now = [0.0]
    g = Goodput(SLO(ttft_s=0.5), clock=lambda: now[0])
    for t in (0.0, 1.0, 2.0):
        now[0] = t
        assert g.record(_out(), None) == "met"
    g.record(_out(ttft=1.0), None)  # late: not good
    assert g.rate() == pytest.approx(3 / WINDOW_S)
    now[0] = 61.5
    assert g.rate() == pytest.approx(1 / WINDOW_S)  # the first two left the window


@pytest.mark.parametrize("bad", [0, -5, math.nan, math.inf, True, "5", 10**9, None])
def test_a_bad_deadline_is_refused_by_name(bad):
    with pytest.raises(ValueError, match=r"deadline_ms must be a number of milliseconds in \(0, 86,400,000\]"):
        check_deadline_ms(bad, "deadline_ms")


@pytest.fixture
def client(engine_f32):
    with served(engine_f32, ServerConfig(served_model_names=("m",), slo_ttft_ms=60_000, slo_itl_ms=60_000)) as c:
        yield c


def _chat(client, headers=None, **extra):
    return client.post("/v1/chat/completions", headers=headers or {},
                       json={"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 8,
                             "temperature": 0, "ignore_eos": True, **extra})


def _metric(client, name) -> float:
    lines = [ln for ln in client.get("/metrics").text.splitlines() if ln.startswith(name + " ")]
    return float(lines[0].split()[-1]) if lines else 0.0


def test_the_server_counts_each_request_against_the_slo_and_its_deadline(client, engine_f32, monkeypatch):
    monkeypatch.setattr(engine_f32.deadlines, "policy", "off")  # admitted whatever is predicted: late, counted
    assert _chat(client).status_code == 200  # generous SLO, no deadline: on time
    assert _chat(client, deadline_ms=0.001).status_code == 200  # a microsecond: late, yet answered
    assert _chat(client, headers={"x-trajserve-deadline-ms": "0.001"}).status_code == 200
    r = client.post("/v1/messages", json={"model": "m", "max_tokens": 4, "deadline_ms": 0.001,
                                          "messages": [{"role": "user", "content": "Hi."}]})
    assert r.status_code == 200
    assert _metric(client, 'trajserve_slo_requests_total{outcome="met"}') == 1
    assert _metric(client, 'trajserve_slo_requests_total{outcome="deadline"}') == 3
    assert _metric(client, "trajserve_goodput_requests_per_second") == pytest.approx(1 / WINDOW_S)


@pytest.mark.parametrize("extra, headers, where", [
    ({"deadline_ms": -1}, None, "deadline_ms"),
    ({"deadline_ms": "soon"}, None, "deadline_ms"),
    ({"deadline_ms": 10**9}, None, "deadline_ms"),
    ({}, {"x-trajserve-deadline-ms": "soon"}, "x-trajserve-deadline-ms"),
    ({}, {"x-trajserve-deadline-ms": "nan"}, "x-trajserve-deadline-ms"),
    ({}, {"x-trajserve-deadline-ms": "-3"}, "x-trajserve-deadline-ms"),
])
def test_a_bad_deadline_is_a_4xx_naming_it(client, extra, headers, where):
    r = _chat(client, headers, **extra)
    assert r.status_code in (400, 422) and where in r.json()["error"]["message"], r.text


def test_slo_flags_must_be_positive():
    with pytest.raises(ValueError, match="--slo-ttft-ms must be a positive number"):
        ServerConfig(slo_ttft_ms=0)


def test_a_bad_deadline_header_leaves_no_session_turn_open(client):
    """The header is read after the conversation's turn began: a 400 ends it."""
    for stream in (False, True):
        r = client.post("/v1/completions", headers={"x-trajserve-deadline-ms": "soon"},
                        json={"model": "m", "prompt": "Hi.", "max_tokens": 2, "stream": stream,
                              "prompt_cache_key": "thread-1"})
        assert r.status_code == 400 and "x-trajserve-deadline-ms" in r.text
        r = client.post("/v1/completions", json={"model": "m", "prompt": "Hi.", "max_tokens": 2,
                                                 "prompt_cache_key": "thread-1"})
        assert r.status_code == 200
    sessions = client.get("/v1/sessions").json()["data"]
    assert all(x["state"] in ("idle", "paused") for x in sessions)  # none left mid-turn
    assert sum(x["turns"] for x in sessions) == 2  # the two good requests ran as turns
