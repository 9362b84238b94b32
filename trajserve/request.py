"""Request state machine.

    WAITING --admit--> RUNNING --finish--> FINISHED_*
       ^                  |
       +---- preempt -----+   (blocks freed, num_computed_tokens reset: recompute)

Token layout of a request; the scheduler only moves num_computed_tokens:

    |<------------- all_token_ids (prompt + outputs) ------------->|
    |<--- num_computed_tokens (KV in the cache) --->|<- to compute ->|

A step computes a chunk of the remainder; when the chunk reaches the end, the
last row's logits are sampled and one token is appended.
"""
from __future__ import annotations

import enum
import time
from dataclasses import dataclass, field
from typing import Any

from trajserve.config import PRIORITY_RANGE
from trajserve.kv.scope import CacheScope
from trajserve.sampling import SamplingParams


class RequestStatus(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    PREEMPTED = "preempted"
    FINISHED_STOPPED = "stop"
    FINISHED_LENGTH = "length"
    FINISHED_ABORTED = "abort"

    @property
    def finished(self) -> bool:
        return self.value in ("stop", "length", "abort")


@dataclass(slots=True)
class Request:
    request_id: str
    prompt_token_ids: list[int]
    sampling_params: SamplingParams
    # Hard cap on prompt + output tokens: min(max_model_len, pool capacity),
    # so a lone request can always finish.
    max_total_tokens: int
    eos_token_ids: frozenset[int] = frozenset()
    arrival_time: float = field(default_factory=time.monotonic)
    all_token_ids: list[int] = field(default_factory=list)
    num_computed_tokens: int = 0
    status: RequestStatus = RequestStatus.WAITING
    stop_reason: int | str | None = None
    num_preemptions: int = 0
    cache_salt: str | None = None  # tenant: requests share cached state only within a salt
    # Scheduling (engine/scheduler.py): lower priority values run first; the
    # program (a session, a conversation) whose attained service orders it
    # under --scheduling program (None: the request is its own program).
    priority: int = 0
    program: str | None = None
    num_cached_tokens: int = 0  # prompt tokens served from the prefix cache at first admission
    # Timing (monotonic seconds): TTFT and inter-token times.
    first_token_time: float | None = None
    last_token_time: float | None = None
    inter_token_times: list[float] = field(default_factory=list)
    # SamplingParams.prompt_logprobs, on the first sequence of a request: per
    # prompt position, (logprob of that token given those before, top-k, rank);
    # position 0 has none. Filled as the prefill's chunks run (model_runner).
    prompt_logprobs: list[tuple[float, dict[int, float], int] | None] | None = None
    # Every prompt position has its entry: from then on (a recompute after a
    # preemption) the prompt may come from the prefix cache like any other.
    prompt_logprobs_done: bool = False
    # Structured output: the llguidance matcher, at the end of the output so
    # far (the sampler masks with it and advances it).
    matcher: Any = None
    # Speculative decoding: draft tokens verified, and accepted (engine/scheduler.py).
    num_draft_tokens: int = 0
    num_accepted_draft_tokens: int = 0
    # LoRA: the adapter its rows run (lora/adapter.py LoRAAdapter), None for the base model.
    lora: Any = None
    # The namespace its blocks live in: its salt and adapter (kv/scope.py); both are fixed at construction.
    cache_scope: CacheScope = field(init=False, repr=False)

    def __post_init__(self) -> None:
        if not self.all_token_ids:
            self.all_token_ids = list(self.prompt_token_ids)
        self.cache_scope = CacheScope.of(self.cache_salt, self.lora)

    @property
    def num_prompt_tokens(self) -> int:
        return len(self.prompt_token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_token_ids)

    @property
    def output_token_ids(self) -> list[int]:
        return self.all_token_ids[self.num_prompt_tokens:]

    @property
    def num_output_tokens(self) -> int:
        return len(self.all_token_ids) - len(self.prompt_token_ids)

    @property
    def ttft(self) -> float | None:
        if self.first_token_time is None:
            return None
        return self.first_token_time - self.arrival_time

    def append_token(self, token: int, now: float) -> None:
        self.all_token_ids.append(token)
        if self.first_token_time is None:
            self.first_token_time = now
        else:
            self.inter_token_times.append(now - self.last_token_time)
        self.last_token_time = now

    def check_stop(self, matcher: bool = True) -> RequestStatus | None:
        """Token-level stop conditions (stop strings are checked on text by the
        engine, which owns the detokenizer). matcher=False: the structured
        output's state is past this token (an accepted draft token before
        the step's last; verification ended the round where it completed)."""
        sp = self.sampling_params
        last = self.all_token_ids[-1]
        if not sp.ignore_eos and last in self.eos_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if last in sp.stop_token_ids:
            self.stop_reason = last
            return RequestStatus.FINISHED_STOPPED
        if matcher and self.matcher is not None and (self.matcher.is_stopped() or self.matcher.is_error()):
            # The constraint is complete (ignore_eos kept the request going
            # past the end it allowed), or broken: nothing more can follow.
            self.stop_reason = self.matcher.get_error() or None
            return RequestStatus.FINISHED_STOPPED
        if self.num_output_tokens >= sp.max_tokens or self.num_tokens >= self.max_total_tokens:
            return RequestStatus.FINISHED_LENGTH
        return None


def check_priority(priority: object) -> int:
    """A request's priority: an integer in PRIORITY_RANGE (ValueError naming
    the field and the range otherwise; a bool is not a priority)."""
    lo, hi = PRIORITY_RANGE
    if not isinstance(priority, int) or isinstance(priority, bool) or not lo <= priority <= hi:
        raise ValueError(f"priority must be an integer in [{lo}, {hi}] (lower runs first), got {priority!r}")
    return priority
