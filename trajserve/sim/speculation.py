"""Speculative decoding in the simulator (inference-optimization 8.5.2).

The engine's own proposer and scheduler (speculative/proposer.py,
engine/scheduler.py) run unchanged: each decoding sequence gets a draft of
m tokens, a chunk of 1 + m rows the cost model prices, and the scheduler's
update keeps the accepted tokens and rolls the rest back. What the
simulator cannot have is the text, so the draft's content is a placeholder
and its acceptance is drawn: each draft token is accepted with probability
a given the ones before it (a constant profile, 8.5.2), seeded. a is a
parameter, e.g. the acceptance rate `trajserve bench spec --json` measured
on the engine (cases[].acceptance_rate).

m is fixed (--spec-draft M), or `auto`: the engine's marginal rule (8.5.4)
on the simulated step times with the given a.
"""
from __future__ import annotations

import random

from trajserve.request import Request
from trajserve.speculative.proposer import DraftProposer, SpecConfig


class SimDrafts(DraftProposer):
    def __init__(self, accept: float, max_draft: int, adaptive: bool, seed: int = 0) -> None:
        if not 0.0 <= accept <= 1.0:
            raise ValueError(f"--spec-accept must be in [0, 1], got {accept}")
        super().__init__(SpecConfig("ngram", max_draft, adaptive=adaptive))
        self.accept = accept
        self.rng = random.Random(seed)

    def propose(self, req: Request, limit: int) -> list[int]:
        m = min(limit, self.config.max_draft)
        if self.config.adaptive:
            m = self._length(self.accept, m)
        self._rows += max(m, 0)
        return [0] * m  # placeholders: the executor draws which are accepted

    def draw_accepted(self, drafted: int) -> int:
        """How many of `drafted` tokens the target accepts: each with
        probability a given the ones before it."""
        k = 0
        while k < drafted and self.rng.random() < self.accept:
            k += 1
        return k

    def release(self, req: Request) -> None:
        pass  # no per-sequence state
