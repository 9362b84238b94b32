"""Who owns a directory of KV blocks: a lock file held for the owner's life.

The lock is an flock(2) on DIR/.trajserve.lock, so the kernel releases it
when the owner exits however it exits (kill -9 included): a lock that can
be taken has no owner, whatever the pid written inside it says (pids are
reused). Two uses:

- a --kv-disk-dir: a second engine on the same directory is refused with a
  clear error (two engines writing one tier would evict each other's files);
- scratch directories (the session store's, the tier's without a
  --kv-disk-dir) under the system's temp directory: each new one first
  removes those of owners that are gone, so a killed server leaves nothing
  behind for long.
"""
from __future__ import annotations

import errno
import fcntl
import logging
import os
import shutil
import tempfile
from pathlib import Path

log = logging.getLogger("trajserve")

LOCK_NAME = ".trajserve.lock"
SCRATCH_PREFIX = "trajserve-kv-"


class DirInUse(ValueError):
    """Another live process holds the directory."""


class DirLock:
    """fresh: the directory was just made by this process. The lock file is
    then locked under another name and renamed into place, so a sweep never
    sees it unlocked. (Not for a shared directory: there two engines must
    meet on the same file.)"""

    def __init__(self, directory: str | os.PathLike, fresh: bool = False) -> None:
        self.dir = Path(directory)
        path = self.dir / LOCK_NAME
        fd = os.open(path.with_name(LOCK_NAME + ".new") if fresh else path, os.O_RDWR | os.O_CREAT, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            os.close(fd)
            if e.errno not in (errno.EWOULDBLOCK, errno.EACCES):
                raise
            raise DirInUse(f"the KV directory {str(self.dir)!r} is in use by another trajserve engine "
                           f"(pid {_owner(path)}): give each engine its own --kv-disk-dir") from None
        os.ftruncate(fd, 0)
        os.write(fd, f"{os.getpid()}\n".encode())
        if fresh:
            os.replace(path.with_name(LOCK_NAME + ".new"), path)
        self._fd: int | None = fd

    def release(self) -> None:
        if self._fd is not None:
            os.close(self._fd)  # closing the descriptor drops the flock
            self._fd = None


def _owner(path: Path) -> str:
    try:
        return path.read_text().strip() or "unknown"
    except OSError:
        return "unknown"


def _is_orphan(directory: Path) -> bool:
    """A scratch directory whose owner is gone: its lock can be taken. One
    without a lock file is left alone (its owner may be creating it now)."""
    path = directory / LOCK_NAME
    try:
        fd = os.open(path, os.O_RDWR)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except OSError:
        return False
    finally:
        os.close(fd)


def sweep_orphans(parent: str | os.PathLike | None = None) -> int:
    """Remove scratch directories of owners that are gone; returns how many."""
    base = Path(parent or tempfile.gettempdir())
    removed = 0
    try:
        entries = list(base.glob(SCRATCH_PREFIX + "*"))
    except OSError:
        return 0
    for d in entries:
        if d.is_dir() and not d.is_symlink() and _is_orphan(d):
            shutil.rmtree(d, ignore_errors=True)
            removed += 1
    if removed:
        log.info("removed %d KV scratch director%s left by engines that are gone", removed,
                 "y" if removed == 1 else "ies")
    return removed


class ScratchDir:
    """A temporary directory for KV blocks, locked while this process runs
    and removed by cleanup() (or, after a crash, by the next engine's sweep)."""

    def __init__(self, kind: str, parent: str | os.PathLike | None = None) -> None:
        sweep_orphans(parent)
        self.name = tempfile.mkdtemp(prefix=f"{SCRATCH_PREFIX}{kind}-", dir=parent)
        self._lock = DirLock(self.name, fresh=True)

    def cleanup(self) -> None:
        self._lock.release()
        shutil.rmtree(self.name, ignore_errors=True)
