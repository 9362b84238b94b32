"""Logging cannot stop the server (server/log_guard.py): repeated warnings are
rate-limited and counted, a log nobody reads loses lines instead of blocking
request handling, and the server still stops on SIGTERM."""
from __future__ import annotations

import logging
import os
import re
import signal
import socket
import subprocess
import time
from concurrent.futures import ThreadPoolExecutor

import httpx

from test_cli import _command
from trajserve.server.log_guard import LogCounts, LogGuard, _RateLimit


def _record(msg: str, *args, name: str = "uvicorn.error", level: int = logging.WARNING) -> logging.LogRecord:
    return logging.LogRecord(name, level, __file__, 1, msg, args, None)


def test_repeats_are_let_through_burst_times_a_window_then_counted():
    now = [0.0]
    counts = LogCounts()
    f = _RateLimit(counts, burst=3, window_s=10.0, clock=lambda: now[0])
    passed = [f.filter(_record("Invalid HTTP request received.")) for _ in range(10)]
    assert passed == [True] * 3 + [False] * 7 and counts.suppressed == 7
    assert f.filter(_record("another message"))  # counted per message
    assert f.filter(_record("Invalid HTTP request received.", name="other.logger"))  # and per logger
    now[0] = 10.0
    r = _record("Invalid HTTP request received.")
    assert f.filter(r) and r.trajserve_suppressed == 7  # the first one of the next window says how many
    # Same format string, other arguments: one message (no client text can make it a new one).
    assert [f.filter(_record("replica %d is down", i)) for i in range(5)] == [True] * 3 + [False] * 2


def _guarded(fd: int, **kw) -> tuple[LogGuard, logging.Logger]:
    guard = LogGuard(fd=fd, **kw)
    guard.handler.setFormatter(logging.Formatter("%(message)s"))
    log = logging.getLogger(f"trajserve.test-log-guard-{id(guard)}")
    log.propagate = False
    log.addHandler(guard.handler)
    return guard, log


def test_the_line_after_a_suppression_says_how_many_were_left_out():
    r, w = os.pipe()
    guard, log = _guarded(w, burst=1, window_s=0.05)
    for _ in range(3):
        log.warning("same thing")
    time.sleep(0.06)
    log.warning("same thing")
    assert guard.drain()
    time.sleep(0.05)
    text = os.read(r, 1 << 16).decode()
    assert text.splitlines() == ["same thing", "same thing [2 more like this in the 0.05 s before were not logged]"]
    assert guard.counts.suppressed == 2 and guard.counts.lines == 2
    os.close(r)


def test_a_log_nobody_reads_drops_lines_and_never_blocks_the_caller():
    r, w = os.pipe()
    guard, log = _guarded(w, capacity=64, burst=10**9)
    t = time.monotonic()
    for i in range(20_000):  # ~4 MB into a 64 KiB pipe nobody reads
        log.warning("line %d %s", i, "x" * 200)
    assert time.monotonic() - t < 10 and guard.counts.queue_full > 10_000
    os.close(r)  # the blocked write fails now (EPIPE): counted, and the writer goes on
    deadline = time.monotonic() + 5
    while guard.counts.write_failed == 0:
        assert time.monotonic() < deadline
        time.sleep(0.01)
    assert guard.counts.dropped == guard.counts.queue_full + guard.counts.write_failed


def _garbage(url: str, payload: bytes) -> None:
    host, port = url.removeprefix("http://").split(":")
    with socket.create_connection((host, int(port)), timeout=10) as s:
        s.sendall(payload)
        try:
            while s.recv(4096):
                pass
        except OSError:
            pass


def test_a_flood_of_malformed_requests_with_nobody_reading_stderr(tmp_path):
    """10,000 malformed requests (each one uvicorn warns about) into a server
    whose stderr is a pipe nobody reads: a normal completion still answers
    within 5 s, and SIGTERM still stops it cleanly."""
    env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
    proc = subprocess.Popen([*_command(), "serve", "--port", "0", "--num-blocks", "128", "--max-model-len", "512"],
                            stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, env=env)
    try:
        url = None
        deadline = time.monotonic() + 180
        while url is None and time.monotonic() < deadline:  # read up to the address, then never again
            line = proc.stderr.readline().decode()
            assert line or proc.poll() is None, "server exited"
            m = re.search(r"serving \S+ on (http://\S+)", line)
            url = m.group(1) if m else None
        while httpx.get(url + "/health", timeout=5).status_code != 200:
            time.sleep(0.2)
        kinds = [b"GARBAGE\r\n\r\n", b"POST /v1/completions HTTP/1.1\r\nHost: x\r\nContent-Length: -5\r\n\r\n",
                 b"POST / HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\nzz\r\n"]
        with ThreadPoolExecutor(8) as pool:
            list(pool.map(lambda i: _garbage(url, kinds[i % 3]), range(10_000)))
        t = time.monotonic()
        r = httpx.post(url + "/v1/completions", json={"prompt": "The capital of France is", "max_tokens": 4,
                                                       "temperature": 0}, timeout=5)
        assert r.status_code == 200 and time.monotonic() - t < 5
        metrics = httpx.get(url + "/metrics", timeout=5).text
        suppressed = float(re.search(r"^trajserve_log_lines_suppressed_total (\S+)$", metrics, re.M).group(1))
        assert suppressed > 9_000  # the warning was let through a few times, then counted
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()
        proc.stderr.close()
