"""The "suffix" draft source: n-grams of finished sequences, per cache_salt.

Prompt lookup (context_index.py) sees one sequence. An agent's sibling
branches (fork), its earlier turns sent as separate requests, and other
agents of the same tenant repeat each other too: a branch retried after a
failed test rewrites the file the first branch wrote. Every finished
sequence's tokens (prompt and output) are indexed here under its salt and a
lookup never crosses salts (a tenant's text must not steer another's
drafts: drafts cannot change output, but their acceptance would leak timing).

Bounded: the oldest sequences leave once the store holds more than
max_tokens; their n-grams go unless a newer sequence re-pointed them.
"""
from __future__ import annotations

from collections import deque

from trajserve.speculative.context_index import ngram_sizes, ngrams


class SuffixStore:
    def __init__(self, min_n: int = 2, max_n: int = 4, max_tokens: int = 1 << 20) -> None:
        self.sizes = ngram_sizes(min_n, max_n)
        self.max_tokens = max_tokens
        # (salt, n-gram) -> (the sequence's tokens, position after the n-gram)
        self.table: dict[tuple, tuple[list[int], int]] = {}
        self.seqs: deque[tuple[str | None, list[int]]] = deque()
        self.num_tokens = 0

    def add(self, tokens: list[int], salt: str | None) -> None:
        tokens = list(tokens)  # the caller's list may change (a later turn)
        self.table.update(((salt, g), (tokens, p)) for g, p in ngrams(tokens, self.sizes))
        self.seqs.append((salt, tokens))
        self.num_tokens += len(tokens)
        while self.num_tokens > self.max_tokens and len(self.seqs) > 1:
            self._drop_oldest()

    def _drop_oldest(self) -> None:
        salt, tokens = self.seqs.popleft()
        self.num_tokens -= len(tokens)
        t = self.table
        for g, _ in ngrams(tokens, self.sizes):
            hit = t.get((salt, g))
            if hit is not None and hit[0] is tokens:
                del t[(salt, g)]

    def lookup(self, tokens: list[int], salt: str | None, k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed tokens' longest suffix (n-gram) in a
        stored sequence of the same salt, and that n (0: none)."""
        L = len(tokens)
        for n in self.sizes:
            if L < n:
                continue
            hit = self.table.get((salt, tuple(tokens[L - n:])))
            if hit is not None:
                seq, p = hit
                return seq[p:p + k], n
        return [], 0
