"""Verification (8.5.1): the target's token at each drafted position, kept
while it equals the draft.

A sequence with a draft d_1..d_k ran k + 1 rows: row j's logits are the
target's next-token distribution p_j after the context and d_1..d_j. The
sampler draws (or, greedy, takes the argmax of) row 0 as it would in a plain
decode step -- the executor has done that (round 0). While the token drawn
from row j equals d_{j+1}, it is accepted and row j + 1 is drawn; the first
token that differs, or the one drawn from row k, ends the round. So the
output is what decoding one token a step gives:

* greedy: the same argmax on the same logits (the C kernels compute a row
  the same bits in a chunk as in a decode step: docs/architecture.md);
* sampling: each position is drawn from p_j exactly as without a draft.
  For a point-mass draft (q = delta_d) this *is* 8.5.1's rejection rule:
  d is accepted with probability min(1, p(d) / q(d)) = p(d), and on a
  rejection the token is distributed as the residual [p - q]+ renormalised,
  i.e. p restricted to tokens != d -- which is what a draw from p that
  came out != d is. The per-request generator makes one draw per output
  token in the same order as without speculation, so a seeded request gives
  the same text with and without it wherever the logits are the same bits.

Penalties, logit_bias, structured-output masks and logprobs see each row's
context (the tokens accepted before it) through the sampler itself; the
matcher consumes each accepted token as the sampler chooses it, and a
round ends at the token that completes (or breaks) the constraint.
"""
from __future__ import annotations

import torch

from trajserve.model.sampler import RowContext, Sampler


def _ends(req) -> bool:
    """The structured output is complete (or broken) after the token the
    sampler just chose: the request ends there, as a decode step would end it."""
    m = req.matcher
    return m is not None and (m.is_stopped() or m.is_error())


def _plain(req) -> bool:
    """Greedy with nothing that needs the sampler per row: one argmax."""
    sp = req.sampling_params
    return sp.greedy and not sp.adjusts_logits and req.matcher is None and sp.logprobs is None


def verify_drafts(sampler: Sampler, logits: torch.Tensor, first: list[int], ids: list[str], by_id: dict,
                  drafts: dict[str, list[int]], tokens: list[int], logprobs: list,
                  ) -> tuple[dict[str, list[int]], dict[str, list]]:
    """Round 0 already drew tokens[i] from row first[i] of sequence ids[i].
    Continues each drafted sequence's round: tokens[i] (and logprobs[i])
    become its last token; returns the accepted draft tokens per sequence
    and their logprobs (None entries where none were asked)."""
    accepted: dict[str, list[int]] = {}
    accepted_lps: dict[str, list] = {}
    slow = []
    for i, rid in enumerate(ids[:len(first)]):
        draft = drafts.get(rid)
        if not draft or tokens[i] != draft[0]:
            continue
        req = by_id[rid]
        if _ends(req):
            continue
        if not _plain(req):
            slow.append(i)
            continue
        # Greedy: the argmax of rows 1..k at once; accept while row j-1's equals d_j.
        row = first[i]
        best = logits[row + 1:row + 1 + len(draft)].argmax(-1).tolist()
        got = [draft[0]]
        for j in range(1, len(draft) + 1):
            t = best[j - 1]
            if j < len(draft) and t == draft[j]:
                got.append(t)
                continue
            tokens[i] = t
            break
        accepted[rid] = got
        accepted_lps[rid] = [None] * len(got)
    j = 1
    alive = slow
    while alive:
        for i in alive:
            accepted.setdefault(ids[i], []).append(tokens[i])
            accepted_lps.setdefault(ids[i], []).append(logprobs[i])
        reqs = [by_id[ids[i]] for i in alive]
        params = [r.sampling_params for r in reqs]
        contexts = [RowContext(r.all_token_ids + accepted[r.request_id], r.num_prompt_tokens, r.matcher)
                    if p.adjusts_logits or r.matcher is not None else None for r, p in zip(reqs, params)]
        t, lp = sampler.sample(logits[[first[i] + j for i in alive]], [ids[i] for i in alive], params, contexts)
        for i, ti, li in zip(alive, t, lp):
            tokens[i], logprobs[i] = ti, li
        alive = [i for i in alive if j < len(drafts[ids[i]]) and tokens[i] == drafts[ids[i]][j]
                 and not _ends(by_id[ids[i]])]
        j += 1
    return accepted, accepted_lps
