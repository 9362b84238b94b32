"""The hierarchical prefix cache (kv/lower_tiers.py): blocks LRU evicts from
the device pool go to host memory, then disk, and load back on a hit.

Two levels:
  * the KV manager with a stand-in pool whose "KV" of a block is the token
    ids written into it: after any sequence of evictions and loads, every
    request's table must read back exactly its prompt (a wrong hash, a wrong
    order or a stale block would show up as wrong tokens);
  * the engine on the embedded model: a conversation whose blocks were
    pushed out of a small pool resumes from the host / disk tier with
    greedy output identical to an engine without the cache, and a corrupted
    disk block is detected and recomputed.
"""
from __future__ import annotations

import random

import pytest
import torch
from test_prefix_cache_engine import run

from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.kv.scope import CacheScope
from trajserve.kv.tiers import DISK_HEADER_BYTES, BlockLayout, namespace_digest

B = 4
LAYOUT = BlockLayout.of(b"token-pool", torch.long, (B,))


class TokenPool:
    """Stand-in KV pool: block b holds the B token ids last written into it."""

    def __init__(self, num_blocks: int) -> None:
        self.data = torch.full((num_blocks, B), -1, dtype=torch.long)

    def read(self, ids: list[int]) -> torch.Tensor:
        return self.data[ids].clone()

    def write(self, ids: list[int], blocks: torch.Tensor) -> None:
        self.data[ids] = blocks


def manager(num_blocks: int, host_blocks: int, disk_blocks: int = 0, tmp_path=None):
    pool = TokenPool(num_blocks)
    kv = KVCacheManager(num_blocks, B, watermark=0.0, enable_prefix_caching=True)
    nbytes = B * 8  # one block of the stand-in: B int64 tokens
    disk_file = nbytes + DISK_HEADER_BYTES  # + the disk header (identity, checksum)
    lower = LowerTiers(pool.read, pool.write, host_blocks * nbytes, disk_blocks * disk_file,
                       str(tmp_path) if tmp_path is not None and disk_blocks else None, layout=LAYOUT)
    kv.attach_lower_tiers(lower)
    return kv, pool, lower


def run_request(kv: KVCacheManager, pool: TokenPool, rid: str, tokens: list[int], salt=None) -> int:
    scope = CacheScope(salt)
    """Admit, 'compute' (write the tokens into their blocks), cache and
    release; returns the tokens matched. Checks the matched blocks first."""
    hit = kv.match(rid, tokens, scope)
    matched = hit.num_tokens if hit else 0
    if hit:
        got = pool.data[hit.block_ids].flatten().tolist()
        assert got == tokens[:matched], f"{rid}: a matched block holds other tokens"
    assert kv.allocate_slots(rid, len(tokens), hit)
    ids = kv.table(rid).block_ids
    for i, b in enumerate(ids):
        chunk = tokens[i * B:(i + 1) * B]
        if len(chunk) == B and i * B >= matched:
            pool.data[b] = torch.tensor(chunk)
    kv.release(rid, tokens, len(tokens), scope)
    return matched


def test_evicted_blocks_come_back_from_host_with_their_tokens():
    kv, pool, lower = manager(num_blocks=12, host_blocks=64)
    a = list(range(100, 140))       # 10 blocks
    assert run_request(kv, pool, "a1", a) == 0
    b = list(range(500, 540))       # pushes most of a out of the 12-block pool
    run_request(kv, pool, "b", b)
    assert kv.radix.num_spilled_blocks > 0 and lower.num_host_blocks > 0
    # a again, one token longer: its 10 full blocks match (9 from the host, all but the last token's block)
    matched = run_request(kv, pool, "a2", a + [7])
    assert matched == 40
    assert kv.num_promoted_blocks > 0 and lower.stats.loaded_host_blocks == kv.num_promoted_blocks
    # Exclusive tiers: what came back left the host.
    assert lower.num_host_blocks + kv.radix.num_cached_blocks <= 20


def test_host_overflow_demotes_to_disk_then_drops_oldest(tmp_path):
    kv, pool, lower = manager(num_blocks=6, host_blocks=4, disk_blocks=4, tmp_path=tmp_path)
    seqs = [list(range(1000 * k, 1000 * k + 16)) for k in range(1, 6)]  # 4 blocks each
    for k, s in enumerate(seqs):
        run_request(kv, pool, f"s{k}", s)
    st = lower.stats
    assert st.demoted_blocks > 0 and st.dropped_blocks > 0
    assert lower.num_host_blocks <= 4 and lower.num_disk_blocks <= 4
    # The newest evicted sequence is whole on the lower tiers; the oldest fell off.
    assert run_request(kv, pool, "again3", seqs[3] + [1]) == 16
    assert run_request(kv, pool, "again0", seqs[0] + [1]) == 0


def test_corrupt_disk_block_stops_the_match_there(tmp_path):
    kv, pool, lower = manager(num_blocks=6, host_blocks=0, disk_blocks=16, tmp_path=tmp_path)
    a = list(range(100, 116))
    run_request(kv, pool, "a", a)
    run_request(kv, pool, "b", list(range(200, 216)))
    run_request(kv, pool, "c", list(range(300, 316)))
    assert lower.num_disk_blocks > 0
    lower.flush()  # disk writes run on the tier's writer thread
    # Flip one byte of a's third block on disk (hash chain: block 2 of a).
    h = kv.radix.path_hash(kv.radix.match_blocks(kv.namespace(CacheScope()), []).last_node)
    from trajserve.kv.radix_cache import chain_hash
    keys = kv.radix.block_keys(a)
    hashes = []
    for k in keys:
        h = chain_hash(h, k)
        hashes.append(h)
    path = lower.disk.path(hashes[2].hex())
    raw = bytearray(path.read_bytes())
    raw[-1] ^= 0xFF
    path.write_bytes(bytes(raw))
    matched = run_request(kv, pool, "a2", a + [1])
    assert lower.stats.corrupt_blocks == 1
    # a was wholly on disk: blocks 0 and 1 load, block 2 fails its check, the rest is recomputed.
    assert matched == 8
    assert not lower.contains(hashes[2])


def test_disk_writes_run_in_the_background_and_queued_blocks_are_served_from_memory(tmp_path):
    """A host -> disk demotion returns at once; the block waits in memory for
    the writer thread and a match that wants it meanwhile gets it from there."""
    import threading

    kv, pool, lower = manager(num_blocks=6, host_blocks=1, disk_blocks=16, tmp_path=tmp_path)
    gate = threading.Event()
    write_file = lower.disk.write_file

    def slow_write(*args):  # a disk that takes its time
        gate.wait(timeout=30)
        write_file(*args)

    lower.disk.write_file = slow_write
    a = list(range(100, 116))
    run_request(kv, pool, "a", a)
    run_request(kv, pool, "b", list(range(200, 216)))  # a's blocks: device -> host -> disk (queued)
    assert lower.num_pending_writes > 0 and lower.stats.demoted_blocks > 0
    assert not list(tmp_path.glob("*.kv"))  # nothing written yet, and nobody waited for it
    assert run_request(kv, pool, "a2", a + [1]) == 16  # served from the queue, tokens checked
    assert lower.stats.loaded_disk_blocks > 0
    gate.set()
    lower.flush()
    assert lower.num_pending_writes == 0
    assert len(list(tmp_path.glob("*.kv"))) == lower.num_disk_blocks > 0
    lower.close()


def test_invalidate_and_tenants_never_reach_the_lower_tiers():
    kv, pool, lower = manager(num_blocks=8, host_blocks=64)
    a = list(range(100, 124))
    run_request(kv, pool, "a", a, salt="t1")
    run_request(kv, pool, "b", list(range(500, 532)), salt="t1")
    assert lower.num_host_blocks > 0
    # Another tenant with the same tokens: nothing from t1's tiers.
    assert run_request(kv, pool, "a-t2", a + [1], salt="t2") == 0
    kv.invalidate(None, CacheScope("t1"))
    t1 = namespace_digest(kv.namespace(CacheScope("t1")))
    assert lower.num_host_blocks == 0 or all(lower._ns[k] != t1 for k in lower._ns)
    assert run_request(kv, pool, "a-again", a + [1], salt="t1") == 0


def test_random_workload_reads_back_exact_tokens(tmp_path):
    """Random prompts sharing random prefixes through a pool far smaller than
    the working set: every match (device or loaded) holds exactly the prompt's tokens."""
    rng = random.Random(0)
    kv, pool, lower = manager(num_blocks=24, host_blocks=40, disk_blocks=40, tmp_path=tmp_path)
    roots = [[rng.randrange(1, 10_000) for _ in range(rng.randrange(4, 40))] for _ in range(6)]
    hits = 0
    for i in range(300):
        base = rng.choice(roots)
        cut = rng.randrange(0, len(base) + 1)
        prompt = base[:cut] + [rng.randrange(1, 10_000) for _ in range(rng.randrange(1, 30))]
        if rng.random() < 0.3:
            roots.append(prompt)
        hits += run_request(kv, pool, f"r{i}", prompt) > 0
        kv.pool.check()
    assert hits > 50 and kv.num_promoted_blocks > 0 and lower.stats.loaded_disk_blocks > 0
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks and lower.num_host_blocks == 0 and lower.num_disk_blocks == 0


# ----------------------------------------------------------------- engine

SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), run_tests(). "
          "Always explain the plan before calling a tool. ") * 3


@pytest.fixture(scope="module")
def reference():
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256, enable_prefix_caching=False)))


@pytest.mark.parametrize("tier", ["host", "disk"])
def test_engine_resumes_a_conversation_from_a_lower_tier_with_identical_output(reference, tier, tmp_path):
    cache = CacheConfig(num_blocks=24, watermark=0.0, host_cache_bytes=64 * 2**20 if tier == "host" else 0,
                        disk_cache_bytes=64 * 2**20 if tier == "disk" else 0, disk_cache_dir=str(tmp_path))
    eng = LLMEngine(EngineConfig(dtype="float32", cache=cache))
    tok = eng.tokenizer
    turn1 = tok.encode(SYSTEM + " Task: list the files.")
    first = run(eng, turn1)
    history = turn1 + list(first.outputs[0].token_ids)
    # Other traffic fills the 24-block pool: turn 1's blocks leave the device.
    for k in range(3):
        run(eng, tok.encode(f"Unrelated request number {k}: " + "summarize the weather report. " * 30))
    assert eng.kv.cached_prefix(history, CacheScope()).num_tokens < 64
    turn2 = history + tok.encode(" Now open main.py.")
    out = run(eng, turn2)
    ref = run(reference, turn2)
    assert out.outputs[0].token_ids == ref.outputs[0].token_ids
    m = eng.metrics()
    assert m["promoted_blocks"] > 0 and m["spilled_blocks"] > 0
    assert out.num_cached_tokens >= (len(history) - 1) // 16 * 16 - 16
    low = m["lower_tiers"]
    assert (low["loaded_host_blocks"] if tier == "host" else low["loaded_disk_blocks"]) > 0

    if tier == "disk":
        for k in range(3, 6):
            run(eng, tok.encode(f"Unrelated request number {k}: " + "summarize the weather report. " * 30))
        # Flip one bit in every block now on disk: the resume detects it at the
        # first block it needs from disk and recomputes from there; same tokens.
        eng.lower.flush()
        files = list(tmp_path.glob("*.kv"))
        assert files
        for f in files:
            raw = bytearray(f.read_bytes())
            raw[40] ^= 0x01
            f.write_bytes(bytes(raw))
        turn3 = turn2 + list(out.outputs[0].token_ids) + tok.encode(" Then run the tests.")
        out3 = run(eng, turn3)
        assert out3.outputs[0].token_ids == run(reference, turn3).outputs[0].token_ids
        assert eng.metrics()["lower_tiers"]["corrupt_blocks"] >= 1
    eng.kv.clear_cache()
    assert eng.kv.pool.num_free == eng.kv.num_blocks


@pytest.mark.parametrize("files", [True, False])
def test_clear_empties_both_tiers_and_they_work_after(tmp_path, files):
    """clear() drops everything at once (files included); the counts and byte
    totals go to zero, and a later spill / load round works as before."""
    if files:
        kv, pool, lower = manager(num_blocks=6, host_blocks=2, disk_blocks=16, tmp_path=tmp_path)
    else:  # the simulator's tiers: one-byte stand-in blocks, caps in blocks
        kv, pool, _ = manager(num_blocks=6, host_blocks=0)
        lower = LowerTiers.stand_in(host_blocks=2, disk_blocks=16)
        kv.attach_lower_tiers(lower)

    def fill(base):
        for i in range(4):
            run_request(kv, pool, f"r{base}-{i}", list(range(base + 100 * i, base + 100 * i + 16)))
        lower.flush()

    fill(1000)
    held = lower.num_host_blocks + lower.num_disk_blocks
    assert lower.num_host_blocks == 2 and lower.num_disk_blocks > 0
    lower.clear()
    assert lower.num_host_blocks == lower.num_disk_blocks == 0
    assert lower.metrics()["host_bytes"] == lower.metrics()["disk_bytes"] == 0
    assert lower.stats.discarded_blocks == held
    assert not list(tmp_path.glob("*.kv"))
    fill(5000)
    assert lower.num_host_blocks == 2 and lower.num_disk_blocks > 0
    if files:  # an evicted prompt comes back from the tiers with its tokens (run_request checks them)
        assert run_request(kv, pool, "again", list(range(5000, 5016)) + [1]) == 16
    lower.close()
