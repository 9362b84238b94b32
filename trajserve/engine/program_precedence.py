"""Under --scheduling priority and program: the rank that orders calls,
and when one call outranks another enough to take something from it: a
slot (Scheduler._preempt_for, and deadline pricing, which must foresee
it), and the expensive rows of its steps (PrefillHolds).

A rank is the scheduler's sort key: (priority,) under priority
scheduling; under program scheduling (priority, service level, when the
program started, service) (program_rank). Least served first is
Autellix's program-level attained service (engine/attained_service.py),
in levels that double, as a multi-level feedback queue's: below
LEVEL_TOKENS, then up to twice that, four times ...; within a level, the
program that started first goes first. Ordering by the exact service
would put every newcomer's first call ahead of the next call of a program
that has had a little, and that program's user waits for its end:
program-level first-come first-served within a level bounds the wait of
the programs that started earliest, as a short program's last call. A
call's own first LEVEL_TOKENS tokens (its quantum) do not count toward
its rank, so the prefill of a short program's next call does not drop it
a level in the middle of its reply; a call that computes more (a long
prompt, a long reply) does.
"""
from __future__ import annotations

import math
from collections.abc import Callable, Sequence

from trajserve.engine.attained_service import AttainedService
from trajserve.request import Request

# Of equal priorities, a call outranks another when the other's program has
# attained more than PREEMPT_SERVICE_RATIO times its service plus
# PREEMPT_SERVICE_MIN tokens: a new program (no service) outranks one that
# has had two or three calls (an agent's call computes some 100-250 tokens
# past its cached prefix; the slot it gives up costs a recompute of its last
# block, the rest hits the prefix cache), while two programs within a factor
# of two of each other do not trade a slot back and forth.
PREEMPT_SERVICE_RATIO = 2.0
PREEMPT_SERVICE_MIN = 256

# The first service level's width in tokens (about what a short call
# computes past its cached prefix, a request and its reply: a program served
# more has made more than one call, or a long one); each next level is twice
# the one before. A level twice as wide holds a long program's first two
# calls in level 0 beside newcomers, ahead of them by their earlier start
# (docs/benchmarks.md, agent programs). At most PREEMPT_SERVICE_MIN, so a
# call that outranks another (below) is always in a lower level: the order
# and the take-aways agree.
LEVEL_TOKENS = 128

# The longest a prefill of an outranked call waits for the calls that
# outrank it to stop decoding (then such prefills go one a step).
HOLD_S = 0.5


def service_level(service: float) -> int:
    """0 below LEVEL_TOKENS, then 1 + log2(service / LEVEL_TOKENS), floored."""
    return 0 if service < LEVEL_TOKENS else 1 + int(math.log2(service / LEVEL_TOKENS))


def program_rank(priority: int, service: float, started: float, own: int) -> tuple:
    """The sort key of a call under program scheduling: service, what its
    program has attained; started, when the program's first call arrived;
    own, the tokens this call has computed (the first LEVEL_TOKENS of them
    are its quantum)."""
    service = max(0.0, service - min(max(own, 0), LEVEL_TOKENS))
    return (priority, service_level(service), started, service)


def program_ranking(service: AttainedService, now: float) -> Callable[[Request], tuple]:
    """A step's rank of each call under program scheduling; its program's
    service and start are read once per program (a step sorts the running
    and the waiting requests, many of them calls of the same programs)."""
    known: dict[str, tuple[float, float]] = {}

    def rank(req: Request) -> tuple:
        program = req.program or req.request_id
        got = known.get(program)
        if got is None:
            started = service.started(program)
            got = known[program] = (service.of(program, now), req.arrival_time if started is None else started)
        return program_rank(req.priority, got[0], got[1], req.num_computed_tokens - req.num_cached_tokens)
    return rank


def outranks(a: tuple, b: tuple) -> bool:
    """Does the call ranked `a` outrank the one ranked `b`?"""
    if a[0] != b[0]:
        return a[0] < b[0]
    return len(a) > 1 and b[-1] > PREEMPT_SERVICE_RATIO * a[-1] + PREEMPT_SERVICE_MIN


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
