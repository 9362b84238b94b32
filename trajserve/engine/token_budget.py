"""The step's token budget from the allowed inter-token latency
(inference-optimization 8.2.4's two-step rule; --max-num-batched-tokens auto
with --itl-target-ms).

A running request waits a whole step for its next token, so a step may take
at most the allowed ITL. Step one: that time, less what the step's decodes
cost anyway (t_0, their rows, their pairs over their contexts), is what is
left for new tokens. Step two: converted into tokens of the prefill in
hand, c tokens after h cached cost t_tok c + t_pair (c h + c (c + 1) / 2)
(the step-time model of engine/step_time.py, fitted to this engine's own
steps), so the longer the context a chunk extends, the fewer tokens fit:

    c = (-b + sqrt(b^2 + 4 a s)) / (2 a),   a = t_pair / 2,  b = t_tok + t_pair (h + 1/2),  s = time left

The budget is those c plus the decodes' rows, at least MIN_PREFILL tokens
beyond the rows (a prefill always moves on, even when the decodes alone
take the whole ITL) and at most the ceiling (--max-num-batched-tokens, or
--max-prefill-chunk if lower; AUTO_BUDGET_CEILING under auto). Before the model has seen enough steps:
FALLBACK_BUDGET.
"""
from __future__ import annotations

import math
from collections.abc import Callable
from typing import TYPE_CHECKING

from trajserve.config import AUTO_BUDGET_CEILING
from trajserve.engine.step_time import StepTimeModel

if TYPE_CHECKING:
    from trajserve.request import Request

FALLBACK_BUDGET = 512
MIN_PREFILL = 16


def budget_for_itl(model: StepTimeModel, itl_s: float, rows: int, rows_ctx: int, head_cached: int,
                   ceiling: int = AUTO_BUDGET_CEILING) -> int:
    """Tokens a step may take so that it lasts at most itl_s: `rows` decodes
    over `rows_ctx` tokens of context, and a prefill chunk after
    `head_cached` cached tokens."""
    if not model.ready:
        return min(ceiling, max(FALLBACK_BUDGET, rows + MIN_PREFILL))
    t0, tok, seq, pair = model.coefficients
    left = itl_s - (t0 + (tok + seq) * rows + seq + pair * rows_ctx)
    if left <= 0:
        c = 0.0
    elif pair > 0:
        a, b = pair / 2, tok + pair * (head_cached + 0.5)
        c = (-b + math.sqrt(b * b + 4 * a * left)) / (2 * a)
    else:
        c = left / tok if tok > 0 else ceiling
    return int(min(ceiling, rows + max(MIN_PREFILL, c)))


class ITLBudget:
    """The scheduler's budget rule (Scheduler.budget_rule): each step's
    budget from the requests running now."""

    def __init__(self, scheduler, model: StepTimeModel, itl_s: float, cached: Callable[[Request], int]) -> None:
        """cached(req): the tokens of req's prompt already computed or in
        the prefix cache (DeadlineAdmission.cached: a waiting head is looked
        up once)."""
        self.scheduler, self.model, self.itl_s, self.cached = scheduler, model, itl_s, cached
        self.last = FALLBACK_BUDGET  # the latest step's budget (the start-up line, tests)

    def __call__(self) -> int:
        s = self.scheduler
        decodes = [r for r in s.running if r.num_tokens - r.num_computed_tokens == 1]
        prefill = next((r for r in s.running if r.num_tokens - r.num_computed_tokens > 1),
                       s.waiting[0] if s.waiting else None)
        head = self.cached(prefill) if prefill is not None else 0
        self.last = budget_for_itl(self.model, self.itl_s, len(decodes), sum(r.num_tokens for r in decodes), head,
                                   s.config.max_num_batched_tokens)
        return self.last
