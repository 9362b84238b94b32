"""Deadline-aware admission (inference-optimization 8.6.1: a request that
will miss its deadline is rejected, redirected or sped up before it is
admitted, not after it has held memory and steps for nothing).

Every request is priced as it arrives (unless --deadline-admission is off),
with the step-time model fitted to this engine's own steps
(engine/step_time.py):

    wait     the running requests' decodes until a slot frees, when every
             slot is taken and the policy would not give it one at once
             (the soonest to finish, at the expected length); and, under
             priority or program scheduling, the running decodes that
             outrank it until they end, at most HOLD_S (they hold its
             prefill back: engine/program_precedence.py)
    prefill  the prompt tokens the prefix cache does not hold, behind the
             uncomputed tokens of the waiting requests the policy
             (--scheduling) runs first, at the step's budget less the
             running decodes' rows
    decode   its expected output tokens, one a step, beside the running
             ones' decodes and the prefill chunks of the waiting requests
             behind it, as far as the budget takes them

and what arrives meanwhile shares those steps: rho, the priced work of the
last ARRIVAL_WINDOW_S seconds' arrivals per second, stretches prefill and
decode by 1 / (1 - rho). The expected output is min(max_tokens, the mean
output of the last OUTPUT_WINDOW finished requests) once that many have
finished (max_tokens before): a server cannot know where a reply stops,
and pricing every reply at its cap would refuse what it would have met.

The prediction still misses what it cannot see (a preemption, a step
slowed by the machine, a burst), so before it meets the deadline it is
multiplied by a margin: the (1 - miss target) quantile of actual /
predicted over the last ERROR_WINDOW admitted requests that had a
deadline: how late this engine's predictions have run, measured. It
counts from the first that finishes (the first of a run are the ones a
cold prediction misses most), but until MIN_ERRORS have finished it only
grows from 1: a prediction that ran late is heeded at once, one that ran
early not trusted yet. With `--deadline-miss-target 0.02` (the default)
a request admitted at the margin finishes late about 2 % of the time, as
far as the last requests' errors tell the next ones'; a looser target
admits more and misses more.

Over the deadline: refused (DeadlineMiss: 429 when an idle engine would
have met it, the load is the cause and a retry may pass; 503 when even an
idle engine would not), or, under --deadline-admission deprioritize,
admitted at the lowest priority. Until the model has seen MIN_STEPS steps
nothing is refused (no prediction is better than a guess).
"""
from __future__ import annotations

import math
from collections import OrderedDict, deque
from dataclasses import dataclass

from trajserve.config import DEADLINE_ADMISSION, PRIORITY_RANGE
from trajserve.engine.program_precedence import HOLD_S, outranks
from trajserve.engine.step_time import StepTimeModel
from trajserve.plan.flops import causal_pairs

OUTPUT_WINDOW = 32
ERROR_WINDOW = 64
MIN_ERRORS = 8  # fewer finished: the margin only grows from 1 (a late one counts, an early one is not trusted yet)
MAX_PRICED = 4096
ARRIVAL_WINDOW_S = 30.0
MAX_LOAD = 0.9  # rho is capped: past it the queue grows without bound and no prediction holds


@dataclass(frozen=True, slots=True)
class Prediction:
    wait_s: float
    prefill_s: float
    decode_s: float
    idle_s: float  # the same request on an idle engine
    output_tokens: int  # the output length it was priced at
    work_s: float = 0.0  # the time its own rows add to the steps they run in (the load later arrivals share)

    @property
    def total_s(self) -> float:
        return self.wait_s + self.prefill_s + self.decode_s


class DeadlineMiss(RuntimeError):
    """A request predicted to finish after its deadline, refused before it was queued."""

    def __init__(self, deadline_s: float, p: Prediction, margin: float = 1.0) -> None:
        self.deadline_s, self.prediction = deadline_s, p
        self.busy = p.idle_s * margin <= deadline_s  # the load, not the request itself, is what misses
        self.status = 429 if self.busy else 503
        self.retry_after_s = max(1.0, p.total_s - p.idle_s)  # about when the load ahead of it has cleared
        why = ("the engine is busy: retry later" if self.busy else
               "an idle engine would need that long too: ask for fewer tokens or a later deadline")
        super().__init__(
            f"deadline_ms {deadline_s * 1e3:,.0f} cannot be met: predicted completion {p.total_s * 1e3:,.0f} ms "
            f"(waiting for a slot or outranking decodes {p.wait_s * 1e3:,.0f} ms + prefill "
            f"{p.prefill_s * 1e3:,.0f} ms + "
            f"{p.output_tokens:,} output tokens {p.decode_s * 1e3:,.0f} ms; idle {p.idle_s * 1e3:,.0f} ms)"
            + (f" x {margin:.2f}, how late this engine's predictions have run" if margin != 1.0 else "")
            + f"; {why}")


class DeadlineAdmission:
    def __init__(self, scheduler, kv, policy: str = "refuse", miss_target: float = 0.02) -> None:
        if policy not in DEADLINE_ADMISSION:  # SchedulerConfig checks it; a direct caller may not
            raise ValueError(f"deadline_admission must be one of {', '.join(DEADLINE_ADMISSION)}, got {policy!r}")
        self.scheduler, self.kv, self.policy = scheduler, kv, policy
        self.margin_quantile = 1.0 - miss_target
        self.steps = StepTimeModel()
        self._outputs: deque[int] = deque(maxlen=OUTPUT_WINDOW)
        # request id -> predicted seconds, until it finishes (the oldest dropped past MAX_PRICED: aborts)
        self._priced: OrderedDict[str, float] = OrderedDict()
        self._hits: OrderedDict[str, int] = OrderedDict()  # request id -> prompt tokens the cache held when priced
        self._arrivals: deque[tuple[float, float]] = deque()  # (arrival time, its work in step seconds)
        self._errors: deque[float] = deque(maxlen=ERROR_WINDOW)  # actual / predicted
        self.num_refused = 0
        self.num_deprioritized = 0

    # ------------------------------------------------------------ feeding
    def observe_step(self, chunks, seconds: float) -> None:
        """A step's chunks (scheduler.ScheduledChunk) and its wall time."""
        self.steps.observe(sum(c.num_tokens for c in chunks), len(chunks),
                           sum(causal_pairs(c.num_tokens, c.start) for c in chunks), seconds)

    def observe_finished(self, req, end: float) -> None:
        """A request finished at `end` (the engine's clock): its output's
        length, and for one that was priced, how far off the price was."""
        self._outputs.append(req.num_output_tokens)
        self._hits.pop(req.request_id, None)
        predicted = self._priced.pop(req.request_id, None)
        if predicted is not None and predicted > 0:
            self._errors.append((end - req.arrival_time) / predicted)

    @property
    def margin(self) -> float:
        """What a prediction is multiplied by before it meets the deadline
        (the module's docstring)."""
        if not self._errors:
            return 1.0
        e = sorted(self._errors)
        m = e[min(len(e) - 1, int(self.margin_quantile * len(e)))]
        return m if len(e) >= MIN_ERRORS else max(1.0, m)

    # ---------------------------------------------------------- admission
    def expected_output(self, max_tokens: int) -> int:
        if len(self._outputs) < OUTPUT_WINDOW:
            return max_tokens
        return max(1, min(max_tokens, round(sum(self._outputs) / len(self._outputs))))

    def predict(self, req) -> Prediction | None:
        """When request `req` (not queued yet) would finish, from now; None
        before the step model is fitted."""
        if not self.steps.ready:
            return None
        s, cfg, price = self.scheduler, self.scheduler.config, self.steps.seconds
        n = req.num_tokens
        cached = self.cached(req)
        out = self.expected_output(req.sampling_params.max_tokens)
        rank = s.ranking()
        mine = rank(req)
        running = s.running
        ctx = sum(r.num_tokens for r in running)  # the running requests' contexts: their decodes' pairs a step
        wait = 0.0
        if len(running) >= cfg.max_num_seqs and not self._displaces(req, running, rank):
            left = min(max(1, self.expected_output(r.sampling_params.max_tokens) - r.num_output_tokens)
                       for r in running)
            wait = price(left, left * len(running), left * len(running), left * ctx)
        over = [r for r in running if r.num_tokens - r.num_computed_tokens <= 1 and outranks(rank(r), mine)
                ] if s.holds is not None else []
        if over:  # decodes that outrank it hold its prefill back
            left = max(max(1, self.expected_output(r.sampling_params.max_tokens) - r.num_output_tokens)
                       for r in over)
            wait += min(HOLD_S, price(left, left * len(running), left * len(running), left * ctx))
        # The waiting requests the policy runs first (ties: theirs arrived first), and the rest.
        ahead, behind = [], []
        for w in s.waiting:
            (ahead if rank(w) <= mine else behind).append(w)
        queued, queued_pairs = self._prefill_work(ahead)
        rows = min(len(running), cfg.max_num_seqs - 1)  # decodes beside it
        own = causal_pairs(n - cached, cached)
        prefill = self._prefill_s(queued + n - cached, queued_pairs + own, rows, ctx)
        # Its decode steps also carry the prefill chunks of those behind it,
        # as far as the budget left beside the decodes takes them.
        rest, rest_pairs = self._prefill_work(behind)
        room = out * max(0, min(cfg.max_num_batched_tokens - rows - 1, cfg.max_prefill_chunk))
        taken = min(rest, room)
        decode = price(out, out * (rows + 1) + taken, out * (rows + 1) + min(out, len(behind)),
                       out * (ctx + n + out // 2) + (rest_pairs * taken // rest if rest else 0))
        idle = self._prefill_s(n - cached, own, 0, 0) + price(out, out, out, out * (n + out // 2))
        # What arrives meanwhile shares its steps: the recent arrivals' work
        # (their prefill and decode rows, priced) per second is the share of
        # the engine they take, rho; the rest is its (T / (1 - rho)).
        rho = min(MAX_LOAD, self._load(req.arrival_time))
        work = price(0, n - cached + out, out, own + out * (n + out // 2))
        return Prediction(wait, prefill / (1 - rho), decode / (1 - rho), idle, out, work)

    def _load(self, now: float) -> float:
        """rho: the work that arrived over the last ARRIVAL_WINDOW_S seconds, per second."""
        a = self._arrivals
        while a and a[0][0] < now - ARRIVAL_WINDOW_S:
            a.popleft()
        return sum(w for _, w in a) / ARRIVAL_WINDOW_S

    def cached(self, req) -> int:
        """Tokens of req's prompt its prefill will not compute: those already
        computed, or held by the prefix cache on the device (one left out),
        as the cache held them when req was first priced (a waiting request
        is not matched again for every request that arrives behind it)."""
        if req.num_computed_tokens or not self.kv.prefix_caching:
            return req.num_computed_tokens
        memo = self._hits.get(req.request_id)
        if memo is None:
            hit = self.kv.cached_prefix(req.all_token_ids, req.cache_scope)
            memo = self._hits[req.request_id] = min(hit.num_tokens if hit is not None else 0, req.num_tokens - 1)
            if len(self._hits) > MAX_PRICED:
                self._hits.popitem(last=False)
        return memo

    def _prefill_work(self, reqs) -> tuple[int, int]:
        """The tokens these waiting requests' prefills will compute, and their pairs."""
        tokens = work = 0
        for r in reqs:
            done = self.cached(r)
            tokens += r.num_tokens - done
            work += causal_pairs(r.num_tokens - done, done)
        return tokens, work

    def _displaces(self, req, running, rank) -> bool:
        """Every slot is taken: would req take one at once (the scheduler's
        slot rule, Scheduler._preempt_for), or wait for a running one to end?"""
        if self.scheduler.config.scheduling == "fcfs":
            return False
        return outranks(rank(req), rank(max(running, key=rank)))

    def _prefill_s(self, tokens: int, prefill_pairs: int, rows: int, rows_ctx: int) -> float:
        """`tokens` of prefill (`prefill_pairs` pairs among them) beside
        `rows` decodes over `rows_ctx` tokens of context, a step's budget at a time."""
        cfg = self.scheduler.config
        per_step = max(1, min(cfg.max_num_batched_tokens - rows, cfg.max_prefill_chunk))
        steps = math.ceil(tokens / per_step)
        return self.steps.seconds(steps, tokens + steps * rows, steps * (rows + 1), prefill_pairs + steps * rows_ctx)

    def admit(self, req, deadline_s: float | None) -> int:
        """The priority to queue request `req` at (its own, or the lowest);
        DeadlineMiss if it is refused. Every request is priced (unless the
        policy is off), a deadline or not: its work is the load later ones
        share, and its error, at its end, the margin."""
        if self.policy == "off":
            return req.priority
        p = self.predict(req)
        if p is None:
            return req.priority
        self._arrivals.append((req.arrival_time, p.work_s))
        if deadline_s is None:
            return req.priority
        self._priced[req.request_id] = p.total_s
        if len(self._priced) > MAX_PRICED:
            self._priced.popitem(last=False)
        if p.total_s * self.margin <= deadline_s:
            return req.priority
        if self.policy == "deprioritize":
            self.num_deprioritized += 1  # (still priced: its error counts toward the margin)
            return PRIORITY_RANGE[1]
        self.num_refused += 1
        self._priced.pop(req.request_id, None)
        raise DeadlineMiss(deadline_s, p, self.margin)
