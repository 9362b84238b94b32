"""A --kv-disk-dir survives the server: a conversation computed before a
restart (clean, or kill -9 mid-traffic) hits from disk after it with the
same greedy output; what a crash left half-written is removed, never served;
the directory stays within its cap; the killed server's scratch directory
is swept by the next one."""
from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path

import httpx
import pytest

from server_util import ServerProcess

MODEL = "smol"
CAP = 16 * 2**20
AGENT = ("You are a coding agent. Tools: read_file(path), write_file(path, text), run_tests(). "
         "Explain the plan before calling a tool. ") * 6 + "Task: the tests in tests/ fail; find out why."


def _serve(disk_dir: Path, tmpdir: Path, *extra: str) -> ServerProcess:
    return ServerProcess("--dtype", "float32", "--kv-disk-cache", str(CAP), "--kv-disk-dir", str(disk_dir),
                         "--served-model-name", MODEL, *extra, tmpdir=str(tmpdir))


def _complete(s: ServerProcess, prompt: str) -> dict:
    r = httpx.post(s.url + "/v1/completions", json={"model": MODEL, "prompt": prompt, "max_tokens": 8,
                                                     "temperature": 0}, timeout=120)
    assert r.status_code == 200, r.text
    return r.json()


def _cached(reply: dict) -> int:
    return reply["usage"]["prompt_tokens_details"]["cached_tokens"]


@pytest.fixture()
def dirs(tmp_path) -> tuple[Path, Path]:
    """The disk tier's directory and the servers' TMPDIR (scratch directories)."""
    disk, tmp = tmp_path / "kv", tmp_path / "tmp"
    disk.mkdir(), tmp.mkdir()
    return disk, tmp


def _killed_scratch_dir(tmp: Path) -> Path:
    """A KV scratch directory whose owner was killed (kill -9: it never cleaned up)."""
    code = ("import sys, time; from trajserve.kv.dir_lock import ScratchDir; "
            "d = ScratchDir('session', parent=sys.argv[1]); print(d.name, flush=True); time.sleep(120)")
    p = subprocess.Popen([sys.executable, "-c", code, str(tmp)], stdout=subprocess.PIPE, text=True)
    name = Path(p.stdout.readline().strip())
    p.kill()
    p.wait()
    assert name.is_dir()
    return name


def _dir_bytes(d: Path) -> int:
    return sum(p.stat().st_size for p in d.iterdir() if p.is_file())


def test_a_clean_restart_hits_from_disk_with_the_same_output(dirs):
    disk, tmp = dirs
    s = _serve(disk, tmp, "--num-blocks", "64")
    try:
        first = _complete(s, AGENT)
        second = _complete(s, AGENT + first["choices"][0]["text"] + " Open tests/test_io.py.")
    finally:
        assert s.close() == 0
    assert list(disk.glob("*.kv")), "a clean close writes the device tree down to disk"
    assert _dir_bytes(disk) <= CAP

    with _serve(disk, tmp, "--num-blocks", "64") as s:
        again = _complete(s, AGENT)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert _cached(again) >= first["usage"]["prompt_tokens"] - 16  # all but the last, partial block
        turn2 = _complete(s, AGENT + first["choices"][0]["text"] + " Open tests/test_io.py.")
        assert turn2["choices"][0]["text"] == second["choices"][0]["text"]
        assert _cached(turn2) > _cached(again)
        m = s.metrics()
        assert m["trajserve_prefix_cache_restored_blocks"] > 0
        assert m["trajserve_prefix_cache_corrupt_blocks_total"] == 0
        assert _dir_bytes(disk) <= CAP


def _wait_written(s: ServerProcess, disk: Path, timeout: float = 60) -> int:
    """Until every block the disk tier counts is a file under its own name
    (the writer thread has caught up); the number of files."""
    deadline = time.monotonic() + timeout
    while True:
        want = s.metrics()['trajserve_prefix_cache_tier_bytes{tier="disk"}']
        files = list(disk.glob("*.kv"))
        if want > 0 and sum(p.stat().st_size for p in files) == want:
            return len(files)
        assert time.monotonic() < deadline, (want, len(files))
        time.sleep(0.2)


def test_after_kill_9_the_next_server_hits_and_serves_nothing_half_written(dirs):
    disk, tmp = dirs
    # A 24-block pool: the agent's prefix (about 14 blocks) leaves the device
    # for disk while other traffic runs, so its blocks are files before the kill.
    s = _serve(disk, tmp, "--num-blocks", "24")
    try:
        first = _complete(s, AGENT)
        for k in range(3):
            _complete(s, f"Unrelated request {k}: " + "summarize the weather report for the coast. " * 12)
        written = _wait_written(s, disk)
        orphan = _killed_scratch_dir(tmp)  # as a killed engine without a --kv-disk-dir leaves it
    finally:
        s.proc.kill()
        s.proc.wait()
    assert _dir_bytes(disk) <= CAP
    # What a crash mid-write leaves: the writer's temporary file, and a block
    # file cut short (as a file system without atomic rename could leave it).
    victim = sorted(disk.glob("*.kv"))[0]
    planted = disk / (victim.stem + ".tmp")
    planted.write_bytes(victim.read_bytes()[:1000])
    torn = disk / ("0" * 16 + ".kv")
    torn.write_bytes(victim.read_bytes()[: victim.stat().st_size // 2])

    with _serve(disk, tmp, "--num-blocks", "24") as s:
        # (The planted ones by name: the new server's own writer may have a block of its own mid-write.)
        assert not planted.exists() and not torn.exists(), "half-written files are removed at start-up"
        m = s.metrics()
        assert m["trajserve_prefix_cache_restored_blocks"] == written
        assert not orphan.exists(), "a killed engine's scratch directory is swept at start-up"
        again = _complete(s, AGENT)
        assert again["choices"][0]["text"] == first["choices"][0]["text"]
        assert _cached(again) > 0
        assert s.metrics()["trajserve_prefix_cache_promoted_blocks_total"] > 0
        assert _dir_bytes(disk) <= CAP


def test_the_directory_stays_within_its_cap_across_restarts(dirs):
    """Three servers in turn, each filling a 2 MiB disk tier with new
    prompts: at every point the directory holds at most the cap, and each
    start-up keeps only what fits."""
    disk, tmp = dirs
    cap = 2 * 2**20
    for run in range(3):
        with ServerProcess("--dtype", "float32", "--num-blocks", "16", "--kv-disk-cache", str(cap),
                           "--kv-disk-dir", str(disk), "--served-model-name", MODEL, tmpdir=str(tmp)) as s:
            for k in range(3):
                _complete(s, f"Run {run}, prompt {k}: " + "tell me about the history of the harbour. " * 10)
                assert _dir_bytes(disk) <= cap
        assert _dir_bytes(disk) <= cap
    assert all(n.endswith(".kv") or n == ".trajserve.lock" for n in os.listdir(disk)), os.listdir(disk)
