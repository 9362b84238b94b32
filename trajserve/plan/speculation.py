"""Speculative decoding's arithmetic (inference-optimization 8.5.2-8.5.4).

A round drafts m tokens, verifies them in one target step and outputs N of
them: at least one (the target's own token after a rejection, or the extra
one after a full acceptance). With a_j the chance that draft token j is
accepted given every one before it was (8.5.4):

    E[N_m] = 1 + sum_{j=1..m} prod_{i<=j} a_i         (a constant: 1 + a + ... + a^m, 8.5.2)
    dN_m   = prod_{i<=m} a_i                            the output the m-th draft token adds
    t_spec = sum_r T_r / sum_r N_r                      time per output token over rounds (8.5.2)

and lengthening the draft from m - 1 to m pays only if the time it adds per
token it adds is under the time per token so far (8.5.4's marginal rule):

    dT / dN < T / N.

Times are milliseconds. Arithmetic only: no torch, nothing measured here;
the engine's own draft length choice is to use these functions.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass
from typing import Callable, Sequence


def _profile(accept: float | Sequence[float], m: int) -> list[float]:
    """a_1 .. a_m: a constant, or a profile (its last value repeats past its end)."""
    if m < 0:
        raise ValueError(f"draft length must be >= 0, got {m}")
    a = [float(accept)] * m if isinstance(accept, (int, float)) else [float(x) for x in accept]
    if not a and m:
        raise ValueError("acceptance profile is empty")
    a = (a + [a[-1]] * m)[:m] if a else []
    bad = [x for x in a if not 0.0 <= x <= 1.0]
    if bad:
        raise ValueError(f"acceptance probabilities must be in [0, 1], got {bad[0]}")
    return a


def expected_output(accept: float | Sequence[float], m: int) -> float:
    """E[N_m] = 1 + sum_j prod_{i<=j} a_i: mean tokens a round outputs."""
    total, survive = 1.0, 1.0
    for a in _profile(accept, m):
        survive *= a
        total += survive
    return total


def marginal_output(accept: float | Sequence[float], m: int) -> float:
    """dN = prod_{i<=m} a_i: what the m-th draft token adds to E[N] (0 for m = 0)."""
    return math.prod(_profile(accept, m)) if m else 0.0


def time_per_token(rounds: Sequence[tuple[float, int]]) -> float:
    """t_spec = sum T_r / sum N_r over (T_r, N_r) rounds: total time over
    total tokens, not the mean of each round's T_r / N_r (8.5.2: rounds of
    1.5 ms giving 1 and 5 tokens are 0.5 ms a token, not 0.9)."""
    tokens = sum(n for _, n in rounds)
    if tokens <= 0:
        raise ValueError("rounds output no tokens")
    return sum(t for t, _ in rounds) / tokens


def round_time(verify_ms: float, m: int, *, query_ms: float = 0.0, draft_ms: float = 0.0,
               draft_group: int = 1) -> float:
    """T_m = verify + query + draft_ms per drafted position, positions
    counted in whole groups of draft_group (exercise 8-7's 4-position
    shapes: 26.3 + 3.6 * 4 * ceil(m / 4))."""
    if draft_group < 1:
        raise ValueError(f"draft group must be >= 1, got {draft_group}")
    return verify_ms + query_ms + draft_ms * draft_group * math.ceil(m / draft_group)


@dataclass(frozen=True, slots=True)
class DraftLength:
    m: int
    expected_output: float  # E[N_m]
    round_ms: float  # T_m
    ms_per_token: float  # T_m / E[N_m]
    added_output: float  # dN from m - 1
    added_ms: float  # dT from m - 1
    added_ms_per_token: float | None  # dT / dN (None: dN = 0)
    pays: bool | None  # dT / dN < T / N of m - 1 (None for the shortest length asked)


def draft_lengths(accept: float | Sequence[float], lengths: Sequence[int],
                  round_ms: Callable[[int], float]) -> list[DraftLength]:
    """Each length's E[N], round time and time per token, and against the
    length before it in `lengths` the marginal rule dT / dN < T / N."""
    rows: list[DraftLength] = []
    for m in sorted(set(lengths)):
        n, t = expected_output(accept, m), round_ms(m)
        if rows:
            prev = rows[-1]
            dn, dt = n - prev.expected_output, t - prev.round_ms
            per = dt / dn if dn > 0 else None
            pays = per is not None and per < prev.ms_per_token
        else:
            dn = dt = 0.0
            per, pays = None, None
        rows.append(DraftLength(m, n, t, t / n, dn, dt, per, pays))
    return rows


def best_length(rows: Sequence[DraftLength]) -> DraftLength:
    """The length with the least time per output token."""
    return min(rows, key=lambda r: r.ms_per_token)


def query_budget(verify_ms: float, plain_ms: float, expected: float) -> float:
    """The most a draft's lookup may take and still beat plain decoding:
    verify + q < E[N] * plain  ->  q < E[N] * plain - verify (8.5.2: 8.7 ms
    for E[N] = 1.33, 53.9 ms for 3.05, at 26.26 ms rounds)."""
    return expected * plain_ms - verify_ms


def setup_break_even_tokens(setup_ms: float, plain_ms: float, spec_ms_per_token: float) -> float:
    """Output tokens after which a one-off setup (building the context
    index) is paid back: setup / (plain - spec). inf if speculation is not
    faster."""
    saved = plain_ms - spec_ms_per_token
    return setup_ms / saved if saved > 0 else math.inf


@dataclass(frozen=True, slots=True)
class SpecPlan:
    accept: float | list[float]
    verify_ms: float
    query_ms: float
    draft_ms: float
    draft_group: int
    plain_ms: float
    lengths: list[DraftLength]
    best: int
    query_budget_ms: float  # for the best length
    setup_ms: float
    setup_break_even_tokens: float
    output_tokens: int
    plain_request_s: float
    spec_request_s: float

    def to_dict(self) -> dict:
        return asdict(self)


def plan_speculation(accept: float | Sequence[float], lengths: Sequence[int], verify_ms: float, *,
                     query_ms: float = 0.0, draft_ms: float = 0.0, draft_group: int = 1,
                     plain_ms: float | None = None, setup_ms: float = 0.0, output_tokens: int = 0) -> SpecPlan:
    """Every figure `trajserve plan spec` prints. plain_ms: a plain decode
    step (default: the verify step, which reads the same bytes, 8.5.2)."""
    for name, v in (("verify_ms", verify_ms), ("query_ms", query_ms), ("draft_ms", draft_ms),
                    ("setup_ms", setup_ms)):
        if not (v >= 0 and math.isfinite(v)):
            raise ValueError(f"{name} must be a finite number >= 0, got {v}")
    if not lengths:
        raise ValueError("give at least one draft length")
    if output_tokens < 0:
        raise ValueError(f"output tokens must be >= 0, got {output_tokens}")
    plain = verify_ms if plain_ms is None else plain_ms
    rows = draft_lengths(accept, lengths, lambda m: round_time(verify_ms, m, query_ms=query_ms, draft_ms=draft_ms,
                                                              draft_group=draft_group))
    best = best_length(rows)
    return SpecPlan(
        accept=accept if isinstance(accept, (int, float)) else list(accept), verify_ms=verify_ms,
        query_ms=query_ms, draft_ms=draft_ms, draft_group=draft_group, plain_ms=plain, lengths=rows, best=best.m,
        query_budget_ms=query_budget(best.round_ms - query_ms, plain, best.expected_output),
        setup_ms=setup_ms, setup_break_even_tokens=setup_break_even_tokens(setup_ms, plain, best.ms_per_token),
        output_tokens=output_tokens, plain_request_s=output_tokens * plain / 1000,
        spec_request_s=(setup_ms + output_tokens * best.ms_per_token) / 1000)
