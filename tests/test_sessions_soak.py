"""Soak test of agent sessions on the real scheduler, KV manager, tiers and
keep policy, with a stand-in model: the next token is a hash of the whole
history, and the "KV" of a slot is the token id written there. Every step
checks that each computed position's slot holds its token, so a state
restored from host or disk into the wrong block, a missed copy, or a cache
hit on stale blocks fails the test at once."""
import random
import time

import pytest

from standin_engine import VOCAB, StandInEngine, reference_reply
from trajserve.sampling import SamplingParams
from trajserve.sessions.keep_policy import Decision
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.manager import SessionManager, SessionState


@pytest.mark.parametrize("max_sessions", [None, 12])
def test_200_sessions_with_random_pauses_forks_and_closes(tmp_path, max_sessions):
    """With max_sessions=12 the manager also closes the least recently
    active sessions (paused, saved, or idle) under the test's feet."""
    rng = random.Random(7)
    B = 4
    eng = StandInEngine(num_blocks=96, block_size=B)
    # Host room for ~2 sessions' state: offloads fall back to disk, then drop.
    block_bytes = eng.runner.pool[0].numel() * 4
    mgr = SessionManager(eng, SessionConfig(host_bytes=40 * block_bytes, disk_dir=str(tmp_path),
                                            disk_bytes=200 * block_bytes, max_sessions=max_sessions))
    preamble = [rng.randrange(VOCAB) for _ in range(24)]
    live: list = []
    opened = pauses = 0
    while opened < 200 or live:
        op = rng.random()
        if opened < 200 and (not live or op < 0.25):
            salt = rng.choice([None, "t2"])
            s = mgr.open(preamble + [rng.randrange(VOCAB) for _ in range(rng.randrange(1, 12))], salt)
            opened += 1
            live.append(s)
            continue
        s = rng.choice(live)
        if s.state is SessionState.CLOSED:  # closed by max_sessions
            assert s.expired == "cap"
            live.remove(s)
            continue
        if s.state is SessionState.PAUSED:
            if rng.random() < 0.15:  # cancelled while its tool ran
                s.close()
                live.remove(s)
                continue
            s.resume([rng.randrange(VOCAB) for _ in range(rng.randrange(1, 10))])
            continue
        if len(s.history) > 120 or (s.turns >= 2 and rng.random() < 0.1):
            s.close()
            live.remove(s)
        elif rng.random() < 0.08 and len(live) < 40:
            live += s.fork(rng.randrange(1, 3))
        elif s.turns and rng.random() < 0.5:
            decision = rng.choice([None, "keep", "host", "disk", "drop"])
            d = s.pause(expected_wait_s=rng.choice([0.01, 1.0, 30.0, 600.0]), tool=rng.choice(["test", "lint"]),
                        decision=decision)
            pauses += 1
            assert d.decision in Decision
            if rng.random() < 0.1:
                if s.tier is Decision.KEEP:
                    mgr.machine.set_lease(s.record, time.monotonic())
                mgr.tick()
        else:
            n = rng.randrange(1, 6)
            before = list(s.history)
            out = s.generate(SamplingParams(max_tokens=n, temperature=0, ignore_eos=True))
            assert out.outputs[0].token_ids == reference_reply(before, n)
        eng.kv.pool.check()
        # tick() looks only at the paused and copying sessions: every one must be there.
        assert all((x in mgr.machine.paused) == (x.state is SessionState.PAUSED) for x in mgr.sessions.values())
        assert all(x.session_id in mgr.offload.copying for x in mgr.sessions.values() if x.copy is not None)
    st = mgr.metrics()
    # Every pause is one decision; every move of kept state down a tier (lease or pressure) one demotion.
    assert sum(st["keep_decisions"].values()) == pauses
    assert sum(st["demoted_to"].values()) == st["lease_demotions"] + st["pressure_demotions"]
    assert st["sessions"] == 0 and st["host_bytes"] == 0 and st["disk_bytes"] == 0
    assert st["swap_out_bytes"] > 0 and st["swap_in_bytes"] > 0
    assert set(st["keep_decisions"]) >= {"keep", "host", "disk", "drop"}
    assert (st["expired"]["cap"] > 0) == (max_sessions is not None)
    assert not eng.kv.tables and not eng.reqs
    eng.kv.clear_cache()
    assert eng.kv.pool.num_free == eng.kv.num_blocks
    eng.kv.pool.check()
