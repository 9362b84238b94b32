"""Prompt lookup over one sequence: its last n tokens, found earlier in its
own context, propose what followed them there (8.5.3's draft from the
context; vLLM's and SGLang's n-gram method).

An agent's reply repeats its context: a file it read and now rewrites, a
path, a test name, its own earlier call. The index maps every n-gram
(n = min_n .. max_n) to the position after its latest occurrence that has a
token after it, and grows with the sequence, so a lookup costs one dict
probe per n whatever the context length (a scan of 3,000 tokens per
sequence per step would cost more than the drafting saves at batch 8).
The longest n that matches wins (a longer match predicts better); within
one n the latest occurrence wins (the most recent copy of a file is the
one being edited); a match that runs into the sequence's end continues
periodically (continuation()).
"""
from __future__ import annotations

from collections.abc import Iterator


def ngram_sizes(min_n: int, max_n: int) -> tuple[int, ...]:
    """The n-gram sizes a source matches, longest first."""
    if not 1 <= min_n <= max_n:
        raise ValueError(f"n-gram sizes must satisfy 1 <= min_n <= max_n, got {min_n}, {max_n}")
    return tuple(range(max_n, min_n - 1, -1))


def ngrams(tokens: list[int], sizes: tuple[int, ...], start: int = 0) -> Iterator[tuple[tuple[int, ...], int]]:
    """(n-gram, the position after it) for every n-gram of tokens ending at
    position start or later that has a token after it."""
    for i in range(start, len(tokens) - 1):
        for n in sizes:
            if i + 1 >= n:
                yield tuple(tokens[i + 1 - n:i + 1]), i + 1


class ContextIndex:
    __slots__ = ("sizes", "table", "upto")

    def __init__(self, min_n: int = 2, max_n: int = 4) -> None:
        self.sizes = ngram_sizes(min_n, max_n)
        self.table: dict[tuple[int, ...], int] = {}
        self.upto = 0  # n-grams ending before this position are indexed

    def extend(self, tokens: list[int]) -> None:
        """Index the n-grams of tokens that have a token after them."""
        self.table.update(ngrams(tokens, self.sizes, self.upto))
        self.upto = max(self.upto, len(tokens) - 1)

    def lookup(self, tokens: list[int], k: int) -> tuple[list[int], int]:
        """Up to k tokens that followed the longest earlier occurrence of
        tokens' last n tokens, and that n (0: no match)."""
        self.extend(tokens)
        L = len(tokens)
        for n in self.sizes:
            if L < n:
                continue
            p = self.table.get(tuple(tokens[L - n:]))
            if p is not None:
                return continuation(tokens, p, k), n
        return [], 0


def continuation(tokens: list[int], p: int, k: int) -> list[int]:
    """k tokens on from position p, where tokens before p repeat the
    sequence's end. A match near the end (a repeating line, a loop) leaves
    fewer than k tokens after p; the sequence then continues with the same
    period L - p, so the draft goes on with its own first tokens."""
    draft = tokens[p:p + k]
    period = len(tokens) - p
    while len(draft) < k:
        draft.append(draft[len(draft) - period])
    return draft
