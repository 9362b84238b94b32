"""Goodput, live (inference-optimization 8.6.2): R_good = sum Q_i D_i / T_obs,
the results per second that are correct (Q_i; taken as 1: no client reports
correctness here) and on time (D_i).

A finished request is on time when it meets every target that applies:
the server's SLO (`serve --slo-ttft-ms`, `--slo-itl-ms`: the time to the
first token, and the mean time between its output tokens) and its own
deadline, if it gave one (the body's `deadline_ms` or the header
x-trajserve-deadline-ms: arrival to the last token). /metrics counts each
finished request by its outcome (met, or the first target it missed:
ttft, itl, deadline; an aborted or failed request is `unfinished`) and
reports R_good over the last WINDOW_S seconds.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from trajserve.outputs import RequestOutput

WINDOW_S = 60.0
DEADLINE_MAX_MS = 86_400_000  # a day: longer is no deadline a server can keep
DEADLINE_HEADER = "x-trajserve-deadline-ms"
OUTCOMES = ("met", "ttft", "itl", "deadline", "unfinished")


@dataclass(frozen=True)
class SLO:
    ttft_s: float | None = None
    itl_s: float | None = None


def check_deadline_ms(value: object, name: str) -> float:
    """A deadline in milliseconds: a finite number in (0, DEADLINE_MAX_MS]
    (ValueError naming `name` and the range otherwise)."""
    ok = isinstance(value, (int, float)) and not isinstance(value, bool) and math.isfinite(value)
    if not ok or not 0 < value <= DEADLINE_MAX_MS:
        raise ValueError(f"{name} must be a number of milliseconds in (0, {DEADLINE_MAX_MS:,}], got {value!r}")
    return float(value)


def outcome(out: RequestOutput, slo: SLO, deadline_s: float | None) -> str:
    """met, or the first target the finished request missed."""
    if any(c.finish_reason in (None, "abort", "error") for c in out.outputs):
        return "unfinished"
    m = out.metrics
    if slo.ttft_s is not None and (m.ttft is None or m.ttft > slo.ttft_s):
        return "ttft"
    if slo.itl_s is not None and m.inter_token_times:
        if sum(m.inter_token_times) / len(m.inter_token_times) > slo.itl_s:
            return "itl"
    if deadline_s is not None and m.finished_time is not None and m.finished_time - m.arrival_time > deadline_s:
        return "deadline"
    return "met"


class Goodput:
    """Results on time in the last WINDOW_S seconds (the engine thread
    records; /metrics reads a number)."""

    def __init__(self, slo: SLO, clock=time.monotonic) -> None:
        self.slo, self.clock = slo, clock
        self._met: deque[float] = deque()

    def record(self, out: RequestOutput, deadline_s: float | None) -> str:
        result = outcome(out, self.slo, deadline_s)
        if result == "met":
            self._met.append(self.clock())
        return result

    def rate(self) -> float:
        """R_good over the window, in results per second."""
        now = self.clock()
        while self._met and self._met[0] < now - WINDOW_S:
            self._met.popleft()
        return len(self._met) / WINDOW_S
