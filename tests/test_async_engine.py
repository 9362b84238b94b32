"""The server's engine loop (server/async_engine.py) when a step raises:
the requests that were in it fail with a message, the loop goes on, and the
next request is served from a pool with nothing leaked."""
from __future__ import annotations

import asyncio

import pytest

from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams
from trajserve.server.async_engine import AsyncEngine, StepFailed


def test_a_step_that_raises_fails_its_requests_and_the_loop_goes_on():
    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64)))
    ae = AsyncEngine(engine)
    ended = []
    ae.on_finished = lambda out, deadline_s: ended.append(out)
    ae.start()
    real, calls = engine.sampler.sample, []

    def failing(*a, **kw):
        calls.append(1)
        if len(calls) == 2:  # the second step of the first request
            raise RuntimeError("injected sampler fault")
        return real(*a, **kw)

    engine.sampler.sample = failing
    params = SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)

    async def run(prompt):
        out = None
        async for o in ae.generate(prompt, params):
            out = o
        return out

    async def main():
        with pytest.raises(StepFailed, match="injected sampler fault"):
            await run("Hello")
        return await run("Hello")

    try:
        out = asyncio.run(main())
    finally:
        ae.shutdown()
    assert len(out.outputs[0].token_ids) == 4 and out.finished
    assert ae.num_failed_steps == 1 and ae._error is None
    # Both requests reach the counters: the failed one with its choice ended as "error".
    assert [[c.finish_reason for c in o.outputs] for o in ended] == [["error"], ["length"]]
    assert not engine.groups and engine.kv.pool.num_free + engine.kv.num_reclaimable == engine.kv.num_blocks
    engine.kv.pool.check()


def test_an_idle_loop_runs_the_idle_hooks_so_a_lease_runs_out_with_no_request():
    """No request in flight: the loop runs the step hooks' idle hooks, which a
    session manager registered itself (nobody wires it onto the loop)."""
    import time

    from trajserve.sessions.manager import SessionManager
    from trajserve.sessions.keep_policy import Decision

    engine = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=64)))
    mgr = SessionManager(engine)
    s = mgr.open(list(range(10, 60)))
    s.generate(SamplingParams(max_tokens=2, temperature=0))
    s.pause(decision="keep")
    ae = AsyncEngine(engine)
    ae.start()
    try:
        ae.submit(lambda _: mgr.machine.set_lease(s.record, time.monotonic()))
        deadline = time.monotonic() + 10
        while mgr.stats.lease_demotions == 0 and time.monotonic() < deadline:
            time.sleep(0.05)
    finally:
        ae.shutdown()
        mgr.shutdown()
    assert mgr.stats.lease_demotions == 1 and s.tier is not Decision.KEEP
