"""`serve --admission off|auto|N`: at most N requests in the engine
(running and queued, counted as the scheduler counts them: a request of n
choices is n sequences); one more is refused with 429 and Retry-After
before it queues. Under `--scheduling priority` / `program` a newcomer
counts only the requests of its priority or a more urgent one
(`num_ahead_of`): the less urgent give way to it, so a burst of
batch work does not lock an interactive request out; under FCFS every
request counts.

Why a cap (inference-optimization 8.6.2): past the arrival rate where
goodput peaks, more arrivals only lengthen the queue. The chapter's
continuous-batching run finished 2.33 req/s at 4/s and 2.38 at 16/s, but
its goodput fell 41 % (1.02 to 0.60 req/s): the extra requests were served
late, and made others late. Its rule: find the rate where goodput starts
to fall, and cap what is accepted there. By Little's law (8.6.1,
n = lambda T) a cap on the arrival rate at the knee is a cap on the
requests in the system, n_knee = lambda_knee T_knee, which is what a
server can count; a refused client retries later or goes to another
replica, and the admitted ones keep their SLO.

`auto` finds n_knee from this engine at work, not from a table. Under a
steady load of one kind of request (uncached prompt P, G output tokens in
K <= G decode steps: fewer where speculation's drafts were accepted), a
step with r sequences carries r decode rows and, on average, r / K of a
prefill (each running request's prompt spread over its life), so the step
time is linear in r:

    s(r) = a + b r

fitted to the engine's own steps (seconds against sequences, least
squares, each weighing half as much every HALF_LIFE_STEPS steps:
engine/step_time.py's fit with sequences as its one shape), which folds
in whatever this machine, model and traffic cost, prefill chunks
included. With n requests in the system, r = min(n, max_num_seqs) run;
a request's mean ITL is s(r) K / G, the throughput X(r) = r / (K s(r))
requests a second, and a newcomer's TTFT the queue ahead of it,
(n - r) / X(r), plus its prefill's steps at the step's budget beside
r - 1 decodes. Goodput is X while every target holds and falls once one
does; X does not grow past r = max_num_seqs, so the cap is the largest n
whose ITL and TTFT meet the SLO (`--slo-itl-ms`, `--slo-ttft-ms`): the
edge where goodput starts to fall. P, G and K are the means of the last
WINDOW finished requests. The cap is recomputed at most every REFRESH_S
seconds. Until the fit has MIN_STEPS steps of MIN_BATCH_SIZES batch sizes
(with one, a row's cost and the step's cannot be told apart, and a light
load would be capped by an extrapolation) and WINDOW // 4 requests have
finished, there is no cap: a guess would refuse for nothing.
`bench serve --sweep-rate` measures the knee from outside and prints it
beside this cap.
"""
from __future__ import annotations

import math
import time
from collections import deque
from dataclasses import dataclass

from trajserve.engine.step_time import StepTimeModel
from trajserve.outputs import RequestOutput

WINDOW = 32
MIN_BATCH_SIZES = 3  # steps of this many batch sizes before a cap: a row's cost apart from a step's
REFRESH_S = 0.5
MAX_CAP = 65_536


def num_ahead_of(scheduler, priority: int) -> int:
    """Sequences in the engine, running and waiting, that a newcomer of
    this priority would run behind or beside: every one under FCFS; under
    priority / program scheduling those of its priority or a more urgent
    one (the less urgent give way to it). What the cap counts."""
    if not scheduler.ordered:
        return len(scheduler.waiting) + len(scheduler.running)
    return sum(r.priority <= priority for q in (scheduler.waiting, scheduler.running) for r in q)


class AdmissionFull(RuntimeError):
    """The engine holds as many requests as the admission cap allows."""

    def __init__(self, held: int, cap: int, how: str, retry_after_s: float) -> None:
        super().__init__(f"the engine holds {held} requests and --admission caps it at {cap} ({how}); retry later")
        self.retry_after_s = retry_after_s


def parse_admission(value: str | int, ttft_s: float | None = None, itl_s: float | None = None) -> str | int:
    """`off`, `auto` (which needs a target) or a positive integer (ValueError naming the flag)."""
    if value == "auto" and ttft_s is None and itl_s is None:
        raise ValueError("--admission auto caps admissions at the SLO's knee: give --slo-ttft-ms or "
                         "--slo-itl-ms (or a number of requests)")
    if value in ("off", "auto"):
        return value
    try:
        n = int(value) if not isinstance(value, bool) else 0
    except (TypeError, ValueError):
        n = 0
    if not 1 <= n <= MAX_CAP:
        raise ValueError(f"--admission must be off, auto or a number of requests in 1..{MAX_CAP:,}, got {value!r}")
    return n


@dataclass(frozen=True, slots=True)
class Shape:
    """What a request lately looked like: mean uncached prompt and output
    tokens, and the decode steps its output took (fewer than its tokens
    where speculation's drafts were accepted)."""
    prompt: float
    output: float
    steps: float | None = None  # None: one a token


@dataclass(frozen=True, slots=True)
class Knee:
    cap: int
    itl_s: float  # the predicted mean ITL at the cap
    ttft_s: float  # a newcomer's predicted TTFT at the cap
    throughput: float  # requests a second at the cap


def predicted(n: int, a: float, b: float, shape: Shape, slots: int, budget: int,
              chunk: int) -> tuple[float, float, float]:
    """(ITL, TTFT, throughput) with n requests in the system and a step of
    r sequences taking a + b r seconds (the module's docstring)."""
    g = max(shape.output, 1.0)
    k = min(g, max(shape.steps if shape.steps is not None else g, 1.0))
    r = min(n, slots)
    step = a + b * r
    throughput = r / (k * step)
    prefill_steps = math.ceil(max(shape.prompt, 1.0) / max(1, min(budget - (r - 1), chunk)))
    ttft = (n - r) / throughput + prefill_steps * step
    return step * k / g, ttft, throughput


def knee(a: float, b: float, shape: Shape, slots: int, budget: int, chunk: int, ttft_s: float | None,
         itl_s: float | None, n_max: int) -> Knee:
    """The largest n in 1..n_max meeting both targets (1 when even one
    request alone misses: a cap never refuses everything)."""
    def at(n: int) -> tuple[float, float, float]:
        return predicted(n, a, b, shape, slots, budget, chunk)

    def meets(n: int) -> bool:
        itl, ttft, _ = at(n)
        return (itl_s is None or itl <= itl_s) and (ttft_s is None or ttft <= ttft_s)

    lo, hi = 1, n_max  # ITL and TTFT grow with n: the first failure bounds the search
    if meets(hi):
        lo = hi
    else:
        while hi - lo > 1:
            mid = (lo + hi) // 2
            if meets(mid):
                lo = mid
            else:
                hi = mid
    return Knee(lo, *at(lo))


class AdmissionLimit:
    """The cap AsyncEngine checks on the engine thread; it tells the cap of
    every step (observe_step) and every request that ends (observe)."""

    def __init__(self, mode: str | int, scheduler_config, ttft_s: float | None = None,
                 itl_s: float | None = None, n_max: int = 4096, clock=time.monotonic) -> None:
        self.mode = parse_admission(mode, ttft_s, itl_s)
        self.config = scheduler_config
        self.ttft_s, self.itl_s, self.n_max, self.clock = ttft_s, itl_s, n_max, clock
        self.steps = StepTimeModel()  # seconds against sequences only (tokens and pairs left at 0)
        self._shapes: deque[tuple[int, int, int]] = deque(maxlen=WINDOW)
        self._knee: Knee | None = None
        self._at = -math.inf
        self.num_refused = 0

    def observe_step(self, seqs: int, seconds: float) -> None:
        if seqs:
            self.steps.observe(0, seqs, 0, seconds)

    def observe(self, out: RequestOutput) -> None:
        """A request ended: its shape (an aborted one says nothing of where replies stop)."""
        if not out.outputs or any(c.finish_reason in (None, "abort", "error") for c in out.outputs):
            return
        tokens = max(len(c.token_ids) for c in out.outputs)
        self._shapes.append((len(out.prompt_token_ids) - out.num_cached_tokens, tokens,
                             max(1, tokens - out.metrics.num_accepted_tokens)))

    def shape(self) -> Shape | None:
        if len(self._shapes) < WINDOW // 4:
            return None
        n = len(self._shapes)
        return Shape(*(sum(s[i] for s in self._shapes) / n for i in range(3)))

    def current(self) -> Knee | None:
        """The cap and what it was priced at; None when there is none (off,
        or auto before the engine has been seen at work)."""
        if self.mode == "off":
            return None
        if isinstance(self.mode, int):
            return Knee(self.mode, math.nan, math.nan, math.nan)
        now = self.clock()
        if now - self._at >= REFRESH_S:
            self._at = now
            shape, cfg, fit = self.shape(), self.config, self.steps
            seen = fit.ready and len(fit.batch_sizes) >= MIN_BATCH_SIZES
            a, _, b, _ = fit.coefficients if seen else (0.0, 0.0, 0.0, 0.0)
            self._knee = None if shape is None or not seen else knee(
                a, b, shape, cfg.max_num_seqs, cfg.max_num_batched_tokens, cfg.max_prefill_chunk,
                self.ttft_s, self.itl_s, self.n_max)
        return self._knee

    def check(self, held: int) -> None:
        """Raise AdmissionFull when `held` requests are already in the engine."""
        k = self.current()
        if k is None or held < k.cap:
            return
        self.num_refused += 1
        if isinstance(self.mode, int):
            raise AdmissionFull(held, k.cap, "a fixed cap", retry_after_s=1.0)
        raise AdmissionFull(held, k.cap, f"auto: the SLO's knee, predicted ITL {k.itl_s * 1e3:,.0f} ms and TTFT "
                                         f"{k.ttft_s * 1e3:,.0f} ms there", retry_after_s=max(1.0, 1.0 / k.throughput))

    def metrics(self) -> dict:
        k = self.current()
        return {"admission_cap": k.cap if k is not None else None, "admission_refusals": self.num_refused}
