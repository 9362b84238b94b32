"""Agent sessions on the real model: a pause under every keep decision (keep,
host, disk, drop) and a corrupted disk block all give the greedy tokens of a
session that never paused; state leaves the device when the policy says so
and comes back as cache hits."""
import time

import pytest

from engine_util import run_requests
from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.sampling import SamplingParams
from trajserve.sessions.keep_policy import Decision
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.manager import SessionBusy, SessionManager, SessionState

GREEDY = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
SYSTEM = ("You are a coding agent working in a git repository. Tools: read_file(path), write_file(path, text), "
          "run_tests(), grep(pattern). Think before each call and keep answers short. ") * 3
OBS = "<|im_end|>\n<|im_start|>user\nTool output: 14 passed, 1 failed (test_cache_eviction).<|im_end|>\n" \
      "<|im_start|>assistant\n"


@pytest.fixture()
def mgr(engine_f32, tmp_path):
    engine_f32.kv.clear_cache()
    m = SessionManager(engine_f32, SessionConfig(disk_dir=str(tmp_path / "kv")))
    yield m
    m.shutdown()
    assert engine_f32.kv.reclaimer is None
    engine_f32.kv.clear_cache()
    assert engine_f32.kv.pool.num_free == engine_f32.kv.num_blocks
    engine_f32.kv.pool.check()


def messages(task: str) -> list[dict]:
    return [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]


def two_turns(mgr, task: str, pause=None):
    s = mgr.open(messages(task))
    first = s.generate(GREEDY)
    info = None
    if pause is not None:
        before = mgr.engine.kv.cached_prefix(s.history, s.scope).num_tokens
        d = s.pause(expected_wait_s=1.0, tool="run_tests", decision=pause)
        mgr.flush()  # saves land on the copy engine: now the device frames are free
        after = mgr.engine.kv.cached_prefix(s.history, s.scope).num_tokens
        info = (d, before, after)
    if s.state is SessionState.PAUSED:
        s.resume(OBS)
    else:
        s.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False))
    second = s.generate(GREEDY)
    s.close()
    return first, second, info


@pytest.mark.parametrize("decision", ["keep", "host", "disk", "drop"])
def test_pause_resume_under_each_decision_is_token_identical(mgr, decision):
    task = f"Fix the failing test ({decision})."
    ref_first, ref_second, _ = two_turns(mgr, task)
    mgr.engine.kv.clear_cache()
    first, second, (d, before, after) = two_turns(mgr, task, pause=decision)
    assert d.decision is Decision(decision)
    assert first.outputs[0].token_ids == ref_first.outputs[0].token_ids
    assert second.outputs[0].token_ids == ref_second.outputs[0].token_ids
    B = mgr.engine.kv.block_size
    history_blocks = (len(first.prompt_token_ids) + len(first.outputs[0].token_ids) - 1) // B
    assert before == history_blocks * B  # the whole computed history was cached on the device
    if decision == "keep":
        assert after == before
        assert second.num_cached_tokens >= before
    else:
        assert after < before  # its own blocks left the device (the shared system prompt may stay)
        if decision in ("host", "disk"):
            assert second.num_cached_tokens >= before  # reloaded: the next turn hits all of it
            assert mgr.stats.swap_in_bytes > 0 and mgr.stats.swap_out_bytes > 0
        else:
            assert second.num_cached_tokens <= after + B


def test_corrupted_disk_block_is_recomputed_not_served(mgr):
    task = "Explain the failing test."
    _, ref_second, _ = two_turns(mgr, task)
    mgr.engine.kv.clear_cache()
    s = mgr.open(messages(task))
    s.generate(GREEDY)
    s.pause(decision="disk")
    if s.copy is not None:  # still copying: the record says so, and counts the blocks where they are
        info = mgr.describe(s)
        assert info["copying"] == "save" and info["tier"] == "disk" and info["saved_blocks"] == 0
    mgr.flush()  # the copy and the write run on background threads
    assert s.saved_blocks > 4 and s.table.counts()["disk"] == s.saved_blocks
    assert mgr.describe(s)["copying"] is None
    bad = 3
    path = mgr.disk.path(s.table.frames[bad].hex())  # blocks are named by their chained hashes
    raw = bytearray(path.read_bytes())
    raw[-5] ^= 0x40  # one bit of one value of one block
    path.write_bytes(raw)
    s.resume(OBS)
    out = s.generate(GREEDY)
    assert mgr.disk.num_corrupt == 1
    B = mgr.engine.kv.block_size
    # Blocks before the corrupt one came back from disk; it and every later one were recomputed.
    assert out.num_cached_tokens == bad * B
    assert out.outputs[0].token_ids == ref_second.outputs[0].token_ids


def test_leases_advance_under_ordinary_traffic(mgr):
    """The manager's housekeeping is an engine step hook: a lease runs out
    while other requests step the engine directly (LLM.generate, a bench),
    not only on the manager's own turns; a shut-down manager's hooks are gone."""
    s = mgr.open(messages("Run the linter."))
    s.generate(GREEDY)
    s.pause(decision="keep")
    mgr.machine.set_lease(s.record, time.monotonic())
    run_requests(mgr.engine, [("An unrelated prompt about the sea.", SamplingParams(max_tokens=2))])
    assert mgr.stats.lease_demotions == 1 and s.tier is not Decision.KEEP
    mgr.shutdown()
    run_requests(mgr.engine, [("Another prompt.", SamplingParams(max_tokens=2))])  # no hook of a closed manager


def test_expired_keep_lease_moves_state_down_a_tier(mgr):
    s = mgr.open(messages("Run the linter."))
    s.generate(GREEDY)
    s.pause(decision="keep")
    assert s.tier is Decision.KEEP and s.pin is not None
    mgr.machine.set_lease(s.record, time.monotonic())  # the lease has run out
    mgr.tick()
    assert s.tier is not Decision.KEEP and s.pin is None
    assert mgr.stats.lease_demotions == 1
    s.resume(OBS)
    s.generate(GREEDY)


def test_forks_share_the_history_and_continue_like_the_parent(mgr):
    s = mgr.open(messages("Pick a file to open."))
    s.generate(GREEDY)
    B = mgr.engine.kv.block_size
    computed = (len(s.history) - 1) // B * B  # full blocks of the history the first turn computed
    kids = s.fork(2)
    assert [k.history for k in kids] == [s.history] * 2
    for k in [s, *kids]:
        k.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False))
    outs = [k.generate(GREEDY) for k in [*kids, s]]
    assert outs[0].outputs[0].token_ids == outs[1].outputs[0].token_ids == outs[2].outputs[0].token_ids
    assert all(o.num_cached_tokens >= computed for o in outs)


def test_a_paused_session_forks_and_one_in_flight_does_not(mgr):
    """Over HTTP a paused session resumes only with its next turn, so fork
    takes it as it is: the children start idle with its history and run
    like a session that never paused; it stays paused. A session whose turn
    is still running has no settled history: fork is SessionBusy (409)."""
    s = mgr.open(messages("Fork after the pause."))
    s.generate(GREEDY)
    s.pause(expected_wait_s=1.0, decision="host")
    (kid,) = s.fork(1)
    assert kid.state is SessionState.IDLE and kid.history == s.history and s.state is SessionState.PAUSED
    ref = mgr.open(list(s.history))
    assert kid.generate(GREEDY).outputs[0].token_ids == ref.generate(GREEDY).outputs[0].token_ids
    busy = mgr.before_turn("running-turn", None)
    with pytest.raises(SessionBusy, match="turn in flight"):
        busy.fork(1)
    mgr.after_turn(busy, [], None)
    for x in (s, kid, ref, busy):
        x.close()


def test_session_misuse_is_a_clear_error(mgr):
    s = mgr.open(messages("hi"))
    with pytest.raises(ValueError, match="not paused"):
        s.resume(OBS)
    s.generate(SamplingParams(max_tokens=2, temperature=0))
    s.pause(decision="drop")
    with pytest.raises(ValueError, match="paused for a tool"):
        s.generate(GREEDY)
    with pytest.raises(ValueError, match="already paused"):
        s.pause()
    # A bad observation is refused before it joins the history: appended, it
    # failed every later turn and the session could not be used again.
    with pytest.raises(ValueError, match="100000000 is outside the vocabulary"):
        s.resume([10**8])
    with pytest.raises(ValueError, match="max_model_len"):
        s.resume([5] * mgr.engine.max_model_len)
    s.resume(OBS)
    assert s.generate(SamplingParams(max_tokens=2, temperature=0)).outputs[0].token_ids
    for bad in (-5, float("nan"), float("inf")):
        with pytest.raises(ValueError, match="expected_wait_s must be a finite number of seconds >= 0"):
            s.pause(expected_wait_s=bad)
    for n in (0, -1):
        with pytest.raises(ValueError, match="fork: n must be an integer >= 1"):
            s.fork(n)
    s.close()
    with pytest.raises(ValueError, match="closed"):
        s.generate(GREEDY)


def test_calibrate_measures_rates_and_leaves_no_trace(mgr):
    kv = mgr.engine.kv
    free, cached = kv.pool.num_free, kv.radix.num_cached_blocks
    before = mgr.policy.rates.prefill_tokens_per_s
    r = mgr.calibrate(prefill_tokens=128)
    assert r["host_bytes_per_s"] > 1e8 and r["disk_bytes_per_s"] > 1e6
    assert r["prefill_tokens_per_s"] > 10 and r["prefill_tokens_per_s"] != before
    assert kv.pool.num_free == free and kv.radix.num_cached_blocks == cached
    assert mgr.disk.nbytes == 0 and mgr.disk.num_blocks == 0
    assert not list(mgr.disk.dir.glob("*.kv")) and not list(mgr.disk.dir.glob("*.tmp"))


def test_calibration_is_plausible_on_every_start(mgr):
    """Five start-up measurements in a row (one cold copy of 32 blocks gave
    53-464 MB/s, under the disk rate at four of five): each is measured after
    a warm-up over at least 64 MiB (host) and 16 MiB (disk), the host copy
    within 10x of a memcpy beside it, and the disk never above the host."""
    from trajserve.engine.calibration import PLAUSIBLE

    for _ in range(5):
        r = mgr.calibrate(prefill_tokens=64)
        host, disk, ref = r["host_bytes_per_s"], r["disk_bytes_per_s"], r["memcpy_bytes_per_s"]
        assert host >= disk > 0, r
        assert ref / PLAUSIBLE <= host <= ref * PLAUSIBLE, r
        assert r["host_copy_bytes"] >= 64 << 20 and r["disk_bytes"] >= 16 << 20, r


def test_calibrate_prefills_within_a_short_context(tmp_path):
    """`serve --max-model-len 256` (or less): the start-up calibration's
    256-token prefill was over the context, so it failed and the keep
    policy ran on default rates."""
    eng = LLMEngine(EngineConfig(dtype="float32", max_model_len=128, cache=CacheConfig(num_blocks=64)))
    m = SessionManager(eng, SessionConfig(disk_dir=str(tmp_path)))
    try:
        assert m.calibrate()["prefill_tokens_per_s"] > 0
    finally:
        m.shutdown()
        eng.close()


def test_calibration_on_a_full_disk_tier_tries_no_round_trip(engine_f32, tmp_path):
    """A disk tier at its cap (a restart on a directory full of kept
    blocks): calibration measures the host copy and says the disk is full,
    instead of failing a round trip it has no room for."""
    import torch

    from trajserve.kv.tiers import BlockIdentity, digest

    engine_f32.kv.clear_cache()
    layout = engine_f32.block_layout
    m = SessionManager(engine_f32, SessionConfig(disk_dir=str(tmp_path / "kv"), disk_bytes=3 * layout.file_bytes))
    try:
        block = torch.zeros(layout.shape, dtype=layout.torch_dtype)
        ns = digest("earlier-run")
        assert all(m.disk.put(f"k{i}", block, BlockIdentity(ns, digest(f"b{i}"))) for i in range(3))
        assert m.disk.free_bytes < layout.file_bytes
        r = m.calibrate(prefill_tokens=64)
        assert any("disk tier is full" in n for n in r["notes"]) and not any("failed" in n for n in r["notes"])
        assert r["host_bytes_per_s"] > 1e8 and m.disk.num_blocks == 3
    finally:
        m.shutdown()


def test_a_host_tier_without_room_passes_the_state_to_disk(engine_f32, tmp_path):
    """Forced host on a manager with no host room: what was asked stays the
    decision, metrics()["placed"] says the state went to disk, and the next
    turn still comes out as a session that never paused."""
    engine_f32.kv.clear_cache()
    task = "Fix the failing test."
    ref = SessionManager(engine_f32, SessionConfig(disk_dir=str(tmp_path / "a")))
    _, ref_second, _ = two_turns(ref, task)
    ref.shutdown()
    engine_f32.kv.clear_cache()
    m = SessionManager(engine_f32, SessionConfig(host_bytes=0, disk_dir=str(tmp_path / "b")))
    try:
        _, second, (d, _, _) = two_turns(m, task, pause="host")
        assert d.decision is Decision.HOST
        met = m.metrics()
        assert met["keep_decisions"] == {"host": 1} and met["placed"] == {"disk": 1}
        assert second.outputs[0].token_ids == ref_second.outputs[0].token_ids
    finally:
        m.shutdown()
        engine_f32.kv.clear_cache()


def test_describe_lists_each_pause_its_decision_and_the_wait_seen(mgr):
    s = mgr.open(messages("List the pauses."))
    s.generate(GREEDY)
    s.pause(expected_wait_s=2.0, tool="run_tests", decision="host")
    (p,) = mgr.describe(s)["pauses"]
    assert (p["turn"], p["waiting_for"], p["expected_wait_s"], p["wait_source"], p["decision"]) == \
        (1, "run_tests", 2.0, "hint", "host")
    assert p["reason"] and p["waited_s"] is None  # not resumed yet
    s.resume(OBS)
    s.generate(GREEDY)
    s.pause(tool="grep", decision="keep")
    first, second = mgr.describe(s)["pauses"]
    assert first["waited_s"] is not None and first["waited_s"] >= 0
    assert (second["turn"], second["waiting_for"], second["decision"], second["waited_s"]) == (2, "grep", "keep", None)
    turns = mgr.describe(s)["turn_hits"]
    assert [t["output_tokens"] for t in turns] == [GREEDY.max_tokens] * 2
    s.close()
