"""Synthetic workloads: agent trajectories and single-turn chat.

Every random draw (arrival gaps, tool-result lengths, tool waits) is made
up front from one seeded numpy Generator, so a workload is the same whatever
the pool size or hardware it is simulated on: a cache-size sweep compares
like with like.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from trajserve.sim.tokens import TokenSource
from trajserve.sim.workload import Call, Session, extend_with_fresh, fixed


def arrival_times(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Cumulative arrivals with gamma gaps, shape = burstiness, mean 1/rate
    (burstiness 1: Poisson; < 1 burstier). rate inf: everything at t = 0."""
    if rate <= 0 or burstiness <= 0:
        raise ValueError(f"rate and burstiness must be > 0, got rate={rate}, burstiness={burstiness}")
    if math.isinf(rate):
        return np.zeros(n)
    gaps = rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)
    gaps[0] = 0.0  # the first client starts the clock
    return np.cumsum(gaps)


def wait_sampler(spec: str) -> Callable[[np.random.Generator, int], np.ndarray]:
    """Tool-wait distribution: 'exp:MEAN', 'const:S', 'uniform:A,B',
    'lognormal:MEDIAN,SIGMA' (seconds), or '0'."""
    name, _, args = spec.partition(":")
    try:
        vals = [float(v) for v in args.split(",")] if args else []
    except ValueError:
        raise ValueError(f"tool wait {spec!r}: numbers expected after ':'") from None
    if name in ("0", "none") and not vals:
        return lambda rng, n: np.zeros(n)
    shapes = {"exp": 1, "const": 1, "uniform": 2, "lognormal": 2}
    if name not in shapes or len(vals) != shapes[name] or any(v < 0 for v in vals):
        raise ValueError(f"tool wait {spec!r}: use exp:MEAN, const:S, uniform:A,B, lognormal:MEDIAN,SIGMA "
                         "(seconds, >= 0) or 0")
    if name == "exp":
        return lambda rng, n: rng.exponential(vals[0], size=n)
    if name == "const":
        return lambda rng, n: np.full(n, vals[0])
    if name == "uniform":
        lo, hi = sorted(vals)
        return lambda rng, n: rng.uniform(lo, hi, size=n)
    return lambda rng, n: rng.lognormal(math.log(max(vals[0], 1e-9)), vals[1], size=n)


@dataclass(slots=True)
class AgentSpec:
    trajectories: int = 64
    turns: int = 10
    preamble_tokens: int = 4096       # system prompt + tool definitions, shared by every trajectory
    task_tokens: int = 64             # each trajectory's own task in turn 1
    tool_min_tokens: int = 200        # tool result appended before turns 2..T
    tool_max_tokens: int = 2000
    reply_tokens: int = 200           # model output per turn
    tool_wait: str = "exp:5"          # pause between a reply and the next turn
    branching: int = 1                # sequences a branch turn forks into (Scheduler.fork)
    branch_turn: int = 2
    rate: float = math.inf            # trajectory starts per second
    burstiness: float = 1.0
    seed: int = 0

    def validate(self) -> None:
        if self.trajectories < 1 or self.turns < 1:
            raise ValueError("trajectories and turns must be >= 1")
        if not 0 <= self.tool_min_tokens <= self.tool_max_tokens:
            raise ValueError(f"tool result range [{self.tool_min_tokens}, {self.tool_max_tokens}] is empty")
        if self.preamble_tokens < 0 or self.task_tokens < 0 or self.preamble_tokens + self.task_tokens < 1:
            raise ValueError("the first prompt needs at least one token (preamble + task)")
        if self.reply_tokens < 1:
            raise ValueError(f"reply tokens must be >= 1, got {self.reply_tokens}")
        if self.branching < 1 or not 1 <= self.branch_turn:
            raise ValueError("branching and branch turn must be >= 1")
        if self.branching > 1 and self.branch_turn > self.turns:
            raise ValueError(f"branch turn {self.branch_turn} is past the last turn ({self.turns}): "
                             "no trajectory would fork")


def agent_sessions(spec: AgentSpec, tokens: TokenSource) -> list[Session]:
    spec.validate()
    rng = np.random.default_rng(spec.seed)
    starts = arrival_times(spec.trajectories, spec.rate, spec.burstiness, rng)
    T = spec.turns
    tool = rng.integers(spec.tool_min_tokens, spec.tool_max_tokens + 1, size=(spec.trajectories, T))
    waits = wait_sampler(spec.tool_wait)(rng, spec.trajectories * T).reshape(spec.trajectories, T)
    preamble = tokens.fresh(spec.preamble_tokens)  # one copy: every trajectory starts with it

    def first_prompt() -> list[int]:
        return preamble + tokens.fresh(spec.task_tokens)

    def tool_result(n: int) -> Callable[[], list[int]]:
        return lambda: tokens.fresh(n)

    sessions = []
    for i in range(spec.trajectories):
        calls = [Call(fixed(first_prompt), spec.reply_tokens, arrival=float(starts[i]), turn=1)]
        for t in range(2, T + 1):
            calls.append(Call(extend_with_fresh(tool_result(int(tool[i, t - 1]))), spec.reply_tokens,
                              wait=float(waits[i, t - 1]), turn=t))
        if spec.branching > 1 and spec.branch_turn <= T:
            calls[spec.branch_turn - 1].fork = spec.branching - 1
        sessions.append(Session(f"traj{i}", calls))
    return sessions


@dataclass(slots=True)
class ChatSpec:
    num_requests: int = 1000
    input_len: int = 1024
    output_len: int = 256
    prefix_len: int = 0               # a system prompt every request shares
    rate: float = math.inf
    burstiness: float = 1.0
    seed: int = 0


def chat_sessions(spec: ChatSpec, tokens: TokenSource) -> list[Session]:
    """Independent single-turn requests (open loop)."""
    if spec.num_requests < 1 or spec.input_len < 1 or spec.output_len < 1:
        raise ValueError("chat needs num_requests, input_len and output_len >= 1")
    if not 0 <= spec.prefix_len < spec.input_len:
        raise ValueError(f"prefix length must be in [0, input_len), got {spec.prefix_len}")
    rng = np.random.default_rng(spec.seed)
    starts = arrival_times(spec.num_requests, spec.rate, spec.burstiness, rng)
    prefix = tokens.fresh(spec.prefix_len)
    own = spec.input_len - spec.prefix_len
    prompt = fixed(lambda: prefix + tokens.fresh(own))
    return [Session(f"chat{i}", [Call(prompt, spec.output_len, arrival=float(t), turn=1)])
            for i, t in enumerate(starts)]
