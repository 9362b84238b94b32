"""Discrete-event simulation: the engine's own Scheduler and KVCacheManager
(with its radix cache) stepped on a virtual clock by a CostModelRunner.

Loop (one iteration = one engine step):

    arrivals with time <= clock enter the scheduler's queue
    idle (nothing queued or running): jump the clock to the next arrival
    EngineCore.step()                     the engine's own step (engine/core.py):
      scheduler.schedule()                  same code as LLMEngine.step()
      CostModelExecutor.execute(out)        cost model instead of the forward: clock += its time
      scheduler.update(out, sampled, clock) placeholder tokens, fixed lengths
    finished calls: record metrics; the session's next call arrives after its wait,
                    and meanwhile the keep policy places its state (sim/pauses.py)

A call that arrives while a step runs waits for the step to end, as in the
engine. Sampled tokens are fresh ids (or a replayed output list), so the
next turn's prompt, which repeats them, hits the cache exactly as a real
conversation would. Requests finish by length (ignore_eos).

Memory: the scheduler only ever looks at the head of its waiting queue, and
admits at most max_num_seqs requests per step, so arrived calls wait in a
light queue here and are turned into token lists only while the scheduler
holds fewer than max_num_seqs waiting ones. Admission is the same as
queueing everything at once; a trace with a long backlog just does not hold
10^8 tokens in Python lists.
"""
from __future__ import annotations

import functools
import gc
import heapq
import math
import time
from array import array
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import numpy as np
from tqdm import tqdm

from trajserve.engine.core import EngineCore
from trajserve.request import Request
from trajserve.engine.scheduler import Scheduler, SchedulerOutput
from trajserve.kv.block_table import blocks_for
from trajserve.sampling import SamplingParams
from trajserve.sim.executor import CostModelExecutor, CostModelRunner
from trajserve.sim.pauses import PauseController
from trajserve.sim.prefix_tiers import SimPrefixTiers
from trajserve.sim.tokens import TokenSource
from trajserve.sim.workload import Call, Session


@dataclass(slots=True)
class Timeline:
    """Per step, after it ends: U_KV (eq. 8, kv-cache-management), the share
    of the pool held only by the prefix cache (evictable), queue sizes."""
    t: array = field(default_factory=lambda: array("d"))
    u_kv: array = field(default_factory=lambda: array("d"))
    cached: array = field(default_factory=lambda: array("d"))
    running: array = field(default_factory=lambda: array("i"))
    waiting: array = field(default_factory=lambda: array("i"))


@dataclass(slots=True)
class Records:
    """One entry per finished sequence (a call, or a fork branch)."""
    name: list[str] = field(default_factory=list)
    turn: array = field(default_factory=lambda: array("i"))
    arrival: array = field(default_factory=lambda: array("d"))
    first_token: array = field(default_factory=lambda: array("d"))
    finish: array = field(default_factory=lambda: array("d"))
    prompt_tokens: array = field(default_factory=lambda: array("q"))
    cached_tokens: array = field(default_factory=lambda: array("q"))
    output_tokens: array = field(default_factory=lambda: array("q"))
    preemptions: array = field(default_factory=lambda: array("i"))
    branch: array = field(default_factory=lambda: array("b"))  # 1: a fork child (no admission of its own)
    itl: array = field(default_factory=lambda: array("d"))     # all inter-token times, concatenated

    def add(self, req: Request, turn: int, branch: bool, now: float) -> None:
        self.name.append(req.request_id)
        self.turn.append(turn)
        self.arrival.append(req.arrival_time)
        self.first_token.append(req.first_token_time if req.first_token_time is not None else now)
        self.finish.append(now)
        self.prompt_tokens.append(req.num_prompt_tokens)
        self.cached_tokens.append(req.num_cached_tokens)
        self.output_tokens.append(req.num_output_tokens)
        self.preemptions.append(req.num_preemptions)
        self.branch.append(branch)
        self.itl.extend(req.inter_token_times)

    def __len__(self) -> int:
        return len(self.name)

    def col(self, name: str) -> np.ndarray:
        return np.array(getattr(self, name))


@dataclass(slots=True)
class SimResult:
    records: Records
    timeline: Timeline
    num_blocks: int
    block_size: int
    end_time: float             # virtual clock when the last call finished
    steps: int
    hit_rate: float             # H_prefix, eq. 2 (kv-cache-management), over admitted calls
    preemptions: int
    evicted_blocks: int
    cow_copies: int
    rejected: list[str]         # calls whose prompt cannot fit the pool at all
    runner: CostModelRunner
    wall_s: float               # real seconds the simulation took
    pauses: dict | None = None  # keep decisions, tier traffic (PauseController.summary)
    swap_preemptions: int = 0   # preemptions that swapped to the host tier (the rest recompute)
    prefix_tiers: dict | None = None  # the prefix cache's lower tiers (SimPrefixTiers.summary)
    speculation: dict | None = None   # drafted / accepted tokens (sim/speculation.py)


class Simulator:
    def __init__(self, sched: Scheduler, runner: CostModelRunner, tokens: TokenSource, *,
                 max_concurrency: int | None = None, progress: bool = False, desc: str = "simulate",
                 on_step: Callable[[float, float, SchedulerOutput], None] | None = None,
                 pauses: PauseController | None = None, prefix_tiers: SimPrefixTiers | None = None,
                 drafts=None) -> None:
        if max_concurrency is not None and max_concurrency < 1:
            raise ValueError(f"max concurrency must be >= 1, got {max_concurrency}")
        self.sched, self.kv, self.runner, self.tokens = sched, sched.kv, runner, tokens
        self.max_concurrency = max_concurrency
        self.progress, self.desc = progress, desc
        self.on_step = on_step  # (step start, step end, what ran): tests and tracing
        # Tool pauses under the keep policy; None: paused state just stays in
        # the prefix cache, unpinned (a client that announces no pauses).
        self.pauses = pauses
        self.prefix_tiers = prefix_tiers  # hierarchical prefix cache: its traffic costs step time
        self.drafts = drafts  # speculative decoding (sim/speculation.py), the scheduler's proposer
        # A request alone can always finish: cap its length at the pool (as the engine does).
        self.cap = self.kv.token_capacity

    def run(self, sessions: Sequence[Session]) -> SimResult:
        # The radix tree holds millions of block-key tuples; with the cyclic
        # GC on, the tuples each step creates trigger full collections that
        # scan all of them (a third of a Mooncake replay's time). Nothing
        # here builds reference cycles that must be reclaimed mid-run.
        gc_was_enabled = gc.isenabled()
        gc.disable()
        try:
            return self._run(sessions)
        finally:
            if gc_was_enabled:
                gc.enable()
            if self.prefix_tiers is not None:
                self.prefix_tiers.close()

    def _run(self, sessions: Sequence[Session]) -> SimResult:
        t_wall = time.perf_counter()
        sched, kv, runner = self.sched, self.kv, self.runner
        B, nb = kv.block_size, kv.num_blocks
        # Arrivals wait outside the scheduler while max_num_seqs already wait
        # in it: under FCFS the queue's order is the arrivals' either way. A
        # policy that orders the queue (priority, program) must see every call
        # that has arrived, as the engine's does, or a short program's call
        # queues behind long calls it outranks.
        feed_limit = math.inf if sched.ordered else sched.config.max_num_seqs
        gate = self.max_concurrency
        on_step = self.on_step
        pauses = self.pauses
        tiers = self.prefix_tiers

        events: list[tuple[float, int, Session]] = []
        for i, s in enumerate(sessions):
            if s.calls:
                events.append((s.next_arrival(0.0), i, s))
        heapq.heapify(events)
        seq = len(sessions)
        arrived: deque[tuple[float, Session]] = deque()
        live: dict[str, tuple[Session, Call, bool]] = {}
        executor = CostModelExecutor(runner, self.tokens, pauses, tiers, self.drafts)
        core = EngineCore(sched, executor)
        forced = executor.forced  # request id -> the output to replay
        fork_on_first: dict[str, int] = {}
        rec, tl = Records(), Timeline()
        rejected: list[str] = []
        inflight = 0
        idle_rounds = 0
        clock = 0.0
        total = sum(_calls_in(s.calls) for s in sessions)
        bar = tqdm(total=total, desc=self.desc, unit="call", disable=not self.progress, leave=False,
                   mininterval=0.5)

        while True:
            while events and events[0][0] <= clock:
                t, _, s = heapq.heappop(events)
                arrived.append((t, s))
            while arrived and len(sched.waiting) < feed_limit and (gate is None or inflight < gate):
                t, s = arrived.popleft()
                remaining, name = len(s.calls) - s.next, f"{s.name}#{s.next}"
                if pauses is not None:
                    pauses.resume(s, t, clock)
                # Behind a concurrency gate the client sends when a slot frees.
                req = self._materialize(s, t if gate is None else max(t, clock), live, forced, fork_on_first)
                if req is None:
                    rejected.append(name)
                    bar.update(remaining)
                    continue
                sched.add(req)
                inflight += 1
            if not sched.has_unfinished():
                if arrived:
                    continue
                if not events:
                    break
                nxt = events[0][0]
                timer = pauses.next_timer() if pauses is not None else None
                if timer is not None and timer < nxt:
                    # Idle until a lease runs out or a prefetch is due.
                    clock = max(clock, timer)
                    pauses.tick(clock)
                    continue
                clock = max(clock, nxt)
                continue

            if not tl.t:  # the pool before the first step, so a plot starts at the first arrival
                tl.t.append(clock)
                tl.u_kv.append(kv.num_used_blocks / nb)
                tl.cached.append(kv.num_reclaimable / nb)
                tl.running.append(0)
                tl.waiting.append(len(sched.waiting) + len(arrived))
            if pauses is not None:
                pauses.tick(clock)
            executor.now = clock
            step = core.step()
            if step is None:
                if pauses is not None and pauses.relieve_stall():
                    continue
                if idle_rounds < 100:
                    # Nothing ran (every running request was preempted, or
                    # an admission failed after evicting part of what it
                    # needed): no time passes and, as the engine's caller
                    # does, we schedule again; the state has changed.
                    idle_rounds += 1
                    continue
                if events:
                    clock = max(clock, events[0][0])
                    continue
                raise RuntimeError("simulation stalled: requests queued but none can be scheduled "
                                   f"({len(sched.waiting)} waiting, {len(sched.running)} running)")
            idle_rounds = 0
            out, finished, clock = step.sched, step.finished, step.end
            if on_step is not None:
                on_step(executor.started, clock, out)

            if fork_on_first:
                for c in out.chunks:
                    k = fork_on_first.get(c.request.request_id)
                    if k is not None and c.request.num_output_tokens == 1:
                        inflight += self._fork(c.request, k, live, forced, fork_on_first)
            for req in finished:
                rid = req.request_id
                s, call, is_branch = live.pop(rid)
                forced.pop(rid, None)
                fork_on_first.pop(rid, None)
                rec.add(req, call.turn, is_branch, clock)
                inflight -= 1
                s.history = req.all_token_ids
                s.next += 1
                if pauses is not None and not is_branch:
                    pauses.observe_prefill(req.num_prompt_tokens - req.num_cached_tokens,
                                           rec.first_token[-1] - req.arrival_time)
                if s.next < len(s.calls):
                    t_next = s.next_arrival(clock)
                    if pauses is not None and t_next > clock:
                        pauses.pause(s, s.history, req.cache_scope, t_next - clock, clock)
                    heapq.heappush(events, (t_next, seq, s))
                    seq += 1
                else:
                    s.history = []
            if finished:
                bar.update(len(finished))
            tl.t.append(clock)
            tl.u_kv.append(kv.num_used_blocks / nb)
            tl.cached.append(kv.num_reclaimable / nb)
            tl.running.append(len(sched.running))
            tl.waiting.append(len(sched.waiting) + len(arrived))
        bar.close()
        prefix = kv.prefix_stats()
        return SimResult(records=rec, timeline=tl, num_blocks=nb, block_size=B, end_time=clock,
                         steps=runner.stats.steps, hit_rate=sched.prefix_hit_rate,
                         preemptions=sched.num_preemptions, swap_preemptions=sched.num_swap_preemptions,
                         evicted_blocks=prefix.evicted_blocks if prefix else 0,
                         cow_copies=kv.num_cow_copies, rejected=rejected, runner=runner,
                         wall_s=time.perf_counter() - t_wall,
                         pauses=pauses.summary() if pauses is not None else None,
                         prefix_tiers=tiers.summary() if tiers is not None else None,
                         speculation=self._spec_summary())

    def _spec_summary(self) -> dict | None:
        d = self.drafts
        if d is None:
            return None
        m = d.metrics()
        del m["method"], m["step_ms"]
        return {"accept": d.accept, "max_draft": d.config.max_draft, "adaptive": d.config.adaptive, **m}

    # ---------------------------------------------------------------- private
    def _materialize(self, s: Session, arrival: float, live: dict, forced: dict, fork_on_first: dict
                     ) -> Request | None:
        call = s.calls[s.next]
        prompt = call.prompt(s.history)
        s.history = []
        if refused(self.kv, prompt):  # its session cannot go on
            s.next = len(s.calls)
            return None
        n_out = max(1, call.output_len)
        if call.fork:
            n_out = max(2, n_out)  # branches need a token of their own after the shared first one
        rid = f"{s.name}#{s.next}"
        req = Request(rid, prompt, greedy_params(n_out), self.cap, arrival_time=arrival,
                      cache_salt=call.cache_salt, program=s.name,  # an agent session's calls: one program
                      priority=call.priority)
        live[rid] = (s, call, False)
        if call.output_ids is not None:
            forced[rid] = call.output_ids
        if call.fork:
            fork_on_first[rid] = call.fork
        return req

    def _fork(self, parent: Request, k: int, live: dict, forced: dict, fork_on_first: dict) -> int:
        rid = parent.request_id
        del fork_on_first[rid]
        s, call, _ = live[rid]
        children = [Request(f"{rid}.b{j + 1}", parent.prompt_token_ids, parent.sampling_params,
                            parent.max_total_tokens, arrival_time=parent.arrival_time,
                            cache_salt=parent.cache_salt, program=parent.program,
                            first_token_time=parent.first_token_time,
                            last_token_time=parent.last_token_time) for j in range(k)]
        self.sched.fork(parent, children)
        for j, child in enumerate(children):
            live[child.request_id] = (s.branch(f"b{j + 1}"), call, True)
            if rid in forced:
                forced[child.request_id] = forced[rid]
        return k


@functools.cache
def greedy_params(n: int) -> SamplingParams:
    """A simulated call's parameters: n tokens, greedy, no EOS (one object per n)."""
    return SamplingParams(max_tokens=n, temperature=0.0, ignore_eos=True)


def refused(kv, prompt: list[int]) -> bool:
    """Would the engine refuse this prompt (a 400: empty, or more than the pool holds)?"""
    return not prompt or blocks_for(len(prompt) + 1, kv.block_size) + kv.watermark_blocks > kv.num_blocks


def _calls_in(calls: list[Call]) -> int:
    """Sequences a session runs: a fork of k multiplies every later call by k + 1."""
    n, width = 0, 1
    for c in calls:
        width *= 1 + c.fork
        n += width
    return n
