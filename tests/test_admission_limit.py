"""`serve --admission off|auto|N` (server/admission_limit.py, 8.6.2): a cap on
the requests the engine holds; auto puts it where goodput under the SLO
starts to fall, from the fitted step model and the recent requests' shape."""
from __future__ import annotations

import asyncio
import time

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from trajserve.config import SchedulerConfig
from trajserve.outputs import CompletionOutput, RequestMetrics, RequestOutput
from trajserve.sampling import SamplingParams
from trajserve.server.admission_limit import (MAX_CAP, WINDOW, AdmissionFull, AdmissionLimit, Shape, knee,
                                              num_ahead_of, parse_admission, predicted)
from trajserve.server.config import ServerConfig

A, B = 0.004, 0.003  # a step of r sequences: A + B r seconds


@settings(max_examples=200, deadline=None)
@given(a=st.floats(1e-4, 0.05), b=st.floats(0, 0.02), prompt=st.integers(1, 4000), output=st.integers(1, 512),
       accepted=st.floats(0, 1), slots=st.integers(1, 128), ttft=st.one_of(st.none(), st.floats(0.01, 30)),
       itl=st.one_of(st.none(), st.floats(0.001, 1)))
def test_the_cap_is_the_last_n_that_meets_the_slo(a, b, prompt, output, accepted, slots, ttft, itl):
    shape = Shape(prompt, output, max(1.0, output * (1 - accepted)))
    if ttft is None and itl is None:
        itl = 0.05
    n_max = slots + 256
    k = knee(a, b, shape, slots, 2048, 512, ttft, itl, n_max)

    def meets(n):
        i, t, _ = predicted(n, a, b, shape, slots, 2048, 512)
        return (itl is None or i <= itl) and (ttft is None or t <= ttft)

    assert 1 <= k.cap <= n_max
    if k.cap > 1 or meets(1):
        assert meets(k.cap)  # goodput holds at the cap ...
    if k.cap < n_max:
        assert not meets(k.cap + 1)  # ... and starts to fall one request later
    assert (k.itl_s, k.ttft_s, k.throughput) == predicted(k.cap, a, b, shape, slots, 2048, 512)


def test_the_model_in_the_docstring():
    """s(r) = a + b r; ITL s K / G, X = r / (K s); past the slots the
    throughput stays and the queue lengthens the TTFT."""
    shape = Shape(prompt=100, output=20)
    itl, ttft, x = predicted(4, A, B, shape, 8, 2048, 512)
    step4 = A + 4 * B
    assert itl == pytest.approx(step4) and x == pytest.approx(4 / (20 * step4)) and ttft == pytest.approx(step4)
    itl12, ttft12, x12 = predicted(12, A, B, shape, 8, 2048, 512)
    itl8, _, x8 = predicted(8, A, B, shape, 8, 2048, 512)
    assert (itl12, x12) == (itl8, x8)
    assert ttft12 == pytest.approx(4 / x8 + itl8)
    # A prompt longer than a chunk takes several steps to its first token.
    assert predicted(1, A, B, Shape(1500, 20), 8, 2048, 512)[1] == pytest.approx(3 * (A + B))
    # Accepted drafts: 20 tokens in 10 steps, the ITL half a step and twice the requests a second.
    itl, _, x = predicted(4, A, B, Shape(100, 20, steps=10), 8, 2048, 512)
    assert itl == pytest.approx(step4 / 2) and x == pytest.approx(4 / (10 * step4))


def test_a_tighter_slo_gives_a_lower_cap_and_never_none():
    shape = Shape(200, 32)
    caps = [knee(A, B, shape, 64, 2048, 512, None, itl, 320).cap for itl in (0.5, 0.05, 0.02, 0.01, 0.001)]
    assert caps == sorted(caps, reverse=True) and caps[0] > caps[-2] > 1
    assert caps[-1] == 1  # even one request alone misses: one at a time, never a closed door
    assert knee(A, B, shape, 64, 2048, 512, 2.0, None, 320).cap > 64  # TTFT slack admits a queue past the slots


@pytest.mark.parametrize("value", ["0", "-3", "x", "1.5", str(MAX_CAP + 1), "", "auto "])
def test_bad_values_are_refused_by_name(value):
    with pytest.raises(ValueError, match="--admission"):
        parse_admission(value)


def test_auto_needs_a_target_and_the_flag_reaches_the_config():
    from trajserve.cli import build_parser

    def config(*flags):
        return ServerConfig.from_args(build_parser().parse_args(["serve", *flags]))

    with pytest.raises(ValueError, match="--slo-ttft-ms or --slo-itl-ms"):
        config("--admission", "auto")
    assert config("--admission", "auto", "--slo-itl-ms", "50").admission == "auto"
    assert config("--admission", "12").admission == 12
    assert config().admission == "off"


def _finished(prompt=300, cached=200, out=24, reason="length", accepted=4) -> RequestOutput:
    return RequestOutput("r", None, list(range(prompt)), [CompletionOutput(0, token_ids=list(range(out)),
                                                                           finish_reason=reason)],
                         True, RequestMetrics(0.0, num_accepted_tokens=accepted), num_cached_tokens=cached)


def test_auto_waits_to_see_the_engine_then_caps_at_the_knee():
    clock = [0.0]
    cfg = SchedulerConfig(max_num_seqs=16)
    lim = AdmissionLimit("auto", cfg, itl_s=0.03, n_max=16 + 64, clock=lambda: clock[0])
    for i in range(40):  # steps of one and two sequences: a row's cost is not told from the step's yet
        lim.observe_step(1 + i % 2, A + B * (1 + i % 2))
    for _ in range(WINDOW):
        lim.observe(_finished())
    assert lim.current() is None
    lim.check(10_000)  # no cap yet: nothing refused
    for i in range(40):
        lim.observe_step(1 + i % 6, A + B * (1 + i % 6))
    assert lim.current() is None  # recomputed at most every REFRESH_S
    clock[0] += 1.0
    k = lim.current()
    want = knee(A, B, Shape(100, 24, 20), 16, cfg.max_num_batched_tokens, cfg.max_prefill_chunk, None, 0.03, 80)
    assert k.cap == want.cap == 10  # 0.004 + 0.003 r <= 0.03 * 24 / 20 holds to r = 10 (the fit found a and b)
    assert (k.itl_s, k.ttft_s, k.throughput) == pytest.approx((want.itl_s, want.ttft_s, want.throughput))
    lim.check(k.cap - 1)
    with pytest.raises(AdmissionFull, match=rf"caps it at {k.cap} \(auto: the SLO's knee, predicted ITL"):
        lim.check(k.cap)
    assert lim.metrics() == {"admission_cap": k.cap, "admission_refusals": 1}


def test_an_aborted_request_says_nothing_of_the_shape():
    lim = AdmissionLimit(3, SchedulerConfig())
    lim.observe(_finished(reason="abort"))
    lim.observe(_finished(out=10))
    assert list(lim._shapes) == [(100, 10, 6)]


def test_a_fixed_cap_refuses_the_next_request_until_one_ends(engine_f32):
    """On the engine thread: with --admission 2 the third request is refused
    before it queues; when one finishes the next one is taken."""
    from trajserve.server.async_engine import AsyncEngine

    ae = AsyncEngine(engine_f32, admission=AdmissionLimit(2, engine_f32.config.scheduler))
    ae.start()

    async def go():
        long = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
        a, qa = await ae.add(list(range(10, 30)), long)
        b, qb = await ae.add(list(range(40, 60)), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
        with pytest.raises(AdmissionFull, match="holds 2 requests and --admission caps it at 2"):
            await ae.add(list(range(70, 90)), long)
        while not (await qb.get()).finished:
            pass
        c, qc = await ae.add(list(range(70, 90)), SamplingParams(max_tokens=2, temperature=0))
        for q in (qa, qc):
            while not (await q.get()).finished:
                pass

    try:
        asyncio.run(go())
        assert ae.admission.num_refused == 1
        ae._refresh_snapshot()
        assert ae.snapshot["admission_cap"] == 2 and ae.snapshot["admission_refusals"] == 1
    finally:
        ae.shutdown()


def test_the_server_answers_429_naming_the_cap(engine_f32):
    from server_util import served

    with served(engine_f32, ServerConfig(admission=1)) as c:
        ae = c.app.state.engine
        # One long request in the engine (added on its thread, past the HTTP door), aborted at the end.
        ae.submit(lambda e: e.add_request(list(range(10, 30)), SamplingParams(max_tokens=4000, ignore_eos=True),
                                          request_id="holder"))
        body = {"model": c.get("/v1/models").json()["data"][0]["id"], "prompt": "Count: one two three",
                "max_tokens": 4, "temperature": 0}
        r = c.post("/v1/completions", json=body)
        assert r.status_code == 429 and int(r.headers["retry-after"]) >= 1
        assert "holds 1 requests and --admission caps it at 1" in r.json()["error"]["message"]
        for _ in range(100):  # the engine thread refreshes what /metrics reads after its next step
            metrics = c.get("/metrics").text
            if "trajserve_admission_refusals_total 1.0" in metrics:
                break
            time.sleep(0.05)
        assert "trajserve_admission_cap 1.0" in metrics and "trajserve_admission_refusals_total 1.0" in metrics
        ae.abort("holder")
        assert c.post("/v1/completions", json=body).status_code == 200


def test_the_sweeps_knee_is_the_rate_of_highest_goodput():
    from trajserve.bench.rate_sweep import knee as measured_knee
    from trajserve.bench.rate_sweep import parse_rates

    rows = [{"rate": r, "goodput": g, "in_system": n} for r, g, n in
            ((1, 0.90, 0.5), (4, 1.02, 3.1), (8, 1.02, 6.0), (16, 0.60, 30.0))]
    k = measured_knee(rows)
    assert (k["rate"], k["in_system"]) == (4, 3.1)  # of equal goodputs the lower rate
    assert k["fall_at_highest_rate"] == pytest.approx(0.41, abs=0.005)  # the chapter's 1.02 -> 0.60 req/s
    assert parse_rates("16,1,4") == [1.0, 4.0, 16.0]
    for bad in ("", "0,1", "x", "inf", "-2"):
        with pytest.raises(ValueError, match="--sweep-rate"):
            parse_rates(bad)


@pytest.mark.parametrize("scheduling, counts", [("fcfs", (3, 3, 3)), ("priority", (1, 2, 3)),
                                                ("program", (1, 2, 3))])
def test_the_cap_counts_what_a_newcomer_of_its_priority_runs_behind(scheduling, counts):
    from trajserve.engine.scheduler import Scheduler
    from trajserve.kv.cache_manager import KVCacheManager
    from trajserve.request import Request

    sched = Scheduler(SchedulerConfig(scheduling=scheduling), KVCacheManager(64, 16, 0.0))
    for rid, p in (("urgent", -3), ("plain", 0), ("batch", 5)):
        sched.add(Request(rid, [1, 2, 3], SamplingParams(max_tokens=1), 10**6, priority=p))
    sched.running.append(sched.waiting.pop())  # one of them running: counted the same
    assert tuple(num_ahead_of(sched, p) for p in (-3, 0, 5)) == counts


def test_a_more_urgent_request_is_admitted_past_less_urgent_ones(engine_f32):
    """--admission 1 under the default program scheduling: a batch request
    holds the only place, yet a plain one is taken (the batch one gives way
    to it); then another of either is refused, and an urgent one is taken."""
    from trajserve.server.async_engine import AsyncEngine

    assert engine_f32.config.scheduler.scheduling == "program"
    ae = AsyncEngine(engine_f32, admission=AdmissionLimit(1, engine_f32.config.scheduler))
    ae.start()
    long = SamplingParams(max_tokens=200, temperature=0, ignore_eos=True)

    async def go():
        _, qb = await ae.add(list(range(10, 30)), long, priority=5)
        _, qp = await ae.add(list(range(40, 60)), long, priority=0)
        for p in (5, 0):
            with pytest.raises(AdmissionFull, match="holds 1 requests" if p == 0 else "holds 2 requests"):
                await ae.add(list(range(70, 90)), long, priority=p)
        _, qu = await ae.add(list(range(70, 90)), SamplingParams(max_tokens=1), priority=-1)
        for q in (qb, qp, qu):  # every stream ends before the loop does
            while not (await q.get()).finished:
                pass

    try:
        asyncio.run(go())
        assert ae.admission.num_refused == 2
    finally:
        ae.shutdown()
