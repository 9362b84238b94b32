"""The copy engine (kv/copy_engine.py): saves and loads run beside the
compute, a forward waits for a reload one layer at a time, and a step that
does not read the blocks being loaded does not wait at all."""
import threading
import time

import pytest
import torch

from trajserve.kv.copy_engine import CopyEngine, CopyJob
from trajserve.sampling import SamplingParams

from test_sessions import GREEDY, OBS, messages, mgr  # noqa: F401 -- mgr is a fixture


def pools(layers=3, blocks=8):
    g = torch.Generator().manual_seed(0)
    return [(torch.randn(blocks, 2, 4, 8, generator=g), torch.randn(blocks, 2, 4, 8, generator=g))
            for _ in range(layers)]


def test_save_then_load_round_trips_exactly():
    src, dst = pools(), [(torch.zeros(8, 2, 4, 8), torch.zeros(8, 2, 4, 8)) for _ in range(3)]
    a, b = CopyEngine(src), CopyEngine(dst)
    job = a.save([5, 1, 6])
    a.finish(job)
    assert job.data.shape == (3, 3, 2, 2, 4, 8) and job.nbytes == job.data.numel() * 4
    load = b.load([0, 2, 3], job.data)
    assert b.loading[2] is load
    b.finish(load)
    assert not b.loading and load.filled == 3
    for (k, v), (k2, v2) in zip(src, dst):
        assert torch.equal(k2[[0, 2, 3]], k[[5, 1, 6]]) and torch.equal(v2[[0, 2, 3]], v[[5, 1, 6]])
        assert not k2[[1, 4, 5, 6, 7]].any()  # nothing else was written
    a.shutdown(), b.shutdown()


def test_layer_barrier_waits_for_that_layer_only():
    job = CopyJob("load", [0], num_layers=3)
    eng = CopyEngine(pools())
    barrier = eng.layer_barrier([job])
    reached = []

    def forward():
        for layer in range(3):
            barrier(layer)
            reached.append(layer)

    t = threading.Thread(target=forward)
    t.start()
    time.sleep(0.05)
    assert reached == []  # layer 0 not copied yet
    job._advance(1)
    time.sleep(0.05)
    assert reached == [0]  # layer 0 ran while layers 1 and 2 are still copying
    job._advance(3)
    t.join(5)
    assert reached == [0, 1, 2] and eng.wait_s > 0.04
    eng.shutdown()


def test_a_failed_copy_is_an_error_at_the_waiter():
    eng = CopyEngine(pools())

    def broken():
        raise OSError("disk gone")
    job = eng.load([1, 2], broken)
    with pytest.raises(RuntimeError, match="KV load of 2 blocks failed"):
        eng.finish(job)
    assert not eng.loading
    eng.shutdown()


def test_a_step_is_not_blocked_by_a_load_it_does_not_read(engine_f32):
    """A reload stuck in the background (its source not ready) does not hold
    back an unrelated request: it runs to completion meanwhile."""
    eng, kv = engine_f32, engine_f32.kv
    kv.clear_cache()
    blocks = kv.pool.allocate(4)
    gate = threading.Event()
    data = eng.runner.read_blocks(blocks)

    def slow_source():
        gate.wait(30)
        return data
    job = eng.runner.copy.load(blocks, slow_source)
    rid = eng.add_request("The capital of France is", SamplingParams(max_tokens=8, temperature=0))
    done = None
    while done is None:
        done = next((o for o in eng.step() if o.request_id == rid and o.finished), None)
    assert not job.done and len(done.outputs[0].token_ids) == 8
    gate.set()
    eng.runner.copy.finish(job)
    assert job.done and not eng.runner.copy.loading
    kv.pool.free(blocks)


def delayed(load, seconds):
    """CopyEngine.load whose source is ready only after `seconds` (a slow link)."""
    def slow_load(block_ids, data):
        def late():
            time.sleep(seconds)
            return data
        return load(block_ids, late)
    return slow_load


def turns(mgr, task, between):
    s = mgr.open(messages(task))
    s.generate(GREEDY)
    between(s)
    out = s.generate(GREEDY)
    s.close()
    return out


def test_reload_streams_under_the_resumed_prefill_with_identical_tokens(mgr, monkeypatch):
    """The resumed turn's prefill reads blocks whose KV is still being copied:
    a slow copy (0.3 s before the first layer) makes the forward wait per
    layer, the wait is counted as a stall, and the tokens do not change."""
    task = "Which test failed?"
    ref = turns(mgr, task, lambda s: s.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False)))
    mgr.engine.kv.clear_cache()
    copy = mgr.engine.runner.copy
    real_load, slow_load = copy.load, delayed(copy.load, 0.3)

    cached = []

    def pause_host_resume(s):
        cached.append(mgr.engine.kv.cached_prefix(s.history, s.scope).num_tokens)
        s.pause(decision="host")
        mgr.flush()
        assert s.table.counts()["host"] == s.saved_blocks > 0 and s.pin is None
        monkeypatch.setattr(copy, "load", slow_load)
        s.resume(OBS)
        assert s.copy is not None and s.table.counts()["device"] == len(s.table)  # remapped, still streaming
        monkeypatch.setattr(copy, "load", real_load)

    out = turns(mgr, task, pause_host_resume)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    st = mgr.stats
    assert st.resume_stalls == 1 and st.resume_stall_s >= 0.2  # the forward waited for the copy
    assert st.swap_in_bytes > 0 and out.num_cached_tokens >= cached[0] > 0  # all of it came back


def test_resume_before_the_save_lands_keeps_the_state_on_the_device(mgr):
    """Back before its host copy finished: the copy is thrown away, nothing
    is reloaded, the frames never left, and the tokens are the same."""
    task = "List the changed files."
    ref = turns(mgr, task, lambda s: s.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False)))
    mgr.engine.kv.clear_cache()

    def quick(s):
        s.pause(decision="host")
        assert s.copy is not None and s.copy.kind == "save" and s.hold is not None
        s.resume(OBS)
        assert s.copy is None and s.hold is None and s.table is None
    out = turns(mgr, task, quick)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert mgr.stats.swap_in_bytes == 0 and mgr.host.nbytes == 0 and mgr.offload.tiers.held_bytes()["host"] == 0
    assert mgr.offload.tiers.hold_free_bytes("host") == mgr.host.byte_cap  # nothing reserved
    assert out.num_cached_tokens >= ref.num_cached_tokens


def test_prefetch_loads_in_the_background_and_the_resume_hits(mgr):
    task = "Open the failing test file."
    ref = turns(mgr, task, lambda s: s.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False)))
    mgr.engine.kv.clear_cache()

    def prefetched(s):
        s.pause(decision="disk", expected_wait_s=60)
        mgr.flush()
        assert s.table.counts()["disk"] > 0
        mgr.machine.set_prefetch(s.record, time.monotonic())  # the return is near
        mgr.tick()
        assert s.copy is not None and s.copy.kind == "load" and s.importing is not None
        mgr.flush()  # lands: the blocks join the tree and are held there
        assert s.prefetched and s.pin is not None and s.table is None and mgr.disk.num_blocks == 0
        s.resume(OBS)
    out = turns(mgr, task, prefetched)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert mgr.stats.prefetches == 1 and mgr.stats.prefetch_hits == 1 and mgr.stats.resume_stalls == 0


def test_a_failed_prefetch_falls_back_to_recompute(mgr, monkeypatch):
    """A prefetch whose copy fails adopts nothing and leaks nothing: the
    resumed turn recomputes, with the same tokens."""
    task = "Show the diff."
    ref = turns(mgr, task, lambda s: s.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False)))
    mgr.engine.kv.clear_cache()
    copy = mgr.engine.runner.copy
    real_load = copy.load

    def broken_load(block_ids, data):
        def fail():
            raise MemoryError("no room for the staging buffer")
        return real_load(block_ids, fail)

    def failed_prefetch(s):
        s.pause(decision="host", expected_wait_s=60)
        mgr.flush()
        monkeypatch.setattr(copy, "load", broken_load)
        mgr.machine.set_prefetch(s.record, time.monotonic())
        mgr.tick()
        monkeypatch.setattr(copy, "load", real_load)
        mgr.flush()
        assert s.tier.value == "drop" and not s.prefetched and s.table is None and mgr.host.nbytes == 0
        s.resume(OBS)
    out = turns(mgr, task, failed_prefetch)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    assert mgr.stats.prefetches == 0 and mgr.stats.recomputed_tokens > 0


def test_paused_again_before_the_reload_landed_leaks_nothing(mgr, monkeypatch):
    """Resume (the reload still streaming), then pause at once: the reload
    lands first, its pin is released, and the new pause proceeds; the
    fixture checks every block is free at the end."""
    copy = mgr.engine.runner.copy
    slow_load = delayed(copy.load, 0.2)

    s = mgr.open(messages("Rerun the tests."))
    s.generate(GREEDY)
    s.pause(decision="host")
    mgr.flush()
    monkeypatch.setattr(copy, "load", slow_load)
    s.resume(OBS)
    assert s.copy is not None and s.copy.kind == "load"
    s.pause(decision="drop")
    assert s.copy is None and s.hold is None and not copy.loading
    s.resume(OBS)
    s.close()


def test_a_prefetch_without_room_leaves_the_state_on_its_tier_for_the_resume(mgr, monkeypatch):
    """The pool has no room when the prefetch is due: the saved blocks stay on
    the host tier (nothing released), and the resume loads them and hits."""
    task = "List the changed files."
    ref = turns(mgr, task, lambda s: s.history.extend(mgr.engine.tokenizer.encode(OBS, add_special_tokens=False)))
    mgr.engine.kv.clear_cache()
    kv = mgr.engine.kv

    def no_room_then_resume(s):
        s.pause(decision="host", expected_wait_s=60)
        mgr.flush()
        saved = s.saved_blocks
        assert saved > 0
        monkeypatch.setattr(kv, "begin_import", lambda *a, **k: None)
        mgr.machine.set_prefetch(s.record, time.monotonic())
        mgr.tick()
        monkeypatch.undo()
        assert not s.prefetched and s.copy is None and s.saved_blocks == saved and mgr.host.nbytes > 0
        assert s.residency.value == "offloaded" and mgr.stats.reload_no_room == 1
        s.resume(OBS)
    out = turns(mgr, task, no_room_then_resume)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    # Every full block came back: only the history's partial last block is recomputed.
    assert mgr.stats.resume_stalls == 1 and mgr.stats.recomputed_tokens < kv.block_size and mgr.host.nbytes == 0
