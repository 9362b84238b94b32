"""SessionConfig: what a SessionManager is built with, checked once.

The library's defaults keep every session until its owner closes it (no
idle TTL, no cap): a caller that holds its Session objects says when it is
done. The server's defaults differ (server/config.py), since an HTTP client
that sends a session_id need not DELETE it."""
from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class SessionConfig:
    # The tiers saved state goes to when the engine has none of its own
    # (--kv-host-cache, --kv-disk-cache); with the engine's, those are the
    # one store for both and these are not read.
    host_bytes: int = 2 * 2**30
    disk_dir: str | None = None  # None: a temporary directory, removed at shutdown
    disk_bytes: int = 8 * 2**30
    # A paused session's reload starts at this fraction of its expected wait
    # (sessions/pause_machine.py), so a tool that returns on time finds its
    # state on the device.
    prefetch_fraction: float = 0.8
    overlap_reload: bool = True  # a resumed turn's reload runs behind its prefill
    # The keep policy's empty-pool allowance (sessions/keep_policy.py phi0):
    # at an empty pool a paused state stays on the device while its expected
    # wait is under this many host round trips; the allowance falls to one
    # round trip at the admission ceiling.
    idle_keep_factor: float = 10.0
    idle_ttl_s: float | None = None  # no turn, pause or resume for this long: closed (None: never)
    max_sessions: int | None = None  # opening one more closes the least recently active (None: no limit)

    def __post_init__(self) -> None:
        for name in ("host_bytes", "disk_bytes"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise ValueError(f"{name} must be an integer >= 0, got {value!r}")
        if not 1 <= self.idle_keep_factor <= 1e6:
            raise ValueError(f"idle_keep_factor must be in [1, 1e6], got {self.idle_keep_factor}")
        if not 0 <= self.prefetch_fraction <= 1:
            raise ValueError(f"prefetch_fraction must be in [0, 1], got {self.prefetch_fraction}")
        if self.idle_ttl_s is not None and not 0 < self.idle_ttl_s < math.inf:
            raise ValueError(f"idle_ttl_s must be a finite number of seconds > 0 (or None: never), "
                             f"got {self.idle_ttl_s!r}")
        if self.max_sessions is not None and (not isinstance(self.max_sessions, int) or self.max_sessions < 1):
            raise ValueError(f"max_sessions must be an integer >= 1 (or None: no limit), got {self.max_sessions!r}")
