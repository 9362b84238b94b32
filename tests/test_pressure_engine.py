"""The admission ceiling and fork throttling on the real model never change
greedy output; engine.metrics() reports latency percentiles."""
import pytest
from engine_util import run_requests

from trajserve.sampling import SamplingParams

GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)
PROMPTS = [f"Task {i}: list the files under src/ and say which one parses the config." for i in range(4)]


def run_all(engine, prompts, params):
    return run_requests(engine, [(p, params) for p in prompts])


@pytest.fixture()
def engine(engine_f32):
    engine_f32.kv.clear_cache()
    yield engine_f32
    engine_f32.kv.clear_cache()
    assert engine_f32.kv.pool.num_free == engine_f32.kv.num_blocks


def test_ceiling_serialises_admission_without_changing_tokens(engine, monkeypatch):
    free = run_all(engine, PROMPTS, GREEDY)
    engine.kv.clear_cache()
    waits = engine.scheduler.num_ceiling_waits
    # Room for about one request's blocks: the others wait in the queue.
    monkeypatch.setattr(engine.scheduler, "ceiling_blocks", 3)
    held = run_all(engine, PROMPTS, GREEDY)
    assert engine.scheduler.num_ceiling_waits > waits
    assert [o.outputs[0].token_ids for o in held] == [o.outputs[0].token_ids for o in free]
    # Held back, not run side by side: each starts after the previous one's first token.
    firsts = [o.metrics.first_token_time for o in held]
    assert firsts == sorted(firsts)


def test_fork_above_the_ceiling_queues_and_gives_the_same_tokens(engine, monkeypatch):
    params = SamplingParams(max_tokens=10, temperature=0, ignore_eos=True)
    rid = engine.add_request(PROMPTS[0], params)
    while True:
        outs = [o for o in engine.step() if o.request_id == rid]
        if outs and len(outs[0].outputs[0].token_ids) >= 3:
            break
    throttled = engine.scheduler.num_throttled_forks
    monkeypatch.setattr(engine.scheduler, "ceiling_blocks", 0)  # every fork now queues
    kids = engine.fork(rid, 2)
    assert engine.scheduler.num_throttled_forks == throttled + 2
    assert all(engine.scheduler.waiting[i].request_id in kids for i in range(-2, 0))
    done = {}
    while engine.has_unfinished_requests():
        for o in engine.step():
            if o.finished:
                done[o.request_id] = o
    parent = done[rid].outputs[0].token_ids
    for k in kids:
        assert done[k].outputs[0].token_ids == parent  # greedy: each branch continues like the parent


def test_metrics_report_latency_percentiles(engine):
    run_all(engine, PROMPTS[:2], GREEDY)
    m = engine.metrics()
    assert 0 < m["ttft_p50_s"] <= m["ttft_p90_s"] <= m["ttft_p99_s"]
    assert 0 < m["itl_p50_s"] <= m["itl_p90_s"] <= m["itl_p99_s"]
    assert 0.0 <= m["U_KV_active"] <= m["U_KV"] <= 1.0
    assert m["admission_ceiling"] == 0.88
