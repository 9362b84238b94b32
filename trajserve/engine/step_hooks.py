"""Housekeeping that runs around every engine step, whoever steps the engine.

A session manager registers its tick (leases, expiry, pressure, prefetch)
before each step and its stall check after it, so they advance under any
traffic: LLM.generate, the server's loop, a bench, a session's own turn.
(They used to run only when the caller stepped through the manager.) Its
tick is also an idle hook: a loop with nothing to step (the server's) runs
idle() instead, so leases and prefetches advance while no request runs."""
from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

T = TypeVar("T")
Hook = Callable[[], None]


class StepHooks:
    def __init__(self) -> None:
        self._hooks: list[tuple[object, Hook | None, Hook | None, Hook | None]] = []

    def add(self, owner: object, before: Hook | None = None, after: Hook | None = None,
            idle: Hook | None = None) -> None:
        self._hooks.append((owner, before, after, idle))

    def remove(self, owner: object) -> None:
        """Take off owner's hooks (a manager that shuts down)."""
        self._hooks = [h for h in self._hooks if h[0] is not owner]

    def around(self, step: Callable[[], T]) -> T:
        for _, before, _, _ in list(self._hooks):
            if before is not None:
                before()
        result = step()
        for _, _, after, _ in list(self._hooks):
            if after is not None:
                after()
        return result

    def idle(self) -> None:
        """Nothing to step now: run the idle hooks."""
        for _, _, _, idle in list(self._hooks):
            if idle is not None:
                idle()
