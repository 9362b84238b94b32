"""Disk blocks carry their identity, and a --kv-disk-dir survives restarts.

A block file names its block: a valid file moved to another name is
refused (counted as mislabelled), as are files of another model or layout;
files of earlier runs are adopted or removed, never left; a killed
server's scratch directory is swept by the next one.
"""
from __future__ import annotations

import fcntl
import os
import struct

import pytest
import torch
from test_lower_tiers import LAYOUT, TokenPool, manager, run_request
from test_prefix_cache_engine import run

from trajserve.config import CacheConfig, EngineConfig
from trajserve.engine.engine import LLMEngine
from trajserve.kv import tiers as fmt
from trajserve.kv.dir_lock import LOCK_NAME, DirInUse, DirLock, ScratchDir, sweep_orphans
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.kv.scope import CacheScope
from trajserve.kv.tiers import BlockIdentity, BlockLayout, BlockRejected, DiskKVStore

B = 4


# ------------------------------------------------------------ the format

def _ident(i: int, ns: bytes = b"n" * 16) -> BlockIdentity:
    return BlockIdentity(ns, fmt.digest(f"block {i}"))


def test_a_block_reads_back_only_as_itself(tmp_path):
    store = DiskKVStore(tmp_path, 1 << 20, LAYOUT)
    block = torch.arange(B, dtype=torch.long)
    assert store.put("k", block, _ident(1))
    assert torch.equal(store.get("k", _ident(1)), block)
    # The same file asked for as another block, or under another namespace: rejected and removed.
    assert store.get("k", _ident(2)) is None and store.num_mislabelled == 1
    assert not store.path("k").exists() and store.num_blocks == 0
    assert store.put("k", block, _ident(1))
    assert store.get("k", BlockIdentity(b"m" * 16, _ident(1).block_hash)) is None and store.num_mislabelled == 2


@pytest.mark.parametrize("damage", ["payload bit", "header bit", "checksum bit", "truncated", "empty", "magic"])
def test_damage_anywhere_is_corrupt_not_served(tmp_path, damage):
    store = DiskKVStore(tmp_path, 1 << 20, LAYOUT)
    store.put("k", torch.arange(B, dtype=torch.long), _ident(1))
    path = store.path("k")
    raw = bytearray(path.read_bytes())
    if damage == "payload bit":
        raw[-3] ^= 0x10
    elif damage == "header bit":
        raw[20] ^= 0x01  # inside the model fingerprint: the checksum covers the header
    elif damage == "checksum bit":
        raw[fmt.HEADER_BYTES - 1] ^= 0x80
    elif damage == "truncated":
        raw = raw[:-5]
    elif damage == "empty":
        raw = bytearray()
    else:
        raw[0:8] = b"TSKV1\0\0\0"
    path.write_bytes(bytes(raw))
    assert store.get("k", _ident(1)) is None
    assert store.num_corrupt == 1 and store.num_mislabelled == 0 and not path.exists()


def test_a_block_of_another_model_or_layout_is_mislabelled(tmp_path):
    block = torch.arange(B, dtype=torch.long)
    ident = _ident(1)
    for other in (BlockLayout.of(b"another model", torch.long, (B,)),
                  BlockLayout.of(b"token-pool", torch.long, (2, B // 2))):
        data = fmt.encode(other, ident, fmt.to_bytes(block)) + fmt.to_bytes(block)
        with pytest.raises(BlockRejected) as e:
            fmt.decode(data, LAYOUT, ident)
        assert e.value.kind == "mislabelled"
    good = fmt.encode(LAYOUT, ident, fmt.to_bytes(block)) + fmt.to_bytes(block)
    assert torch.equal(fmt.decode(good, LAYOUT, ident), block)
    # q8_0 rows written before their groups were rotated (named "q8_0") are sound blocks of another layout.
    rows = torch.zeros(2, 4, 68, dtype=torch.uint8)
    plain, rotated = (BlockLayout.of(b"m", name, (2, 4, 68)) for name in ("q8_0", "q8_0+h32"))
    data = fmt.encode(plain, ident, fmt.to_bytes(rows)) + fmt.to_bytes(rows)
    with pytest.raises(BlockRejected) as e:
        fmt.decode(data, rotated, ident)
    assert e.value.kind == "mislabelled"
    # The header says what it is: a version this engine does not write is refused by name.
    old = bytearray(good)
    struct.pack_into("<H", old, 8, fmt.VERSION + 1)
    with pytest.raises(BlockRejected, match="version"):
        fmt.read_header(bytes(old))


def test_a_window_models_block_reads_back_with_or_without_its_window_part(tmp_path):
    """A window model's store takes two shapes: the global layers, and those
    followed by the window layers. Each file says which; a store of the
    global layout alone refuses the longer one as another layout, and a
    restart keeps both kinds."""
    short, long_ = (BlockLayout.of(b"window model", torch.float32, (n, 2, 1, B, 2)) for n in (1, 3))
    store = DiskKVStore(tmp_path, 1 << 20, short, window_layout=long_)
    g, w = torch.randn(1, 2, 1, B, 2), torch.randn(3, 2, 1, B, 2)
    assert store.put("g", g, _ident(1)) and store.put("w", w, _ident(2))
    assert torch.equal(store.get("g", _ident(1)), g) and torch.equal(store.get("w", _ident(2)), w)
    with pytest.raises(ValueError, match="does not fit the store's layouts"):
        store.put("x", torch.randn(2, 2, 1, B, 2), _ident(3))
    assert sorted(k for k, *_ in DiskKVStore(tmp_path, 1 << 20, short, lock=False, window_layout=long_)
                  .scan(lambda i: {_ident(1): "g", _ident(2): "w"}[i])) == ["g", "w"]
    plain = DiskKVStore(tmp_path / "plain", 1 << 20, short)
    plain.register("w", _ident(2), long_.file_bytes)
    plain.path("w").write_bytes(store.path("w").read_bytes())
    assert plain.get("w", _ident(2)) is None and plain.num_mislabelled == 1


def test_file_names_are_digests_never_the_key(tmp_path):
    store = DiskKVStore(tmp_path / "store", 1 << 20, LAYOUT)
    for key in ("../../etc", "a/b", "x" * 10_000, "nul\0id"):
        assert store.put(key, torch.zeros(B, dtype=torch.long), _ident(0))
        assert store.path(key).parent == store.dir and len(store.path(key).name) == 35
    assert {p.parent for p in tmp_path.rglob("*.kv")} == {store.dir}


# -------------------------------------------------------- lower tiers

def _hashes(kv, tokens, salt=None):
    return kv.prefix_hashes(tokens, CacheScope(salt), len(tokens) // B)


def test_rotated_files_are_rejected_counted_and_recomputed(tmp_path):
    """Valid files swapped between names (two engines sharing a directory,
    a restore from backup): each match checks the identity, stops at the
    first mislabelled block and recomputes; the tokens read back (checked by
    run_request) are always the prompt's own."""
    kv, pool, lower = manager(num_blocks=6, host_blocks=0, disk_blocks=64, tmp_path=tmp_path)
    seqs = [list(range(100 * k, 100 * k + 16)) for k in range(1, 5)]
    for k, s in enumerate(seqs):
        run_request(kv, pool, f"s{k}", s)
    lower.flush()
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) >= 8
    blobs = [f.read_bytes() for f in files]
    for f, blob in zip(files, blobs[1:] + blobs[:1]):  # every file now holds its neighbour's block
        f.write_bytes(blob)
    for k, s in enumerate(seqs):
        run_request(kv, pool, f"again{k}", s + [1])  # asserts the matched blocks hold s's tokens
    # Each sequence's first block on disk was rotated: each of the four matches was refused there.
    assert lower.stats.mislabelled_blocks >= 3 and lower.stats.corrupt_blocks == lower.stats.mislabelled_blocks


def test_a_failed_disk_write_is_logged_counted_and_recomputed(tmp_path, caplog):
    kv, pool, lower = manager(num_blocks=6, host_blocks=0, disk_blocks=64, tmp_path=tmp_path)

    def full(*args):
        raise OSError(28, "No space left on device")
    lower.disk.write_file = full
    a = list(range(100, 116))
    run_request(kv, pool, "a", a)
    run_request(kv, pool, "b", list(range(200, 216)))
    lower.flush()
    assert lower.stats.write_errors > 0 and "No space left" in caplog.text
    assert lower.metrics()["write_errors"] == lower.stats.write_errors
    assert run_request(kv, pool, "a2", a + [1]) <= 8  # what never reached disk is recomputed
    kv.pool.check()


def _tiers(tmp_path, cap_blocks=64, layout=LAYOUT):
    pool = TokenPool(32)
    return pool, LowerTiers(pool.read, pool.write, 0, cap_blocks * layout.file_bytes, str(tmp_path), layout=layout)


def test_a_disk_dir_is_restored_newest_first_within_the_cap(tmp_path):
    """A new tier on a directory adopts the blocks of its model and layout
    (newest first, up to its cap) and removes temporary, foreign, misnamed
    and truncated files; the directory never holds more than the cap."""
    pool, lower = _tiers(tmp_path)
    ns = fmt.namespace_digest(("m", None))
    hashes = [fmt.digest(f"h{i}") for i in range(10)]
    for i, h in enumerate(hashes):
        pool.data[i] = torch.arange(B) + 10 * i
        lower.persist([(("m", None), [h], [i])])
        os.utime(lower.disk.path(h.hex()), (1000 + i, 1000 + i))  # block i written at time 1000 + i
    lower.close()
    (tmp_path / "half-written.tmp").write_bytes(b"x" * 7)
    (tmp_path / "notes.txt").write_text("not a block")
    foreign = BlockLayout.of(b"another model", torch.long, (B,))
    other = DiskKVStore(tmp_path / "other", 1 << 20, foreign)
    other.put("f", torch.zeros(B, dtype=torch.long), BlockIdentity(ns, fmt.digest("f")))
    os.replace(other.path("f"), tmp_path / other.path("f").name)
    misnamed = lower.disk.path(hashes[9].hex())
    os.replace(misnamed, tmp_path / ("0" * 32 + ".kv"))
    truncated = lower.disk.path(hashes[8].hex())
    truncated.write_bytes(truncated.read_bytes()[:-1])

    pool2, again = _tiers(tmp_path, cap_blocks=5)
    assert again.stats.restored_blocks == 5  # blocks 3-7: the newest sound ones
    names = sorted(p.name for p in tmp_path.iterdir() if p.is_file() and not p.name.startswith(LOCK_NAME))
    assert names == sorted(again.disk.path(h.hex()).name for h in hashes[3:8])
    assert sum(p.stat().st_size for p in tmp_path.glob("*.kv")) <= 5 * LAYOUT.file_bytes
    assert again.stats.mislabelled_blocks == 1 and again.stats.corrupt_blocks == 2
    # A restored block loads back as itself; one the cap dropped is gone.
    assert again.load(("m", None), [hashes[7]], [20]) == [False] and torch.equal(pool2.data[20], torch.arange(B) + 70)
    assert again.load(("m", None), [hashes[2]], [21]) == []
    assert again.load(("other", None), [hashes[6]], [21]) == []  # another namespace: not its block
    again.close()


def test_two_engines_cannot_share_a_disk_dir(tmp_path):
    _, lower = _tiers(tmp_path)
    with pytest.raises(DirInUse, match="in use by another trajserve engine .*pid %d" % os.getpid()):
        _tiers(tmp_path)
    lower.close()
    _, again = _tiers(tmp_path)  # released at close
    again.close()


def test_scratch_dirs_of_owners_that_are_gone_are_swept(tmp_path):
    live = ScratchDir("session", parent=tmp_path)
    dead = tmp_path / "trajserve-kv-session-dead"
    dead.mkdir()
    (dead / LOCK_NAME).write_text("12345\n")  # a lock nobody holds: its owner was killed
    (dead / "x.kv").write_bytes(b"1")
    legacy = tmp_path / "trajserve-kv-legacy"  # no lock file: may be being created, left alone
    legacy.mkdir()
    held = tmp_path / "trajserve-kv-cache-held"
    held.mkdir()
    lock = DirLock(held)
    assert sweep_orphans(tmp_path) == 1
    assert not dead.exists() and legacy.exists() and held.exists() and os.path.isdir(live.name)
    lock.release()
    fd = os.open(held / LOCK_NAME, os.O_RDWR)  # now anyone can take it
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    os.close(fd)
    ScratchDir("cache", parent=tmp_path).cleanup()  # a new one sweeps first
    assert not held.exists() and os.path.isdir(live.name)
    live.cleanup()
    assert not os.path.exists(live.name)


# ---------------------------------------------------------------- engine

SYSTEM = ("You are a coding agent. Tools: read_file(path), write_file(path, text), run_tests(). "
          "Always explain the plan before calling a tool. ") * 3


def _engine(disk_dir, num_blocks=24, host=0, disk=64 << 20):
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(
        num_blocks=num_blocks, watermark=0.0, host_cache_bytes=host, disk_cache_bytes=disk,
        disk_cache_dir=str(disk_dir))))


@pytest.fixture(scope="module")
def reference():
    return LLMEngine(EngineConfig(dtype="float32", cache=CacheConfig(num_blocks=256, enable_prefix_caching=False)))


def test_rotated_disk_files_give_identical_greedy_output(reference, tmp_path):
    """The probe's case on the real model: 16 prompts over a shared system
    prompt through a pool far smaller than them, then every disk file
    rotated to another's name. The second pass gives the same greedy tokens
    as an engine without any cache, and the rejections are counted."""
    eng = _engine(tmp_path, num_blocks=12)
    tok = eng.tokenizer
    prompts = [tok.encode(SYSTEM + f" Task {k}: explain step {k} of the build in one line.") for k in range(16)]
    want = [run(reference, p).outputs[0].token_ids for p in prompts]
    assert [run(eng, p).outputs[0].token_ids for p in prompts] == want
    eng.lower.flush()
    files = sorted(tmp_path.glob("*.kv"))
    assert len(files) >= 8
    blobs = [f.read_bytes() for f in files]
    for f, blob in zip(files, blobs[1:] + blobs[:1]):
        f.write_bytes(blob)
    eng.kv.radix.clear()  # the device copies go: every hit must come through the disk tier
    assert [run(eng, p).outputs[0].token_ids for p in prompts] == want
    low = eng.metrics()["lower_tiers"]
    assert low["mislabelled_blocks"] >= 1 and low["corrupt_blocks"] >= low["mislabelled_blocks"]
    eng.close()


def test_a_conversation_hits_from_disk_after_a_restart(reference, tmp_path):
    """Computed, then the engine closed cleanly: close() writes the device
    tree down to the --kv-disk-dir; a new engine on it adopts those blocks
    and the next turn hits them, with the greedy output of no cache at all."""
    eng = _engine(tmp_path, num_blocks=256)
    tok = eng.tokenizer
    turn1 = tok.encode(SYSTEM + " Task: list the files.")
    first = run(eng, turn1)
    assert not list(tmp_path.glob("*.kv"))  # a roomy pool spilled nothing yet
    eng.close()
    files = list(tmp_path.glob("*.kv"))
    assert len(files) >= len(turn1) // 16
    again = _engine(tmp_path, num_blocks=256)
    assert again.metrics()["lower_tiers"]["restored_blocks"] == len(files)
    turn2 = turn1 + list(first.outputs[0].token_ids) + tok.encode(" Now open main.py.")
    out = run(again, turn2)
    assert out.outputs[0].token_ids == run(reference, turn2).outputs[0].token_ids
    assert out.num_cached_tokens >= len(turn1) // 16 * 16 - 16
    assert again.metrics()["lower_tiers"]["loaded_disk_blocks"] > 0
    with pytest.raises(ValueError, match="in use"):
        _engine(tmp_path)
    again.close()
    # Another KV layout never reads these blocks: they are removed. Here the other pool dtype under the same
    # model, weights and compute (float32 and bfloat16 pools both run in the C kernels; without them the
    # bfloat16 pool needs bfloat16 compute, which changes the weights too).
    other = "float32" if again.kv_dtype == torch.bfloat16 else "bfloat16"
    torch_bf16 = other == "bfloat16" and again.model.kernels is None
    eng = LLMEngine(EngineConfig(dtype="bfloat16" if torch_bf16 else "float32", cache=CacheConfig(
        num_blocks=64, disk_cache_bytes=64 << 20, disk_cache_dir=str(tmp_path), kv_cache_dtype=other)))
    assert eng.block_layout.dtype == other and eng.block_layout.model == again.block_layout.model or torch_bf16
    assert eng.metrics()["lower_tiers"]["restored_blocks"] == 0 and not list(tmp_path.glob("*.kv"))
    eng.close()
