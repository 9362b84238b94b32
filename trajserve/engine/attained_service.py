"""Program-level attained service: how much the engine has computed for
each program (an agent's line of calls: a session, a conversation), for
`--scheduling program`.

An agent is a program of many calls, and its user waits for the program's
end, not for any one call. Under first-come first-served every call of a
long program queues behind newcomers' first calls; ordering waiting calls
by the service their program has attained so far (least first: Autellix's
program-level attained service) lets short programs and the next call of a
program that has had little finish first, while a long program, once it
has had its share, yields. Service is tokens computed (prefill and decode
rows), decayed with a half-life so a program that waited long (a tool ran,
a human read) is not held back forever by what it was served an hour ago.
The service orders programs by level (engine/program_precedence.py), and
within a level the program that started first goes first, so this also
keeps when each program's first call arrived.

Memory is bounded: past MAX_PROGRAMS the least-served entries go (a
forgotten program counts as new: served nothing yet).
"""
from __future__ import annotations

MAX_PROGRAMS = 1 << 16


class AttainedService:
    def __init__(self, half_life_s: float) -> None:
        if not half_life_s > 0:
            raise ValueError(f"the attained service's half-life must be > 0 s, got {half_life_s}")
        self.half_life_s = half_life_s
        self._served: dict[str, tuple[float, float, float]] = {}  # program -> (tokens, as of time, started)

    def __len__(self) -> int:
        return len(self._served)

    def of(self, program: str, now: float) -> float:
        """Tokens computed for `program`, decayed to `now`."""
        got = self._served.get(program)
        if got is None:
            return 0.0
        tokens, at, _ = got
        return tokens * 0.5 ** (max(0.0, now - at) / self.half_life_s)

    def started(self, program: str) -> float | None:
        """When the program's first served call arrived (None: not served yet)."""
        got = self._served.get(program)
        return None if got is None else got[2]

    def add(self, program: str, tokens: int, now: float, arrived: float | None = None) -> None:
        """`tokens` computed for `program` at `now`; arrived: when the call
        they were computed for arrived (the program's start, if its first)."""
        got = self._served.get(program)
        start = got[2] if got is not None else (now if arrived is None else arrived)
        self._served[program] = (self.of(program, now) + tokens, now, start)
        if len(self._served) > MAX_PROGRAMS:
            self._forget(now)

    def _forget(self, now: float) -> None:
        """Drop the least-served half: they would be in the first level anyway."""
        ranked = sorted(self._served, key=lambda p: self.of(p, now))
        for p in ranked[: len(ranked) // 2]:
            del self._served[p]
