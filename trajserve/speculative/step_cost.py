"""The measured cost of a decode step with r rows, T(r).

The draft length rule (8.5.4) needs what more verified rows cost (dT)
against the time per token of the step (T / N). Neither is a constant on a
CPU: at batch 1 a step is a pass over the weights and an extra row costs
~8 % of it, while on this project's 2-core Sapphire Rapids a batch of 8 is
already compute-bound (13.1 ms; a ninth row adds 1.4 ms, a tenth 1.7). A
line fitted over all batch sizes gets both wrong, so T is kept per row
count: an exponential moving average of the executor time of every step
that ran only decodes and verifications (a prefill chunk's rows cost
differently), read between measured row counts by linear interpolation.

Past the largest row count measured near r, an extra row is guessed at
1/16 of the step's time per sequence (the cheap side: drafts are then
tried, and their steps measure the real cost, so the guess lasts only until
the first verification at that batch size).
"""
from __future__ import annotations

import bisect

_EMA = 0.2  # weight of the newest step at a row count


class StepCost:
    __slots__ = ("times", "rows")

    def __init__(self) -> None:
        self.times: dict[int, float] = {}  # rows -> seconds (EMA)
        self.rows: list[int] = []          # the measured row counts, sorted

    def record(self, rows: int, seconds: float) -> None:
        old = self.times.get(rows)
        if old is None:
            bisect.insort(self.rows, rows)
            self.times[rows] = seconds
        else:
            self.times[rows] = old + _EMA * (seconds - old)

    @property
    def measured(self) -> bool:
        return bool(self.rows)

    def time(self, rows: int) -> float:
        """T(rows) in seconds (0 before any step)."""
        if not self.rows:
            return 0.0
        t = self.times.get(rows)
        if t is not None:
            return t
        i = bisect.bisect_left(self.rows, rows)
        if i == 0:  # below every measured count: scale the smallest down
            r = self.rows[0]
            return self.times[r] * (1 - (r - rows) / (16.0 * r))
        lo = self.rows[i - 1]
        if i < len(self.rows):
            hi = self.rows[i]
            return self.times[lo] + (self.times[hi] - self.times[lo]) * (rows - lo) / (hi - lo)
        return self.times[lo] * (1 + (rows - lo) / (16.0 * max(lo, 1)))

    def added(self, rows: int, extra: int) -> float:
        """dT of `extra` more rows on a step of `rows` (never negative)."""
        return max(0.0, self.time(rows + extra) - self.time(rows))
