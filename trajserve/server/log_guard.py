"""Logging that cannot stop the server.

A server's log is a pipe or a file someone else empties: a supervisor that
reads slowly, a full disk, a flood of malformed requests each logging a
warning. A StreamHandler writes on the thread that logs, under a lock, so
once the pipe is full every thread that logs blocks -- the event loop
included -- and the server stops answering (and stopping: the exit-time
flush waits on the same pipe). So here:

    record --rate limit--> bounded queue --writer thread--> stderr (os.write)
              |                  |                              |
          suppressed          dropped                        dropped
          (counted)           (queue full: counted)          (write failed: counted)

- the thread that logs only formats the line and puts it in a bounded queue
  (never waits); a full queue drops the line and counts it;
- one daemon writer thread writes the lines to the file descriptor with
  os.write (no lock any other code takes, no buffered stream to flush at
  exit): a full pipe blocks that thread alone, and the process still exits
  on SIGTERM;
- the same message repeated (same logger, level and format string: what
  uvicorn's "Invalid HTTP request received." is for every bad request) is
  let through `burst` times per `window_s` seconds; the rest are counted,
  and the next line let through says how many were left out.

The counts are on /metrics (trajserve_log_lines_total and friends).
"""
from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass

_MAX_KEYS = 1024  # distinct messages whose rate is tracked (least recently seen forgotten first)


@dataclass
class LogCounts:
    # Each written by one side only (the loggers' or the writer thread's), so no update is lost.
    lines: int = 0         # lines written
    suppressed: int = 0    # repeats held back by the rate limit
    queue_full: int = 0    # lines lost: the writer was that far behind
    write_failed: int = 0  # lines lost: the write failed (a closed pipe, a full disk)

    @property
    def dropped(self) -> int:
        return self.queue_full + self.write_failed


class _RateLimit(logging.Filter):
    """At most `burst` records per message per window; the first record let
    through after a suppression carries the number left out."""

    def __init__(self, counts: LogCounts, burst: int, window_s: float, clock=time.monotonic) -> None:
        super().__init__()
        self.counts, self.burst, self.window_s, self.clock = counts, burst, window_s, clock
        self._seen: OrderedDict[tuple, list] = OrderedDict()  # key -> [window start, let through, held back]
        self._lock = threading.Lock()

    def filter(self, record: logging.LogRecord) -> bool:
        key = (record.name, record.levelno, str(record.msg))
        now = self.clock()
        with self._lock:
            st = self._seen.get(key)
            if st is None:
                st = self._seen[key] = [now, 0, 0]
                if len(self._seen) > _MAX_KEYS:
                    self._seen.popitem(last=False)
            else:
                self._seen.move_to_end(key)
            if now - st[0] >= self.window_s:
                record.trajserve_suppressed = st[2]
                st[:] = [now, 0, 0]
            if st[1] >= self.burst:
                st[2] += 1
                self.counts.suppressed += 1
                return False
            st[1] += 1
        return True


class _QueueHandler(logging.Handler):
    """Formats on the caller's thread and queues the bytes; never waits."""

    def __init__(self, q: queue.Queue, counts: LogCounts, window_s: float) -> None:
        super().__init__()
        self.q, self.counts, self.window_s = q, counts, window_s

    def emit(self, record: logging.LogRecord) -> None:
        try:
            text = self.format(record)
            held = getattr(record, "trajserve_suppressed", 0)
            if held:
                text += f" [{held} more like this in the {self.window_s:g} s before were not logged]"
            self.q.put_nowait((text + "\n").encode("utf-8", "replace"))
        except queue.Full:
            self.counts.queue_full += 1
        except Exception:  # noqa: BLE001 - a record that cannot be formatted is lost, never raised into serving
            self.counts.queue_full += 1

    def flush(self) -> None:
        pass  # never waits for the writer (the exit-time flush must not block on a full pipe)


class LogGuard:
    def __init__(self, fd: int = 2, capacity: int = 4096, burst: int = 20, window_s: float = 10.0) -> None:
        self.fd = fd
        self.counts = LogCounts()
        self.q: queue.Queue = queue.Queue(maxsize=capacity)
        self.handler = _QueueHandler(self.q, self.counts, window_s)
        self.handler.addFilter(_RateLimit(self.counts, burst, window_s))
        self._writer = threading.Thread(target=self._write_loop, name="trajserve-log-writer", daemon=True)
        self._writer.start()

    def _write_loop(self) -> None:
        while True:
            batch = [self.q.get()]
            while len(batch) < 256:
                try:
                    batch.append(self.q.get_nowait())
                except queue.Empty:
                    break
            data = memoryview(b"".join(batch))
            try:
                while data:
                    data = data[os.write(self.fd, data):]
                self.counts.lines += len(batch)
            except OSError:  # a closed pipe, a full disk: those lines are lost, serving goes on
                self.counts.write_failed += len(batch)

    def drain(self, timeout: float = 5.0) -> bool:
        """Wait until the queue is empty (tests, and a clean exit that can
        afford to wait); False if it is not within timeout."""
        deadline = time.monotonic() + timeout
        while not self.q.empty():
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)
        return True


_guard: LogGuard | None = None


def install(level: int = logging.INFO, fmt: str = "%(message)s") -> LogGuard:
    """Route every log record of this process through one LogGuard on
    stderr (the root logger's handlers replaced); idempotent."""
    global _guard
    if _guard is None:
        _guard = LogGuard()
        _guard.handler.setFormatter(logging.Formatter(fmt))
        # The last lines (how the server stopped) reach the log at exit, unless it is stuck: then 1 s at most.
        atexit.register(_guard.drain, 1.0)
    root = logging.getLogger()
    for h in list(root.handlers):
        root.removeHandler(h)
    root.addHandler(_guard.handler)
    root.setLevel(level)
    return _guard


def counts() -> LogCounts | None:
    """The installed guard's counts (None when logging is not guarded: an
    app built in-process, as the tests do)."""
    return _guard.counts if _guard is not None else None
