"""EngineCore: the one step every caller runs -- schedule, execute, update.

    Scheduler.schedule() ─► Executor.execute(SchedulerOutput) ─► Scheduler.update(sampled tokens)

The scheduler (engine/scheduler.py) decides what runs and owns every
request's state, n > 1 forks included; an Executor turns a SchedulerOutput
into one token per sampled row. The engine's executor runs the model and
the sampler (engine/model_runner.py); the simulator's puts the cost
model there (sim/executor.py) and spends virtual time. LLMEngine.step()
(with its step hooks and output processing) and the simulator's loop both
step an EngineCore, so what one schedules the other schedules the same way.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

from trajserve.request import Request
from trajserve.engine.scheduler import Scheduler, SchedulerOutput


@dataclass(slots=True)
class StepStats:
    """Where one step's wall time went (seconds)."""
    num_tokens: int = 0
    num_seqs: int = 0
    schedule: float = 0.0
    prepare: float = 0.0
    forward: float = 0.0
    sample: float = 0.0
    update: float = 0.0

    @property
    def total(self) -> float:
        return self.schedule + self.prepare + self.forward + self.sample + self.update


@dataclass(slots=True)
class ExecutorOutput:
    """One step's sampled rows: ids[i] gets tokens[i] (logprobs[i] when asked)."""
    ids: list[str]
    tokens: list[int]
    logprobs: list | None = None
    end: float | None = None  # when the step ended in the executor's own time (a simulator's clock); None: now
    # Speculation: per drafted sequence, its accepted draft tokens (they come
    # before tokens[i]) and their logprobs (None entries where none were asked).
    accepted: dict[str, list[int]] | None = None
    accepted_logprobs: dict[str, list] | None = None
    stats: StepStats = field(default_factory=StepStats)  # prepare / forward / sample timings


class Executor(Protocol):
    def execute(self, sched: SchedulerOutput) -> ExecutorOutput: ...


@dataclass(slots=True)
class StepRecord:
    sched: SchedulerOutput
    result: ExecutorOutput
    finished: list[Request]
    end: float  # when the step ended, the time update() stamped its tokens with
    stats: StepStats


class EngineCore:
    def __init__(self, scheduler: Scheduler, executor: Executor, clock: Callable[[], float] = time.monotonic):
        self.scheduler, self.executor, self.clock = scheduler, executor, clock

    def step(self) -> StepRecord | None:
        """One step; None when nothing was scheduled. Its tokens are stamped
        with the executor's end time (virtual) or the clock's (wall)."""
        t0 = time.perf_counter()
        sched = self.scheduler.schedule()
        t1 = time.perf_counter()
        if sched.is_empty:
            return None
        num_tokens, num_seqs = sched.num_batched_tokens, len(sched.chunks)  # before update adds n > 1 forks
        res = self.executor.execute(sched)
        end = res.end if res.end is not None else self.clock()
        t2 = time.perf_counter()
        finished = self.scheduler.update(sched, dict(zip(res.ids, res.tokens)), end, res.accepted)
        st = res.stats
        proposer = self.scheduler.proposer
        if proposer is not None and all(c.num_tokens == 1 or c.draft for c in sched.chunks):
            # Decodes and verifications only: what a step of this many rows costs.
            proposer.record_step(num_tokens, st.prepare + st.forward + st.sample)
        st.schedule, st.update = t1 - t0, time.perf_counter() - t2
        st.num_tokens, st.num_seqs = num_tokens, num_seqs
        return StepRecord(sched, res, finished, end, st)
