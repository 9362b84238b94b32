"""Token ids for workloads that carry no text.

Two families that never meet, so a cache hit in the simulator is always a
hit the workload meant:
  * hash blocks (traces): ids >= 0. Trace block h of T tokens is the same T
    tokens wherever it appears; different h never share an engine block.
  * fresh tokens (new user/tool text, sampled outputs, private tails): ids
    < 0, each id used once.

Memory: a trace replays ~10^8 prompt tokens. Only the first token of each
engine block (B tokens) carries the block's identity (a "marker" unique to
(h, block index)); the other B - 1 positions hold 1..B-1, which CPython keeps
as shared small ints. Two engine blocks are then equal iff their markers are
equal, and a token list costs one pointer per token, not one int object.
The radix cache compares whole B-token blocks, so this is exact as long as
B divides T (asserted).
"""
from __future__ import annotations

import numpy as np


class TokenSource:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        self._template = list(range(block_size))
        self._next_fresh = -1

    def fresh(self, n: int) -> list[int]:
        """n token ids never returned before (and never equal to a hash block's)."""
        start = self._next_fresh
        self._next_fresh -= n
        return list(range(start, start - n, -1))

    def fresh_one(self) -> int:
        t = self._next_fresh
        self._next_fresh -= 1
        return t

    def reserve(self, n: int) -> int:
        """Take n fresh ids at once: they are start, start - 1, ..., start - n + 1."""
        start = self._next_fresh
        self._next_fresh -= n
        return start

    def hash_prompt(self, hash_ids: list[int], trace_block: int, num_tokens: int) -> list[int]:
        """The prompt of a trace request: its hash blocks, cut to num_tokens
        (Mooncake's last id covers a partial block), then fresh tokens for
        any tail the ids do not cover (Claude Code hashes full blocks only)."""
        B = self.block_size
        if trace_block % B:
            raise ValueError(f"engine block size {B} must divide the trace's block size {trace_block}")
        per = trace_block // B
        covered = len(hash_ids) * trace_block
        toks = self._template * (len(hash_ids) * per)
        if hash_ids:
            ids = np.asarray(hash_ids, dtype=np.int64)
            if ids.min() < 0:
                raise ValueError("trace hash ids must be >= 0")
            toks[0::B] = (ids[:, None] * per + np.arange(per)).ravel().tolist()
        if num_tokens <= covered:
            del toks[num_tokens:]
        else:
            toks.extend(self.fresh(num_tokens - covered))
        return toks
