"""Oracle prefix hits: the most block-aligned tokens any cache could have
reused for a request, given every token computed before it (an unbounded
pool, nothing ever evicted). The measured H_prefix is judged against it."""
from __future__ import annotations

from collections.abc import Sequence


class PrefixOracle:
    def __init__(self, block_size: int) -> None:
        self.block_size = block_size
        # (parent block-chain id, block tokens) -> chain id: a trie of every
        # full block ever computed, keyed by its whole prefix.
        self._chains: dict[tuple[int, tuple[int, ...]], int] = {}

    @property
    def num_blocks(self) -> int:
        """Distinct full blocks seen: the working set an unbounded cache holds."""
        return len(self._chains)

    def reusable(self, prompt: Sequence[int]) -> int:
        """Leading full blocks of the prompt already computed, in tokens. The
        last prompt token is always computed (its logits give the next
        token), as in the engine's match."""
        B, chain, n = self.block_size, 0, 0
        for i in range((len(prompt) - 1) // B):
            chain = self._chains.get((chain, tuple(prompt[i * B:(i + 1) * B])))
            if chain is None:
                break
            n += B
        return n

    def add(self, computed: Sequence[int]) -> None:
        """Record a request's computed tokens (prompt + outputs fed back)."""
        B, chain = self.block_size, 0
        for i in range(len(computed) // B):
            key = (chain, tuple(computed[i * B:(i + 1) * B]))
            nxt = self._chains.get(key)
            if nxt is None:
                nxt = self._chains[key] = len(self._chains) + 1
            chain = nxt
