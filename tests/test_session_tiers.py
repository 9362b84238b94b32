"""Paused sessions on the prefix cache's own tiers (kv/tier_holds.py,
sessions/offload.py): saved blocks are tier blocks named by their
chained hashes, so a preamble shared by two sessions is stored once, a resume
without room on the device leaves the state on its tier for the turn's match
to promote, and with the engine's tiers there is one store for both."""
import pytest

from test_sessions import GREEDY, OBS, messages, mgr  # noqa: F401 - mgr is a fixture
from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.manager import SessionManager


def reference(mgr, task):
    """The second turn's output with no pause in between."""
    s = mgr.open(messages(task))
    s.generate(GREEDY)
    s.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False))
    out = s.generate(GREEDY)
    s.close()
    mgr.engine.kv.clear_cache()
    return out


def test_a_preamble_two_sessions_share_is_stored_once(mgr):
    kv = mgr.engine.kv
    want = {t: reference(mgr, t).outputs[0].token_ids for t in ("Run the linter.", "Run the tests.")}
    a, b = mgr.open(messages("Run the linter.")), mgr.open(messages("Run the tests."))
    a.generate(GREEDY)
    b.generate(GREEDY)
    shared = kv.cached_prefix(a.history, a.scope)
    common = 0
    while common < min(len(a.history), len(b.history)) and a.history[common] == b.history[common]:
        common += 1
    shared_blocks = common // kv.block_size
    assert shared_blocks >= 2 and shared.num_tokens > 0
    a.pause(decision="host")
    b.pause(decision="host")
    mgr.flush()
    held = a.saved_blocks + b.saved_blocks
    # The shared blocks are on the host tier once, held by both sessions.
    assert len(mgr.host) == held - shared_blocks
    assert mgr.metrics()["held_blocks"] == len(mgr.host)
    for s, task in ((a, "Run the linter."), (b, "Run the tests.")):
        s.resume(OBS)
        assert s.generate(GREEDY).outputs[0].token_ids == want[task]
    a.close()
    b.close()
    assert len(mgr.host) == 0 and mgr.metrics()["held_blocks"] == 0


def test_a_resume_without_room_leaves_the_state_for_the_turns_match_to_promote(mgr, monkeypatch):
    kv = mgr.engine.kv
    task = "Explain the stack trace."
    want = reference(mgr, task)
    s = mgr.open(messages(task))
    s.generate(GREEDY)
    s.pause(decision="host")
    mgr.flush()
    saved = s.saved_blocks
    assert saved > 2 and kv.cached_prefix(s.history, s.scope).num_tokens == 0
    monkeypatch.setattr(kv, "begin_import", lambda *a, **k: None)  # the device has no room at the resume
    s.resume(OBS)
    monkeypatch.undo()
    assert len(mgr.host) == saved and mgr.metrics()["held_blocks"] == 0  # on its tier, no longer held
    out = s.generate(GREEDY)
    assert out.num_cached_tokens == saved * kv.block_size  # the match promoted every saved block
    assert out.outputs[0].token_ids == want.outputs[0].token_ids
    assert len(mgr.host) == 0  # promoted blocks leave the tier (it is exclusive)
    s.close()


@pytest.fixture()
def tiered_engine():
    eng = LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256, host_cache_bytes=64 << 20)))
    yield eng
    eng.close()


def test_with_the_engines_tiers_sessions_and_the_prefix_cache_share_one_store(tiered_engine):
    eng = tiered_engine
    mgr = SessionManager(eng, SessionConfig(host_bytes=1 << 30))  # ignored: the engine's tiers are the store
    try:
        assert mgr.offload.tiers is eng.lower and eng.kv.lower is eng.lower
        s = mgr.open(messages("Count the files."))
        s.generate(GREEDY)
        s.pause(decision="host")
        mgr.flush()
        assert s.saved_blocks > 0 and len(eng.lower.host) == s.saved_blocks
        eng.kv.clear_cache()  # LRU evicts nothing held; the session's blocks stay where they are
        assert len(eng.lower.host) == s.saved_blocks
        s.resume(OBS)
        out = s.generate(GREEDY)
        assert out.num_cached_tokens >= s.saved_blocks * eng.kv.block_size - eng.kv.block_size
        s.close()
    finally:
        mgr.shutdown()
    assert eng.kv.lower is eng.lower  # the engine's tiers stay attached
