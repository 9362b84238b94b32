"""Each API key's priority (`serve --api-key K1 K2 --api-key-priority P1 P2`):
the priority its requests run at when they name none, and the best they may
name (lower runs first, engine/scheduler.py): a batch tenant's key at 100
cannot jump the interactive tenants' queue by sending priority -1000."""
from __future__ import annotations

import hmac

from trajserve.config import PRIORITY_RANGE


def check_key_priorities(keys: tuple[str, ...] | None, priorities: tuple[int, ...] | None) -> None:
    if priorities is None:
        return
    if keys is None or len(priorities) != len(keys):
        raise ValueError(f"--api-key-priority gives one priority per --api-key: {len(priorities)} priorities for "
                         f"{0 if keys is None else len(keys)} keys")
    lo, hi = PRIORITY_RANGE
    bad = next((p for p in priorities if not lo <= p <= hi), None)
    if bad is not None:
        raise ValueError(f"--api-key-priority must be in [{lo}, {hi}], got {bad}")


def key_of(headers) -> bytes | None:
    """The key a request sent (Authorization: Bearer KEY, else x-api-key: KEY)."""
    auth = headers.get("authorization", "")
    if auth[:7].lower() == "bearer ":
        return auth[7:].strip().encode()
    key = headers.get("x-api-key")
    return key.strip().encode() if key is not None else None


class KeyPriorities:
    def __init__(self, keys: tuple[str, ...], priorities: tuple[int, ...]) -> None:
        self._pairs = [(k.encode(), p) for k, p in zip(keys, priorities)]

    def of(self, headers) -> int | None:
        """The priority of the key these headers carry (None: no key of ours)."""
        given = key_of(headers)
        if given is None:
            return None
        # compare_digest over every key: the time taken says nothing of which matched (server/auth.py).
        found = None
        for key, priority in self._pairs:
            if hmac.compare_digest(given, key):
                found = priority
        return found

    def apply(self, headers, asked: int | None) -> int | None:
        """The request's priority under its key: the key's when it names none,
        and never better (lower) than the key's."""
        floor = self.of(headers)
        if floor is None:
            return asked
        return floor if asked is None else max(asked, floor)
