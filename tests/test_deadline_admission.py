"""Deadline-aware admission (engine/deadline.py, 8.6.1): the step-time model
fitted online, a request predicted to miss its deadline refused before it
queues (503 when an idle engine would miss it too, 429 when the load is
the cause) or queued at the lowest priority, and the server's answer
naming the predicted time."""
from __future__ import annotations

import numpy as np
import pytest

from trajserve.config import PRIORITY_RANGE, CacheConfig, EngineConfig, SchedulerConfig
from trajserve.engine.deadline import DeadlineMiss
from trajserve.engine.engine import LLMEngine
from trajserve.engine.step_time import MIN_STEPS, StepTimeModel
from trajserve.request import Request
from trajserve.sampling import SamplingParams


def test_the_step_model_recovers_a_linear_cost_and_waits_for_enough_steps():
    m = StepTimeModel()
    rng = np.random.default_rng(0)
    truth = (0.02, 1e-4, 3e-3, 2e-6)
    for i in range(200):
        tokens, seqs, ctx = int(rng.integers(1, 512)), int(rng.integers(1, 16)), int(rng.integers(1, 8000))
        if i == MIN_STEPS - 1:
            assert not m.ready
        m.observe(tokens, seqs, ctx, truth[0] + truth[1] * tokens + truth[2] * seqs + truth[3] * ctx)
    assert m.ready and m.batch_sizes == set(range(1, 16))
    np.testing.assert_allclose(m.coefficients, truth, rtol=1e-4, atol=1e-9)
    assert m.seconds(1, 100, 4, 1000) == pytest.approx(0.02 + 0.01 + 0.012 + 0.002, rel=1e-4)


def test_a_noisy_fit_never_prices_more_work_as_cheaper():
    m = StepTimeModel()
    for _ in range(40):  # every step the same shape: only t_0 is determined
        m.observe(1, 1, 10, 0.01)
    assert (m.coefficients >= 0).all() and m.seconds(1, 1, 1, 10) == pytest.approx(0.01, rel=1e-3)


@pytest.fixture(scope="module")
def engine():
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256),
                                 scheduler=SchedulerConfig(max_num_seqs=2, speculative="off")))
    for _ in range(3):  # steps for the model to fit: prefills and decodes of a few shapes
        eng.add_request(list(range(10, 60)), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
        eng.add_request(list(range(70, 90)), SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
        while eng.has_unfinished_requests():
            eng.step()
    assert eng.deadlines.steps.ready
    yield eng
    eng.close()


def _request(ids, max_tokens) -> Request:
    """A request as add_request would queue it (not queued)."""
    return Request("probe", ids, SamplingParams(max_tokens=max_tokens, temperature=0), 8192)


def _drain(eng):
    while eng.has_unfinished_requests():
        eng.step()


def test_an_idle_engine_refuses_only_what_it_could_not_meet(engine):
    ids, params = list(range(100, 140)), SamplingParams(max_tokens=32, temperature=0)
    p = engine.deadlines.predict(_request(ids, 32))
    # Nothing runs or waits; the warm-up's arrivals still count as load (their work over the last 30 s).
    assert p.wait_s == 0 and p.total_s >= p.idle_s > 0 and p.output_tokens == 32
    rid = engine.add_request(ids, params, deadline_s=p.total_s * 3)  # room to spare: admitted
    assert engine.groups[rid].seqs[0].priority == 0
    _drain(engine)
    with pytest.raises(DeadlineMiss, match=r"deadline_ms [\d,]+ cannot be met: predicted completion [\d,]+ ms") as e:
        engine.add_request(ids, params, deadline_s=p.total_s / 10)
    assert e.value.status == 503 and "an idle engine would need that long" in str(e.value)
    assert not engine.has_unfinished_requests()  # nothing was queued


def test_a_busy_engine_refuses_with_429_what_an_idle_one_would_meet(engine):
    long = SamplingParams(max_tokens=120, temperature=0, ignore_eos=True)
    for base in (200, 300):  # both slots taken for a while
        engine.add_request(list(range(base, base + 30)), long)
    engine.step()
    engine.step()
    ids = list(range(400, 440))
    p = engine.deadlines.predict(_request(ids, 16))
    assert p.wait_s > 0 and p.total_s > p.idle_s
    deadline = (p.idle_s + p.total_s) / 2
    with pytest.raises(DeadlineMiss) as e:
        engine.add_request(ids, SamplingParams(max_tokens=16, temperature=0), deadline_s=deadline)
    assert e.value.status == 429 and e.value.busy and e.value.retry_after_s >= 1
    engine.deadlines.policy = "deprioritize"
    try:
        rid = engine.add_request(ids, SamplingParams(max_tokens=16, temperature=0), deadline_s=deadline)
        assert engine.groups[rid].seqs[0].priority == PRIORITY_RANGE[1]  # queued, last
        assert engine.deadlines.num_deprioritized == 1
    finally:
        engine.deadlines.policy = "refuse"
    _drain(engine)


def test_the_expected_output_and_the_margin_follow_finished_requests():
    from types import SimpleNamespace

    from trajserve.engine.deadline import DeadlineAdmission

    d = DeadlineAdmission(scheduler=None, kv=None)
    assert d.expected_output(500) == 500 and d.margin == 1.0  # nothing seen yet
    for i in range(64):
        req = SimpleNamespace(request_id=f"r{i}", num_output_tokens=7, arrival_time=10.0)
        d._priced[req.request_id] = 2.0  # priced at 2 s
        d.observe_finished(req, 10.0 + (3.0 if i % 10 == 0 else 1.0))  # one in ten took 1.5x its price
    assert d.expected_output(500) == 7 and d.expected_output(3) == 3
    assert d.margin == pytest.approx(1.5) and not d._priced
    # The margin is the (1 - miss target) quantile: tolerating 20 % late, the 80th percentile.
    loose = DeadlineAdmission(scheduler=None, kv=None, miss_target=0.2)
    loose._errors.extend(d._errors)
    assert loose.margin == pytest.approx(0.5)
    with pytest.raises(ValueError, match="deadline_miss_target must be in"):
        SchedulerConfig(deadline_miss_target=0.0)


def test_early_the_margin_only_grows():
    """From the first finished request a prediction that ran late raises the
    margin; one that ran early lowers it only once MIN_ERRORS have finished."""
    from trajserve.engine.deadline import MIN_ERRORS, DeadlineAdmission

    early, late = DeadlineAdmission(scheduler=None, kv=None), DeadlineAdmission(scheduler=None, kv=None)
    early._errors.append(0.5)
    late._errors.append(2.0)
    assert early.margin == 1.0 and late.margin == 2.0
    early._errors.extend([0.5] * (MIN_ERRORS - 1))
    assert early.margin == 0.5



def test_a_bad_policy_is_refused_by_name():
    with pytest.raises(ValueError, match="deadline_admission must be one of refuse, deprioritize, off"):
        SchedulerConfig(deadline_admission="maybe")


def test_the_server_answers_a_refusal_naming_the_predicted_time(engine):
    from server_util import served

    from trajserve.server.config import ServerConfig

    with served(engine, ServerConfig(served_model_names=("m",))) as client:
        body = {"model": "m", "messages": [{"role": "user", "content": "Say hi."}], "max_tokens": 64,
                "temperature": 0, "ignore_eos": True}
        r = client.post("/v1/chat/completions", json=body | {"deadline_ms": 0.5})
        assert r.status_code == 503, r.text
        err = r.json()["error"]
        assert err["param"] == "deadline_ms" and "predicted completion" in err["message"]
        r = client.post("/v1/messages", headers={"x-trajserve-deadline-ms": "0.5"},
                        json={"model": "m", "max_tokens": 64, "messages": [{"role": "user", "content": "Hi."}]})
        assert r.status_code == 503 and "predicted completion" in r.json()["error"]["message"]
        assert client.post("/v1/chat/completions", json=body | {"deadline_ms": 600_000}).status_code == 200
        metrics = client.get("/metrics").text
        assert 'trajserve_deadline_refusals_total{code="503"} 2.0' in metrics


def test_a_decode_that_outranks_it_holds_its_prefill_back(engine):
    """Program scheduling (the fixture's): while an urgent call decodes, a
    call it outranks is priced with the hold of its prefill (up to HOLD_S,
    until the urgent call's expected end); a call as urgent is not."""
    from trajserve.engine.program_precedence import HOLD_S

    urgent = engine.add_request(list(range(200, 230)), SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                                priority=-1)
    engine.step()
    engine.step()  # it decodes; one slot of two is free
    ids = list(range(400, 440))
    held = engine.deadlines.predict(_request(ids, 16))
    peer = _request(ids, 16)
    peer.priority = -1
    assert engine.deadlines.predict(peer).wait_s == 0
    assert held.wait_s == pytest.approx(HOLD_S)  # 190-odd tokens still to decode take longer than the hold
    engine.abort_request(urgent)
    _drain(engine)


def test_the_last_30_s_of_arrivals_are_the_load_a_prediction_is_stretched_by():
    from trajserve.engine.deadline import DeadlineAdmission

    d = DeadlineAdmission(scheduler=None, kv=None)
    d._arrivals.extend([(100.0, 3.0), (110.0, 6.0), (125.0, 3.0)])  # (arrival, its work in step seconds)
    assert d._load(128.0) == pytest.approx(12.0 / 30)
    assert d._load(135.0) == pytest.approx(9.0 / 30)  # the first left the window


def test_pricing_a_request_changes_nothing(engine):
    before = list(engine.deadlines._arrivals)
    engine.deadlines.predict(_request(list(range(5, 45)), 8))
    assert list(engine.deadlines._arrivals) == before and not engine.has_unfinished_requests()
