"""How long will this tool call keep the session paused?

The keep policy (keep_policy.py) needs T_wait before the tool returns. Spec:
kv-cache-management, "分层辅助存储" and the speculative-prefetch paragraph
before it: tool runs are rarely black boxes; profiling CI runs, web API calls
or terminal commands gives predictable latencies (median 3 s, minimum 2 s in
its example), while human approvals are log-normal, minutes to hours.

Order of trust: the caller's hint (it knows what it launched), else the
history of this tool, else the history of all tools, else a fixed prior.
Histories are streaming quantiles (the P^2 algorithm, five markers per
history), so memory is O(1) per tool however many waits are observed, and the
number of tools tracked is capped (tool names come from clients).
"""
from __future__ import annotations

import math
from collections import OrderedDict
from dataclasses import dataclass


class P2Quantile:
    """One streaming quantile in O(1) memory: the P^2 algorithm (Jain and
    Chlamtac, 1985). Five markers track the minimum, p/2, p, (1+p)/2 and the
    maximum; each new sample shifts marker positions and the middle three
    heights are corrected by piecewise-parabolic interpolation."""

    __slots__ = ("p", "count", "_q", "_n", "_want", "_step")

    def __init__(self, p: float) -> None:
        if not 0.0 < p < 1.0:
            raise ValueError(f"quantile must be in (0, 1), got {p}")
        self.p = p
        self.count = 0
        self._q: list[float] = []            # marker heights (the first five samples until then)
        self._n = [0, 1, 2, 3, 4]            # actual marker positions (0-based)
        self._want = [0.0, 2 * p, 4 * p, 2 + 2 * p, 4.0]  # desired positions
        self._step = [0.0, p / 2, p, (1 + p) / 2, 1.0]    # desired-position increment per sample

    def add(self, x: float) -> None:
        self.count += 1
        if self.count <= 5:
            self._q.append(x)
            self._q.sort()
            return
        k = self._cell(x)
        for i in range(k + 1, 5):
            self._n[i] += 1
        for i in range(5):
            self._want[i] += self._step[i]
        for i in (1, 2, 3):
            self._adjust(i)

    def value(self) -> float:
        """The current estimate; exact (interpolated) while five samples or fewer."""
        if self.count == 0:
            raise ValueError("no samples yet")
        if self.count <= 5:
            return _exact_quantile(self._q, self.p)
        return self._q[2]

    def _cell(self, x: float) -> int:
        """Index k of the marker cell [q_k, q_k+1) holding x; widens the ends."""
        q = self._q
        if x < q[0]:
            q[0] = x
            return 0
        if x >= q[4]:
            q[4] = x
            return 3
        k = 0
        while x >= q[k + 1]:
            k += 1
        return k

    def _adjust(self, i: int) -> None:
        q, n = self._q, self._n
        d = self._want[i] - n[i]
        # Move a marker only by one position, and only if it would not collide with a neighbour.
        if not ((d >= 1 and n[i + 1] - n[i] > 1) or (d <= -1 and n[i - 1] - n[i] < -1)):
            return
        s = 1 if d > 0 else -1
        h = self._parabolic(i, s)
        if not q[i - 1] < h < q[i + 1]:
            # The parabola overshoots a neighbour (keeps heights monotone): fall back to linear.
            h = q[i] + s * (q[i + s] - q[i]) / (n[i + s] - n[i])
        q[i] = h
        n[i] += s

    def _parabolic(self, i: int, s: int) -> float:
        q, n = self._q, self._n
        return q[i] + s / (n[i + 1] - n[i - 1]) * (
            (n[i] - n[i - 1] + s) * (q[i + 1] - q[i]) / (n[i + 1] - n[i])
            + (n[i + 1] - n[i] - s) * (q[i] - q[i - 1]) / (n[i] - n[i - 1]))


def _exact_quantile(sorted_xs: list[float], p: float) -> float:
    """Linear interpolation between order statistics (numpy's default method)."""
    pos = p * (len(sorted_xs) - 1)
    lo = math.floor(pos)
    hi = min(lo + 1, len(sorted_xs) - 1)
    return sorted_xs[lo] + (pos - lo) * (sorted_xs[hi] - sorted_xs[lo])


@dataclass(frozen=True, slots=True)
class WaitEstimate:
    seconds: float
    source: str     # "hint" | "tool" | "global" | "prior": for the keep policy's log line


class WaitEstimator:
    """Expected tool wait: the caller's hint, else a per-tool history of observed waits
    (streaming quantiles, bounded memory), else a prior."""

    def __init__(self, prior_s: float = 5.0, quantile: float = 0.5, min_samples: int = 3,
                 max_tools: int = 1024) -> None:
        if not (math.isfinite(prior_s) and prior_s >= 0):
            raise ValueError(f"prior wait must be a finite number of seconds >= 0, got {prior_s}")
        if min_samples < 1 or max_tools < 1:
            raise ValueError("min_samples and max_tools must be >= 1")
        self.prior_s = prior_s
        self.quantile = quantile
        self.min_samples = min_samples
        self.max_tools = max_tools
        self._global = P2Quantile(quantile)
        self._tools: OrderedDict[str, P2Quantile] = OrderedDict()  # LRU order: oldest first

    def expected(self, tool: str | None, hint_s: float | None) -> float:
        return self.estimate(tool, hint_s).seconds

    def estimate(self, tool: str | None, hint_s: float | None) -> WaitEstimate:
        # A hint comes from the client: a bad one (negative, NaN) is ignored, not fatal.
        # An infinite hint is meaningful ("waiting on a human, no idea how long").
        if hint_s is not None and not math.isnan(hint_s) and hint_s >= 0:
            return WaitEstimate(float(hint_s), "hint")
        history = self._tools.get(tool) if tool is not None else None
        if history is not None and history.count >= self.min_samples:
            return WaitEstimate(history.value(), "tool")
        if self._global.count >= self.min_samples:
            return WaitEstimate(self._global.value(), "global")
        return WaitEstimate(self.prior_s, "prior")

    def observe(self, tool: str | None, wait_s: float) -> None:
        """Record a measured wait (pause to resume). Measurements come from the
        engine's own clock, so a bad one is a bug and raises."""
        if not (math.isfinite(wait_s) and wait_s >= 0):
            raise ValueError(f"observed wait must be a finite number of seconds >= 0, got {wait_s}")
        self._global.add(wait_s)
        if tool is not None:
            self._history(tool).add(wait_s)

    def count(self, tool: str | None = None) -> int:
        """Waits observed for this tool (all tools when None)."""
        if tool is None:
            return self._global.count
        h = self._tools.get(tool)
        return 0 if h is None else h.count

    def _history(self, tool: str) -> P2Quantile:
        h = self._tools.get(tool)
        if h is None:
            if len(self._tools) >= self.max_tools:
                self._tools.popitem(last=False)  # forget the least recently observed tool
            h = self._tools[tool] = P2Quantile(self.quantile)
        else:
            self._tools.move_to_end(tool)
        return h
