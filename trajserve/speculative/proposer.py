"""What each decoding sequence drafts this step, and how many tokens.

Sources (8.5.3), no second model: the sequence's own context (prompt
lookup, context_index.py) and, with method "suffix", finished sequences of
the same cache_salt (suffix_store.py); the longer n-gram match wins.

Length (8.5.4's marginal rule, one implementation: plan/speculation.py): a
draft of m tokens whose tokens are each accepted with probability a (given
the ones before) outputs E[N_m] = 1 + a + ... + a^m; the m-th token adds
dN = a^m output and one row, whose cost dT is measured (step_cost.py: the
step time at this many rows and one more). It is drafted while dT / dN <
T / N, with T / N the step's time per output token without drafts. At
batch 1 a step is a pass over the weights, dT << T, and long drafts pay
even at modest a; as the batch grows T / N falls toward dT and drafts
shrink to what is almost surely accepted -- speculation backs off where a
step is compute-bound.

a is measured per sequence from its own rounds (decayed counts of accepted
and rejected draft tokens). A sequence whose drafts keep failing stops
drafting (a^1 < b / (T / N)); its counts drift back toward the prior while
it does not draft, so it probes again later (an agent goes from free text
to copying a file within one reply).
"""
from __future__ import annotations

from dataclasses import dataclass

from trajserve.request import Request
from trajserve.plan.speculation import marginal_output
from trajserve.speculative.context_index import ContextIndex
from trajserve.speculative.step_cost import StepCost
from trajserve.speculative.suffix_store import SuffixStore

METHODS = ("off", "ngram", "suffix")

# Acceptance counts a sequence starts from (a = 0.6) and drifts back to.
_PRIOR_ACCEPTED, _PRIOR_REJECTED = 1.5, 1.0
_DECAY = 0.9       # weight of a sequence's past rounds against its newest
_RELAX = 0.97      # per step without a draft: toward the prior


@dataclass(slots=True)
class SpecConfig:
    method: str = "ngram"
    max_draft: int = 8          # tokens per sequence per step at most (--num-speculative-tokens)
    min_n: int = 2              # n-gram sizes matched
    max_n: int = 4
    adaptive: bool = True       # False: always the longest draft found (tests, and to measure)

    def validate(self) -> None:
        if self.method not in METHODS[1:]:
            raise ValueError(f"speculative method must be one of {', '.join(METHODS)}, got {self.method!r}")
        if not 1 <= self.max_draft <= 64:
            raise ValueError(f"num_speculative_tokens must be in [1, 64], got {self.max_draft}")


@dataclass(slots=True)
class _SeqState:
    index: ContextIndex
    accepted: float = _PRIOR_ACCEPTED
    rejected: float = _PRIOR_REJECTED

    @property
    def accept(self) -> float:
        return self.accepted / (self.accepted + self.rejected)


class DraftProposer:
    def __init__(self, config: SpecConfig) -> None:
        config.validate()
        self.config = config
        self.cost = StepCost()
        self.store = SuffixStore(config.min_n, config.max_n) if config.method == "suffix" else None
        self._seqs: dict[str, _SeqState] = {}
        self._per_token = 0.0  # T / N of this step without drafts (seconds)
        self._rows = 0         # rows this step has so far (drafts planned included)
        # Counters (engine metrics, /metrics, bench spec).
        self.num_drafts = 0           # sequence-steps that verified a draft
        self.num_draft_tokens = 0
        self.num_accepted_tokens = 0

    # --------------------------------------------------------------- per step
    def begin_step(self, num_decodes: int, num_prefill_tokens: int) -> None:
        """The step's rows so far and its time per output token without
        drafts, T / N, from the measured step cost."""
        self._rows = num_decodes + num_prefill_tokens
        self._per_token = self.cost.time(self._rows) / max(1, num_decodes)

    def propose(self, req: Request, limit: int) -> list[int]:
        """Draft tokens for req's next positions (at most limit), or []."""
        if limit <= 0:
            return []
        st = self._seqs.get(req.request_id)
        if st is None:
            st = self._seqs[req.request_id] = _SeqState(ContextIndex(self.config.min_n, self.config.max_n))
        m = min(limit, self.config.max_draft)
        if self.config.adaptive:
            m = self._length(st.accept, m)
            if m == 0:
                st.accepted = _RELAX * st.accepted + (1 - _RELAX) * _PRIOR_ACCEPTED
                st.rejected = _RELAX * st.rejected + (1 - _RELAX) * _PRIOR_REJECTED
                return []
        tokens = req.all_token_ids
        draft, n = st.index.lookup(tokens, m)
        if self.store is not None:
            other, n2 = self.store.lookup(tokens, req.cache_scope, m)
            if n2 > n:
                draft = other
        self._rows += len(draft)  # the next sequence's rows cost what they add on top
        return draft

    def _length(self, a: float, limit: int) -> int:
        """The longest m <= limit with dT / dN < T / N for every draft token
        up to it (8.5.4): dT the measured cost of one more row on this
        step, dN of the m-th token = a^m (plan.speculation)."""
        if not self.cost.measured:
            return limit  # the first steps measure the cost
        m = 0
        while m < limit and self.cost.added(self._rows + m, 1) < marginal_output(a, m + 1) * self._per_token:
            m += 1
        return m

    def observe(self, req: Request, drafted: int, accepted: int) -> None:
        """A verified round: `accepted` of `drafted` tokens agreed."""
        self.num_drafts += 1
        self.num_draft_tokens += drafted
        self.num_accepted_tokens += accepted
        st = self._seqs.get(req.request_id)
        if st is not None:
            st.accepted = _DECAY * st.accepted + accepted
            st.rejected = _DECAY * st.rejected + (accepted < drafted)

    def record_step(self, rows: int, seconds: float) -> None:
        """A step of decodes and verifications only: rows, executor time."""
        self.cost.record(rows, seconds)

    def release(self, req: Request) -> None:
        """req is done: its index goes; with "suffix" its tokens feed the store."""
        self._seqs.pop(req.request_id, None)
        if self.store is not None and req.num_output_tokens:
            self.store.add(req.all_token_ids, req.cache_scope)

    # ----------------------------------------------------------------- report
    def metrics(self) -> dict:
        d, acc = self.num_draft_tokens, self.num_accepted_tokens
        return {"method": self.config.method, "drafts": self.num_drafts, "draft_tokens": d,
                "accepted_tokens": acc, "acceptance_rate": acc / d if d else None,
                # tokens a verified round outputs on average: its accepted drafts + the target's own
                "mean_accepted_length": 1 + acc / self.num_drafts if self.num_drafts else None,
                # the measured step cost the length rule reads: rows -> ms
                "step_ms": {r: round(1e3 * self.cost.times[r], 3) for r in self.cost.rows}}


def resolve_speculative(choice: str, c_kernels: bool) -> tuple[str, str]:
    """What --speculative runs, and why. auto drafts where verification
    cannot change a token: on the C kernels a row computed in a verify chunk
    is the same bits as the same row decoded (docs/architecture.md), so
    greedy and seeded output are those of plain decoding; torch's kernels
    promise no such thing."""
    if choice != "auto":
        return choice, "--speculative"
    if c_kernels:
        return "ngram", ("auto: drafts from the context, verified on the C kernels, whose verified rows are "
                         "the same bits as decode steps")
    return "off", "auto: the torch path does not compute a verified row the same bits as a decode step"
