"""Sampler: logits -> next token per request.

Greedy rows are one vectorized argmax. Random rows use a per-request
torch.Generator (seeded from SamplingParams.seed when given), so a seeded
request draws the same tokens whatever else is in the batch. Logit bias and
the repetition / frequency / presence penalties change a row before either
(vLLM's order), then a structured output's mask sets the tokens it does
not accept to -inf (trajserve/structured.py); logprobs are the model's
own, before all of them (vLLM's default).
"""
from __future__ import annotations

import zlib
from typing import Any, NamedTuple

import numpy as np
import torch

from trajserve.sampling import SamplingParams


class RowContext(NamedTuple):
    """What a row's logit changes need beyond its params."""
    token_ids: list[int]   # prompt + output so far
    num_prompt: int
    matcher: Any = None    # structured output (llguidance.LLMatcher), advanced here


def blocked_tokens(matchers: list, vocab_size: int) -> torch.Tensor:
    """bool [len(matchers), vocab_size]: the tokens each structured-output
    matcher does not accept next. One unpack and one tensor for all the rows:
    per row, small numpy / torch calls on a 49k vocabulary cost more than the
    mask itself."""
    packed = np.stack([np.frombuffer(m.compute_bitmask(), dtype=np.uint8) for m in matchers])
    bits = np.unpackbits(packed, axis=1, bitorder="little")[:, :vocab_size]
    if bits.shape[1] < vocab_size:  # ids past the matcher's vocabulary are never allowed
        bits = np.pad(bits, ((0, 0), (0, vocab_size - bits.shape[1])))
    return torch.from_numpy(bits == 0)


def filter_logits(logits: torch.Tensor, sp: SamplingParams) -> torch.Tensor:
    """Temperature, then top-k, then top-p (nucleus) on one row of float32 logits."""
    logits = logits / sp.temperature
    if 0 < sp.top_k < logits.shape[-1]:
        kth = torch.topk(logits, sp.top_k).values[-1]
        logits = logits.masked_fill(logits < kth, float("-inf"))
    if sp.top_p < 1.0:
        sorted_logits, order = torch.sort(logits, descending=True)
        cum = sorted_logits.softmax(-1).cumsum(-1)
        # Keep the smallest prefix whose mass reaches top_p (always >= 1 token).
        drop_sorted = (cum - sorted_logits.softmax(-1)) >= sp.top_p
        drop = torch.zeros_like(drop_sorted).scatter(0, order, drop_sorted)
        logits = logits.masked_fill(drop, float("-inf"))
    return logits


def adjust_logits(row: torch.Tensor, sp: SamplingParams, token_ids: list[int], num_prompt: int) -> torch.Tensor:
    """One row's logits after logit_bias, then the repetition penalty (tokens
    of the prompt and the output), then frequency and presence (the output's
    tokens: logit -= frequency * count + presence)."""
    row = row.clone()
    if sp.logit_bias:
        row.index_add_(0, torch.tensor(list(sp.logit_bias), dtype=torch.long),
                       torch.tensor(list(sp.logit_bias.values()), dtype=row.dtype))
    if sp.repetition_penalty != 1.0 and token_ids:
        seen = torch.tensor(token_ids, dtype=torch.long).unique()
        v = row[seen]
        row[seen] = torch.where(v > 0, v / sp.repetition_penalty, v * sp.repetition_penalty)
    out = token_ids[num_prompt:]
    if (sp.frequency_penalty or sp.presence_penalty) and out:
        ids, counts = torch.tensor(out, dtype=torch.long).unique(return_counts=True)
        row[ids] -= sp.frequency_penalty * counts.to(row.dtype) + sp.presence_penalty
    return row


def token_logprobs(logits: torch.Tensor, token_ids: list[int], k: int,
                   with_rank: bool = False) -> list[tuple]:
    """Rows of float32 logits scored against the token each one is followed
    by: (that token's logprob, the top-k {token: logprob}[, its rank, 1 = the
    likeliest]) per row -- the model's own distribution."""
    lp = logits.log_softmax(-1)
    chosen = lp.gather(1, torch.tensor(token_ids, dtype=torch.long)[:, None])
    if k:
        top = torch.topk(lp, k)
        alts = [dict(zip(i, v)) for i, v in zip(top.indices.tolist(), top.values.tolist())]
    else:
        alts = [{} for _ in token_ids]
    cols = [chosen[:, 0].tolist(), alts]
    if with_rank:
        cols.append(((lp > chosen).sum(1) + 1).tolist())
    return list(zip(*cols))


class Sampler:
    def __init__(self, seed: int = 0) -> None:
        self._seed = seed
        self._generators: dict[str, torch.Generator] = {}

    def _generator(self, request_id: str, sp: SamplingParams) -> torch.Generator:
        g = self._generators.get(request_id)
        if g is None:
            g = torch.Generator()
            # crc32, not hash(): str hashes change per process (PYTHONHASHSEED),
            # and the engine seed must give the same draws in every run.
            g.manual_seed(sp.seed if sp.seed is not None else zlib.crc32(f"{self._seed}:{request_id}".encode()))
            self._generators[request_id] = g
        return g

    def release(self, request_id: str) -> None:
        self._generators.pop(request_id, None)

    def sample(self, logits: torch.Tensor, request_ids: list[str], params: list[SamplingParams],
               contexts: list[RowContext | None] | None = None,
               ) -> tuple[list[int], list[tuple[float, dict[int, float]] | None]]:
        """logits: float32 [N, vocab] on any device. contexts[i]: what row i
        needs if its params adjust logits or it has a structured output (whose
        matcher takes the chosen token here). Returns tokens and, for rows
        that asked, (logprob of the chosen token, top-k {token: logprob})."""
        logits = logits.cpu()
        contexts = contexts or [None] * len(params)
        adjusted = [i for i, sp in enumerate(params) if sp.adjusts_logits]
        guided = [i for i, ctx in enumerate(contexts) if ctx is not None and ctx.matcher is not None]
        # `logits` stay the model's (logprobs below); the choice is made on a copy.
        chosen = logits.clone() if adjusted or guided else logits
        for i in adjusted:
            ctx = contexts[i]
            chosen[i] = adjust_logits(logits[i], params[i], *(ctx[:2] if ctx is not None else ([], 0)))
        if guided:
            rows = torch.tensor(guided)
            blocked = blocked_tokens([contexts[i].matcher for i in guided], logits.shape[-1])
            chosen[rows] = chosen[rows].masked_fill_(blocked, float("-inf"))
        tokens = chosen.argmax(dim=-1).tolist()
        for i, (rid, sp) in enumerate(zip(request_ids, params)):
            if sp.greedy:
                continue
            probs = filter_logits(chosen[i], sp).softmax(-1)
            if not bool(torch.isfinite(probs).all()):
                # Every token masked (a constraint in error): nothing to draw
                # from; the argmax stands and the constraint ends the request.
                # multinomial would raise, and stop the whole batch.
                continue
            tokens[i] = int(torch.multinomial(probs, 1, generator=self._generator(rid, sp)))
        logprobs: list[tuple[float, dict[int, float]] | None] = [None] * len(tokens)
        for i, sp in enumerate(params):
            if sp.logprobs is not None:
                logprobs[i] = token_logprobs(logits[i:i + 1], [tokens[i]], sp.logprobs)[0]
        for t, ctx in zip(tokens, contexts):
            if ctx is not None and ctx.matcher is not None:
                ctx.matcher.consume_token(t)
        return tokens, logprobs
