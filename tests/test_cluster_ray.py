"""`trajserve serve --replicas 2` on a real local Ray cluster: two
replicas of the embedded model, one thread each, behind the routing front
end. The server process starts Ray (sized by ray.init to this machine's
cores) and stops it when it is stopped; the tests kill replica processes
with SIGKILL, as a crash or the OOM killer would.

Which replica served a request is the x-trajserve-replica header; what it
served from its prefix cache is the reply's cached_tokens (the replica's own
count), and /metrics carries each replica's counters under replica="j"."""
from __future__ import annotations

import asyncio
import json
import os
import signal
import time

import httpx
import pytest

pytest.importorskip("ray")

from server_util import ServerProcess  # noqa: E402

PREAMBLE = ("You are a coding agent working in a large repository. Read files before editing them, run the "
            "tests after every change, and explain each step briefly. ")


@pytest.fixture(scope="module")
def cluster():
    with ServerProcess("--replicas", "2", "--threads", "1", "--replica-cpus", "1", startup_timeout=300) as s:
        yield s


def _chat(messages, **extra) -> dict:
    return {"messages": messages, "max_tokens": 8, "temperature": 0, **extra}


def _replica(r: httpx.Response) -> int:
    return int(r.headers["x-trajserve-replica"])


def _cached(r: httpx.Response) -> int:
    return r.json()["usage"]["prompt_tokens_details"]["cached_tokens"]


def _metric(text: str, name: str) -> float:
    return sum(float(line.rpartition(" ")[2]) for line in text.splitlines() if line.startswith(name))


def _replicas(url: str) -> list[dict]:
    return httpx.get(url + "/v1/replicas", timeout=30).json()["data"]


def _kill(url: str, j: int) -> int:
    pid = _replicas(url)[j]["pid"]
    os.kill(pid, signal.SIGKILL)
    return pid


def _wait_healthy(url: str, timeout: float = 180) -> list[dict]:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        data = _replicas(url)
        if all(r["healthy"] for r in data):
            return data
        time.sleep(0.5)
    raise AssertionError(f"replicas not back within {timeout} s: {data}")


async def _gather(url: str, bodies: list[tuple[str, dict]]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=url, timeout=300) as c:
        return await asyncio.gather(*(c.post(path, json=body) for path, body in bodies))


def test_turns_and_shared_preambles_go_to_the_replica_holding_their_blocks(cluster):
    url = cluster.url
    before = httpx.get(url + "/metrics", timeout=30).text
    # Four agents start at once, each with its own long preamble: the load
    # spreads them over both replicas.
    agents = [[{"role": "system", "content": f"Agent {i}. " + PREAMBLE * 4},
               {"role": "user", "content": f"Open file_{i}.py."}] for i in range(4)]
    first = asyncio.run(_gather(url, [("/v1/chat/completions", _chat(m)) for m in agents]))
    assert all(r.status_code == 200 for r in first), [r.text for r in first]
    home = [_replica(r) for r in first]
    assert set(home) == {0, 1}, home  # both replicas took agents: where a turn goes is a real choice
    cached = sum(_cached(r) for r in first)
    for turn in range(2):
        for i, (m, r) in enumerate(zip(agents, first)):
            m += [{"role": "assistant", "content": r.json()["choices"][0]["message"]["content"]},
                  {"role": "user", "content": f"Now step {turn}."}]
            got = httpx.post(url + "/v1/chat/completions", json=_chat(m), timeout=300)
            assert _replica(got) == home[i], (i, turn)
            # Everything before this turn's new message was computed there already.
            assert _cached(got) >= got.json()["usage"]["prompt_tokens"] - 40, got.json()["usage"]
            cached += _cached(got)
            first[i] = got
    # A fifth agent with agent 2's preamble but its own task lands where the preamble is.
    other = [agents[2][0], {"role": "user", "content": "A different task: list the tests."}]
    got = httpx.post(url + "/v1/chat/completions", json=_chat(other), timeout=300)
    assert _replica(got) == home[2]
    assert _cached(got) >= 0.8 * got.json()["usage"]["prompt_tokens"]
    cached += _cached(got)
    after = httpx.get(url + "/metrics", timeout=30).text
    # The replicas' own counters say the same, and the directory predicted every cached token.
    assert _metric(after, "trajserve_cached_prompt_tokens_total{") - \
        _metric(before, "trajserve_cached_prompt_tokens_total{") == cached
    assert _metric(after, "trajserve_router_matched_tokens_total") - \
        _metric(before, "trajserve_router_matched_tokens_total") == cached


def test_cache_salts_never_share_a_block(cluster):
    url = cluster.url
    msgs = [{"role": "system", "content": "Salted. " + PREAMBLE * 3}, {"role": "user", "content": "Hello."}]
    a1 = httpx.post(url + "/v1/chat/completions", json=_chat(msgs, cache_salt="tenant-a"), timeout=300)
    a2 = httpx.post(url + "/v1/chat/completions", json=_chat(msgs, cache_salt="tenant-a"), timeout=300)
    m0 = _metric(httpx.get(url + "/metrics", timeout=30).text, "trajserve_router_matched_tokens_total")
    b1 = httpx.post(url + "/v1/chat/completions", json=_chat(msgs, cache_salt="tenant-b"), timeout=300)
    m1 = _metric(httpx.get(url + "/metrics", timeout=30).text, "trajserve_router_matched_tokens_total")
    b2 = httpx.post(url + "/v1/chat/completions", json=_chat(msgs, cache_salt="tenant-b"), timeout=300)
    assert _cached(a1) == 0 and _cached(a2) > 0 and _replica(a2) == _replica(a1)
    assert _cached(b1) == 0 and m1 == m0  # tenant a's blocks are no match for tenant b, anywhere
    assert _cached(b2) > 0 and _replica(b2) == _replica(b1)
    assert a1.json()["choices"][0]["message"] == b1.json()["choices"][0]["message"]


def test_sessions_and_stored_responses_are_served_where_they_live(cluster):
    url = cluster.url
    bodies = [("/v1/chat/completions", _chat([{"role": "user", "content": f"Session {i}: " + PREAMBLE}],
                                             session_id=f"agent-{i}")) for i in range(2)]
    bodies += [("/v1/responses", {"input": f"Stored {i}: " + PREAMBLE, "max_output_tokens": 8, "store": True,
                                  "temperature": 0}) for i in range(2)]
    got = asyncio.run(_gather(url, bodies))
    assert all(r.status_code == 200 for r in got), [r.text for r in got]
    assert {_replica(r) for r in got} == {0, 1}
    for _ in range(3):  # anywhere else they would be a 404
        for i in range(2):
            s = httpx.get(f"{url}/v1/sessions/agent-{i}", timeout=30)
            assert s.status_code == 200 and _replica(s) == _replica(got[i]), s.text
            rid = got[2 + i].json()["id"]
            r = httpx.get(f"{url}/v1/responses/{rid}", timeout=30)
            assert r.status_code == 200 and r.json()["id"] == rid
    follow = httpx.post(url + "/v1/responses", json={"input": "And then?", "previous_response_id": got[3].json()["id"],
                                                     "max_output_tokens": 4}, timeout=300)
    assert follow.status_code == 200 and _replica(follow) == _replica(got[3])
    forks = httpx.post(f"{url}/v1/sessions/agent-1/fork", json={"n": 2}, timeout=30).json()["forks"]
    for f in forks:
        assert httpx.get(f"{url}/v1/sessions/{f}", timeout=30).status_code == 200
    assert httpx.delete(f"{url}/v1/sessions/agent-0", timeout=30).status_code == 200
    assert httpx.get(f"{url}/v1/sessions/agent-0", timeout=30).status_code == 404


def test_bad_requests_get_the_servers_own_4xx_through_the_front_end(cluster):
    url = cluster.url
    r = httpx.post(url + "/v1/chat/completions", json={"messages": "not a list"}, timeout=30)
    assert r.status_code == 422 and r.json()["error"]["param"] == "messages"
    r = httpx.post(url + "/v1/chat/completions", content=b"{not json", timeout=30,
                   headers={"content-type": "application/json"})
    assert 400 <= r.status_code < 500
    r = httpx.post(url + "/v1/completions", json={"prompt": "x", "max_tokens": 10**9}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "max_tokens"
    r = httpx.post(url + "/v1/chat/completions", json=_chat([{"role": "user", "content": "hi"}], model="nope"),
                   timeout=30)
    assert r.status_code == 404 and r.json()["error"]["param"] == "model"
    r = httpx.post(url + "/v1/messages", json={"model": "m", "max_tokens": -1, "messages": []}, timeout=30)
    assert 400 <= r.status_code < 500 and r.json()["type"] == "error"  # Anthropic's shape
    assert httpx.post(url + "/v1/completions", content=b"x" * (9 * 2**20), timeout=30).status_code == 413
    assert httpx.get(url + "/health", timeout=30).json()["healthy"] == 2
    assert httpx.head(url + "/", timeout=30).status_code == 200  # the base URL, as clients probe it


def test_a_client_that_leaves_mid_stream_frees_its_replica(cluster):
    url = cluster.url
    body = {"prompt": "Count slowly from one to a thousand:", "max_tokens": 2000, "temperature": 0,
            "stream": True, "ignore_eos": True}
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as s:
        j = int(s.headers["x-trajserve-replica"])
        for line in s.iter_lines():
            if line.startswith("data: {"):
                break
    aborted = f'trajserve_requests_total{{finish_reason="abort",replica="{j}"}}'
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:  # the replica aborted the request, the front end's count dropped
        if _metric(httpx.get(url + "/metrics", timeout=30).text, aborted) >= 1 and _replicas(url)[j]["in_flight"] == 0:
            break
        time.sleep(0.25)
    time.sleep(1.5)  # reports come every 0.5 s: this one is from after the abort
    r = _replicas(url)[j]
    assert (r["in_flight"], r["running"], r["waiting"]) == (0, 0, 0), r
    assert _metric(httpx.get(url + "/metrics", timeout=30).text, aborted) >= 1


def test_a_killed_replica_loses_no_request_and_comes_back(cluster):
    url = cluster.url
    prompts = [f"Write a short note number {i} about caching:" for i in range(6)]
    # Long enough replies that every request is still decoding when the busiest replica is killed
    # (24-token replies over a warm cache had all finished by then on a fast CPU: nothing to retry).
    bodies = [("/v1/completions", {"prompt": p, "max_tokens": 160, "temperature": 0, "ignore_eos": True})
              for p in prompts]
    want = [r.json()["choices"][0]["text"] for r in asyncio.run(_gather(url, bodies))]
    retries0 = _metric(httpx.get(url + "/metrics", timeout=30).text, "trajserve_router_retries_total")

    async def load_and_kill():
        async with httpx.AsyncClient(base_url=url, timeout=300) as c:
            tasks = [asyncio.create_task(c.post(path, json=body)) for path, body in bodies]
            deadline = time.monotonic() + 30
            while True:  # the front end counts a request once routed: wait for it, not for a fixed time
                await asyncio.sleep(0.05)
                busy = max(_replicas(url), key=lambda r: r["in_flight"])
                if busy["in_flight"] > 0 or time.monotonic() > deadline:
                    break
            assert busy["in_flight"] > 0
            os.kill(busy["pid"], signal.SIGKILL)
            return await asyncio.gather(*tasks)
    got = asyncio.run(load_and_kill())
    assert [r.status_code for r in got] == [200] * 6
    assert [r.json()["choices"][0]["text"] for r in got] == want  # the same greedy text, wherever it ran
    assert _metric(httpx.get(url + "/metrics", timeout=30).text, "trajserve_router_retries_total") > retries0
    data = _wait_healthy(url)
    assert sum(r["failures"] for r in data) >= 1
    again = asyncio.run(_gather(url, bodies[:4]))
    assert [r.status_code for r in again] == [200] * 4 and {_replica(r) for r in again} == {0, 1}
    assert [r.json()["choices"][0]["text"] for r in again] == want[:4]


def test_a_stream_whose_replica_dies_ends_with_an_error_event(cluster):
    url = cluster.url
    _wait_healthy(url)
    body = {"prompt": "Count slowly from one to a thousand:", "max_tokens": 400, "temperature": 0,
            "stream": True, "ignore_eos": True}
    lines = []
    with httpx.stream("POST", url + "/v1/completions", json=body, timeout=300) as s:
        assert s.status_code == 200
        it = s.iter_lines()
        for line in it:
            if line.startswith("data: {"):
                lines.append(line)
                break
        _kill(url, int(s.headers["x-trajserve-replica"]))
        lines += [line for line in it if line]
    assert '"error"' in lines[-2] and lines[-1] == "data: [DONE]", lines[-3:]
    assert len(lines) < 400  # it ended early, with the error: not a full reply
    _wait_healthy(url)


def test_a_session_survives_its_replicas_death(cluster):
    url = cluster.url
    _wait_healthy(url)
    msgs = [{"role": "system", "content": "Survivor. " + PREAMBLE * 2}, {"role": "user", "content": "Start."}]
    t1 = httpx.post(url + "/v1/chat/completions", json=_chat(msgs, session_id="survivor"), timeout=300)
    msgs += [{"role": "assistant", "content": t1.json()["choices"][0]["message"]["content"]},
             {"role": "user", "content": "Go on."}]
    # The same turn without a session, salted so it shares nothing: the reference output.
    ref = httpx.post(url + "/v1/chat/completions", json=_chat(msgs, cache_salt="reference"), timeout=300)
    home = _replica(t1)
    _kill(url, home)
    t2 = httpx.post(url + "/v1/chat/completions", json=_chat(msgs, session_id="survivor"), timeout=300)
    assert t2.status_code == 200, t2.text
    assert _replica(t2) != home and _cached(t2) == 0  # moved, and recomputed its context there
    assert t2.json()["choices"][0]["message"] == ref.json()["choices"][0]["message"]
    t3 = httpx.post(url + "/v1/chat/completions", json=_chat(msgs + [
        {"role": "assistant", "content": t2.json()["choices"][0]["message"]["content"]},
        {"role": "user", "content": "Finish."}], session_id="survivor"), timeout=300)
    assert _replica(t3) == _replica(t2) and _cached(t3) > 0  # it stays where it moved
    _wait_healthy(url)


def test_bench_cluster_compares_routers_on_the_same_prompts():
    from test_cli import trajserve

    r = trajserve("bench", "cluster", "--routers", "kv", "--trajectories", "3", "--turns", "2", "--preambles", "2",
                  "--prefix-len", "96", "--tool-words", "16", "--output-len", "4", "--request-rate", "inf", "--json")
    assert r.returncode == 0, r.stderr
    rows = json.loads(r.stdout)["rows"]
    assert [row["config"] for row in rows] == ["one server", "2 replicas, kv"]
    assert rows[0]["prompt_tokens"] == rows[1]["prompt_tokens"] > 0  # the same prompts through both
    assert all(row["failed"] == 0 and 0 < row["hit_rate"] < 1 for row in rows), rows
    assert rows[1]["hit_rate_vs_one"] == pytest.approx(rows[1]["hit_rate"] / rows[0]["hit_rate"])
    assert sum(rows[1]["routed"]) >= 6  # every turn went through the front end


def test_each_replica_keeps_its_own_disk_tier_and_reports_it_after_a_restart(tmp_path):
    """--kv-disk-dir DIR: replica j's tier is DIR/replica-j (one engine holds a
    directory); after a clean stop and a new start, the blocks each replica
    adopted from its directory are in the prefix directory before any
    request, and a conversation computed before the restart hits there."""
    disk = tmp_path / "kv"
    args = ("--replicas", "2", "--threads", "1", "--kv-disk-dir", str(disk), "--kv-disk-cache", "64MiB")
    convs = [[{"role": "system", "content": f"Persisted {i}. " + PREAMBLE * 3}, {"role": "user", "content": "Hi."}]
             for i in range(2)]
    with ServerProcess(*args, startup_timeout=300) as s:
        first = asyncio.run(_gather(s.url, [("/v1/chat/completions", _chat(m)) for m in convs]))
        assert [r.status_code for r in first] == [200, 200] and {_replica(r) for r in first} == {0, 1}
    assert sorted(p.name for p in disk.iterdir()) == ["replica-0", "replica-1"]
    assert all(any((disk / f"replica-{j}").iterdir()) for j in range(2))
    with ServerProcess(*args, startup_timeout=300) as s:
        deadline = time.monotonic() + 30
        while httpx.get(s.url + "/v1/replicas", timeout=30).json()["directory_hashes"] == 0:
            assert time.monotonic() < deadline, "the adopted blocks were never reported"
            time.sleep(0.25)
        for i in (1, 0):  # one at a time: only the directory can tell where each is
            again = httpx.post(s.url + "/v1/chat/completions", json=_chat(convs[i]), timeout=300)
            assert _replica(again) == _replica(first[i]) and _cached(again) > 0
            assert again.json()["choices"][0]["message"] == first[i].json()["choices"][0]["message"]


def test_bad_replica_options_are_refused_before_ray_starts():
    from test_cli import trajserve

    for args, said in ((("--replicas", "0"), "--replicas must be >= 1"),
                       (("--replicas", "2", "--replica-cpus", "0"), "--replica-cpus must be a number > 0"),
                       (("--replicas", "2", "--router", "random"), "invalid choice")):
        r = trajserve("serve", *args, "--port", "0", timeout=60)
        assert r.returncode != 0 and said in r.stderr, r.stderr[-500:]
        assert "Started a local Ray instance" not in r.stderr
