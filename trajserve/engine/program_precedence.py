"""When one call outranks another enough to take something from it, under
--scheduling priority and program: a slot (Scheduler._preempt_for, and
deadline pricing, which must foresee it), and the expensive rows of its
steps (PrefillHolds).

A rank is the scheduler's sort key: (priority,) under priority
scheduling, (priority, attained service) under program scheduling
(engine/attained_service.py).
"""
from __future__ import annotations

from collections.abc import Callable, Sequence

from trajserve.request import Request

# Of equal priorities, a call outranks another when the other's program has
# attained more than PREEMPT_SERVICE_RATIO times its service plus
# PREEMPT_SERVICE_MIN tokens: a new program (no service) outranks one that
# has had a few calls, while two programs within a factor of two of each
# other do not trade a slot back and forth.
PREEMPT_SERVICE_RATIO = 2.0
PREEMPT_SERVICE_MIN = 512

# The longest a prefill of an outranked call waits for the calls that
# outrank it to stop decoding (then such prefills go one a step).
HOLD_S = 0.5


def outranks(a: tuple, b: tuple) -> bool:
    """Does the call ranked `a` outrank the one ranked `b`?"""
    if a[0] != b[0]:
        return a[0] < b[0]
    return len(a) > 1 and b[1] > PREEMPT_SERVICE_RATIO * a[1] + PREEMPT_SERVICE_MIN


class PrefillHolds:
    """Priority and program scheduling: while a call decodes, calls it
    outranks (a lower priority; under program scheduling also a program
    served far more) add no prefill rows and no draft rows to the step.

    A step lasts as long as its rows take, and every call in it waits that
    long for its next token: a long program's 200-token prefill beside a
    short program's decode makes that one token cost 15-25 decode steps on
    the embedded model (120-200 ms against 7-13 ms). Ordering the queue and
    giving up slots alone leaves those rows in the short call's every step.
    Outranked calls still decode (one row each, cheap), their drafts wait,
    and each of their prefills waits at most HOLD_S seconds: a long program
    is delayed, never starved; after that, one such prefill goes a step, so
    the held ones do not all land in one step. The rows are the same, only
    later: no token changes.
    """

    def __init__(self, hold_s: float = HOLD_S) -> None:
        self.hold_s = hold_s
        self._since: dict[str, float] = {}  # request id -> when its prefill was first held (only while held)

    def step(self, decodes: Sequence[Request], rank: Callable[[Request], tuple], now: float) -> StepHolds | None:
        """This step's holds; decodes: the running decodes, in rank order.
        None when nothing decodes (nothing to protect)."""
        if not decodes:
            self._since.clear()
            return None
        return StepHolds(self, rank(decodes[0]), rank, now)

    def forget(self, request_id: str) -> None:
        self._since.pop(request_id, None)


class StepHolds:
    __slots__ = ("holds", "top", "rank", "now", "released")

    def __init__(self, holds: PrefillHolds, top: tuple, rank: Callable[[Request], tuple], now: float) -> None:
        self.holds, self.top, self.rank, self.now = holds, top, rank, now
        self.released: Request | None = None  # the one held prefill whose time ran out that goes this step

    def outranked(self, req: Request) -> bool:
        """Is req outranked by the first decoding call (so drafts nothing this step)?"""
        return outranks(self.top, self.rank(req))

    def held(self, req: Request) -> bool:
        """Does req's prefill chunk wait this step?"""
        since = self.holds._since
        if not self.outranked(req):
            since.pop(req.request_id, None)
            return False
        if self.now - since.setdefault(req.request_id, self.now) < self.holds.hold_s:
            return True
        if self.released is None or self.released is req:
            self.released = req
            return False
        return True
