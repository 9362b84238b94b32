"""What the simulator replays: sessions of model calls.

A session is one client: a chat user, an agent trajectory, a trace's agent.
Its calls run one after another; call k + 1 arrives `wait` seconds after
call k finished (a tool run, a human's think time), or at its own absolute
time, whichever is later. A call's prompt is built when it arrives, from
the session's history (the previous call's prompt + outputs), so a turn's
prompt extends the last one exactly as an agent harness re-sends it.

A call with `fork = k` branches into k + 1 sequences once its first token is
sampled (Scheduler.fork: the branches share its blocks copy-on-write); each
branch then continues the session's remaining calls on its own.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

# history (previous prompt + outputs, [] for a first call) -> this call's prompt
PromptFn = Callable[[list[int]], list[int]]


@dataclass(slots=True, eq=False)
class Call:
    prompt: PromptFn
    output_len: int
    arrival: float | None = None  # absolute seconds; None: `wait` after the previous call ends
    wait: float = 0.0
    fork: int = 0                 # extra branches after the first token
    output_ids: list[int] | None = None  # replay these outputs instead of placeholders
    cache_salt: str | None = None
    turn: int = 0                 # for per-turn reports
    priority: int = 0             # as a request's (lower runs first under priority / program scheduling)


@dataclass(slots=True, eq=False)
class Session:
    name: str
    calls: list[Call]
    next: int = 0                 # index of the call to run next
    history: list[int] = field(default_factory=list)

    def next_arrival(self, now: float) -> float:
        """When the next call arrives, given that the previous one ended at `now`
        (the start of the simulation for a first call)."""
        call = self.calls[self.next]
        rel = now + call.wait
        return rel if call.arrival is None else max(call.arrival, rel)

    def branch(self, suffix: str) -> Session:
        """A fork's branch: continues from the same call, its own history."""
        return Session(f"{self.name}.{suffix}", self.calls, self.next)


def extend_with_fresh(new_tokens: Callable[[], list[int]]) -> PromptFn:
    """Prompt = history + new tokens (a turn that appends a tool result)."""
    return lambda history: history + new_tokens()


def fixed(tokens: Callable[[], list[int]]) -> PromptFn:
    """Prompt independent of history (a trace request carries its own ids)."""
    return lambda history: tokens()
