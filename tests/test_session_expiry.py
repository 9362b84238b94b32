"""Session records do not outlive their use: idle past idle_ttl_s, or the
least recently active beyond max_sessions, a session is closed and its
saved KV state freed; a turn in flight is never taken. (A server's clients
send a session_id and need not DELETE it, so without this the records, and
their host/disk state, would grow for as long as the server runs.)"""
import pytest

from trajserve.sampling import SamplingParams
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.manager import SessionManager, SessionState

SHORT = SamplingParams(max_tokens=2, temperature=0, ignore_eos=True)
PROMPT = "You are a coding agent. Tools: read_file(path), run_tests(). " * 4


@pytest.fixture()
def manager(engine_f32, tmp_path):
    made = []

    def make(**kw) -> SessionManager:
        engine_f32.kv.clear_cache()
        made.append(SessionManager(engine_f32, SessionConfig(disk_dir=str(tmp_path / "kv"), **kw)))
        return made[-1]
    yield make
    for m in made:
        m.shutdown()
    engine_f32.kv.clear_cache()
    assert engine_f32.kv.pool.num_free == engine_f32.kv.num_blocks


def test_an_idle_session_expires_and_its_saved_state_is_freed(manager):
    m = manager(idle_ttl_s=60.0)
    old = m.open(PROMPT + "Task: a.")
    old.generate(SHORT)
    old.pause(expected_wait_s=5.0, decision="host")
    m.flush()
    assert m.host.nbytes > 0 and old.saved_blocks > 0
    new = m.open(PROMPT + "Task: b.")
    m.tick()
    assert old.state is SessionState.PAUSED and new.state is SessionState.IDLE  # neither is 60 s idle
    old.last_active -= 61.0  # as if its pause had begun 61 s ago (it is the least recently active)
    m.tick()
    assert old.state is SessionState.CLOSED and list(m.sessions) == [new.session_id]
    assert m.host.nbytes == 0  # the saved blocks went with it
    assert m.metrics()["expired"] == {"idle": 1, "cap": 0}
    with pytest.raises(ValueError, match=r"closed \(no activity for 60 s\)"):
        old.resume("the tool's output")


def test_a_turn_in_flight_is_not_expired(manager):
    m = manager(idle_ttl_s=1e-6)  # every tick finds every session idle past the ttl
    s = m.open(PROMPT + "Task: c.")
    out = s.generate(SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))  # ticks before each step
    assert len(out.outputs[0].token_ids) == 4 and s.state is SessionState.IDLE and s.turns == 1
    m.tick()
    assert s.state is SessionState.CLOSED and m.metrics()["expired"]["idle"] == 1
    # A server turn (before_turn .. after_turn) is in flight the same way.
    t = m.before_turn("srv-1", None)
    m.tick()
    assert t.state is SessionState.IDLE and "srv-1" in m.sessions
    m.after_turn(t, [], None)
    m.tick()
    assert "srv-1" not in m.sessions


def test_max_sessions_closes_the_least_recently_active(manager):
    m = manager(max_sessions=3)
    a, b, c = (m.open(PROMPT + f"Task: {x}.") for x in "abc")
    a.generate(SHORT)  # a is now the most recently active: b is the oldest
    d = m.open(PROMPT + "Task: d.")
    assert b.state is SessionState.CLOSED and list(m.sessions) == [c.session_id, a.session_id, d.session_id]
    with pytest.raises(ValueError, match=r"closed \(the least recently active of 3 open sessions\)"):
        b.generate(SHORT)
    # A session with a turn in flight is passed over, however old.
    srv = m.before_turn("srv-1", None)  # c goes: 3 open again
    m.sessions.move_to_end("srv-1", last=False)  # and make it the oldest
    m.open(PROMPT + "Task: e.")
    assert "srv-1" in m.sessions and a.state is SessionState.CLOSED
    assert m.metrics()["expired"] == {"idle": 0, "cap": 3}
    m.after_turn(srv, [], None)


@pytest.mark.parametrize("kw, words", [
    ({"idle_ttl_s": 0}, "idle_ttl_s must be a finite number of seconds > 0"),
    ({"idle_ttl_s": float("nan")}, "idle_ttl_s"),
    ({"max_sessions": 0}, "max_sessions must be an integer >= 1"),
    ({"max_sessions": 2.5}, "max_sessions"),
])
def test_bad_limits_are_refused(manager, kw, words):
    with pytest.raises(ValueError, match=words):
        manager(**kw)


def test_sessions_opened_while_all_are_in_flight_are_trimmed_after(manager):
    """Server turns of three new sessions arrive together under a cap of 2:
    none can be closed while its turn runs, so all three open; once the
    turns end, the next tick brings the count back under the cap."""
    m = manager(max_sessions=2)
    turns = [m.before_turn(f"k{i}", None) for i in range(3)]
    assert len(m.sessions) == 3
    m.tick()
    assert len(m.sessions) == 3  # all in flight
    for t in turns:
        m.after_turn(t, [], None)
    m.tick()
    assert list(m.sessions) == ["k1", "k2"] and m.metrics()["expired"]["cap"] == 1
