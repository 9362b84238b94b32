"""Which blocks' window parts each block table holds (a mixin of
KVCacheManager over a WindowBlockPool, kv/window_pool.py).

A query at position q of a window layer reads keys q - W < k <= q
(W: the window in tokens). A request that has computed c tokens computes
next from c on, and a prefix hit resumes at a block-aligned point, so it
holds the window parts of the blocks from

    start(c) = max(0, (c // B) * B - W + 1) // B

on: what a query at the block-aligned point at or below c reads (at most one
block more than the query at c itself). As c grows the blocks before
start(c) are released (their window pages go back once no one else holds
them); the global layers keep every block, as before.

A prefix hit is exact only where every block its first query's window
reaches still has its window part: match() cuts a hit back to the longest
such prefix (the rest is recomputed; `num_window_recomputed_tokens` counts
those tokens). What keeps hits coming: the radix tree keeps the window
parts of the last window before the end of each request's prompt (when it
has computed it) and of its whole path (when it leaves): the end of a
turn's prompt and of its reply, where a fork, a shared head or an agent's
next call resumes. A block goes down to the host and disk tiers with its
window part when it has one (the LRU spill: those points; a paused
session's save: its path's last window, hold_copy_windows), its window
layers after its global ones, and comes back with it, kept by the tree; a
block saved without one comes back without one, and a hit that needs it
is cut back as above.
"""
from __future__ import annotations

from collections.abc import Hashable, Sequence

from trajserve.kv.radix_node import BlockKey, MatchResult


class WindowParts:
    def _init_window(self, window_tokens: int) -> None:
        self.window_tokens = window_tokens
        self._win_from: dict[str, int] = {}  # request id -> first block whose window part its table holds
        self._win_pending: dict[str, list[int]] = {}  # copy-on-write sources, released after their copy ran
        self.num_window_recomputed_tokens = 0  # hit tokens cut because a window part was gone
        self._win_prompts: set[str] = set()  # requests whose prompt's end the tree keeps already
        # The scheduler's largest prefill chunk (the engine sets it): what sequence_blocks allows for.
        self.prefill_chunk_tokens = 0

    @property
    def windowed(self) -> bool:
        return self.window_tokens > 0

    @property
    def sequence_blocks(self) -> int:
        """The most blocks one sequence may grow to (token_capacity). Every
        block keeps its global pages; window pages only the table's window
        and the chunk being written need (the tree's other window parts are
        shed for it when the pool is short: _evict_for): at most
        live = W / B + chunk / B + 4 blocks with every layer. So a sequence
        may hold live + (pages - live x L) / g blocks, where the pool's whole
        blocks would hold fewer (Gemma 3's 5:1 layout: about 5x)."""
        pool = self.pool
        if not self.windowed or not self.prefill_chunk_tokens:
            return pool.num_blocks
        B, g = self.block_size, len(pool.global_cols)
        live = -(-self.window_tokens // B) + -(-self.prefill_chunk_tokens // B) + 4
        if live * pool.num_layers >= pool.num_pages:
            return pool.num_blocks
        most = live + (pool.num_pages - live * pool.num_layers) // g if g else pool.num_ids
        return max(pool.num_blocks, min(most, pool.num_ids))

    def window_start(self, num_tokens: int) -> int:
        B = self.block_size
        return max(0, (num_tokens // B) * B - self.window_tokens + 1) // B

    def _last_window(self, ids: list[int], n: int | None = None) -> list[int]:
        """The blocks of ids[:n]'s last window (n: all of ids): what a query
        right after them reads."""
        n = len(ids) if n is None else n
        return ids[self.window_start(n * self.block_size):n]

    def _evict_for(self, blocks: int, keep: Sequence[int] = ()) -> None:
        """Evict cold cached blocks until `blocks` more whole blocks are free,
        or nothing is left to evict. A dense block frees a whole block; a
        window pool's frees its global pages and its window part only where
        no one else held it, so a whole block's worth (a page every layer)
        may take several, and eviction is asked again until the room is there.
        A window pool still short sheds the tree's own window parts (but
        keep's: a match's resume window) on paths in use, the least
        recently used paths' first: a sequence longer than the pool's whole
        blocks grows past its earlier turns' resume points (token_capacity)."""
        target = self.pool.num_free + blocks
        while self.pool.num_free < target and self.radix.evict(target - self.pool.num_free):
            pass
        if self.windowed and self.pool.num_free < target:
            self.pool.shed_tree_windows(target, keep, self.radix.blocks_by_recency)

    def _make_room(self, blocks: int, keep: MatchResult | None) -> None:
        """Admission wants `blocks` blocks, free or cold (cached, unheld) and
        finds fewer. A window pool's count of what eviction frees leaves out
        the window parts only the tree keeps, so it evicts for real until
        `blocks` are free (the match about to be used locked meanwhile); then
        paused state makes up what is still short (the reclaimer)."""
        have = len(keep.block_ids) if keep is not None else 0
        if self.windowed and self.radix is not None:
            if have:
                self.radix.lock(keep.last_node)
            self._evict_for(blocks - self.pool.num_free, self._last_window(keep.block_ids) if have else [])
            if have:
                self.radix.unlock(keep.last_node)
        short = blocks - self.pool.num_free - max(0, self.num_reclaimable - have)
        if short > 0 and self.reclaimer is not None:
            self.reclaim(short, keep=keep)

    def hold_copy_windows(self, ids: list[int]) -> list[bool]:
        """A path's blocks are about to be copied to a lower tier (a paused
        session's save): which carry their window part along, held until
        release_copy_windows."""
        mask = self._copy_windows(ids)
        if any(mask):
            self.pool.hold_window([b for b, m in zip(ids, mask) if m])
        return mask

    def save_blocks(self, ids: list[int]) -> int:
        """What a paused session's save of this path copies, in whole blocks'
        worth of bytes (rounded up): the pause decision prices it and the
        tier reserves it. A window pool's save: every block's global layers
        and hold_copy_windows' window parts."""
        if not self.windowed:
            return len(ids)
        pool = self.pool
        carried = sum(map(pool.has_window, self._last_window(ids)))
        pages = len(ids) * len(pool.global_cols) + carried * len(pool.window_cols)
        return -(-pages // pool.num_layers)

    def _copy_windows(self, ids: list[int]) -> list[bool]:
        """The blocks of the path's last window that have their window part:
        what the next turn, resuming at the path's end, reads."""
        if not self.windowed:
            return []
        last = self._last_window(ids)
        return [False] * (len(ids) - len(last)) + [bool(self.pool.has_window(b)) for b in last]

    def release_copy_windows(self, ids: list[int], mask: list[bool]) -> None:
        if any(mask):
            self.pool.release_window([b for b, m in zip(ids, mask) if m])

    def _win_ready(self, ids: list[int]) -> bool:
        """Does every block a query right after ids reads still have its window
        part? (A preemption between a match and its admission may have
        released one the tree did not keep.)"""
        return all(self.pool.has_window(b) for b in self._last_window(ids))

    def _win_hold(self, request_id: str, ids: list[int], start: int) -> None:
        """A table that now holds ids (a hit, a fork) takes their window parts from `start` on."""
        self.pool.hold_window(ids[start:])
        self._win_from[request_id] = start

    def _win_slide(self, request_id: str, num_computed: int) -> None:
        """The request computed up to num_computed: release what no query of it reads any more."""
        old = self._win_from.get(request_id)
        if old is None:
            return
        pending = self._win_pending.pop(request_id, None)
        if pending:
            self.pool.release_window(pending)
        ids = self.tables[request_id].block_ids
        new = min(self.window_start(num_computed), len(ids))
        if new > old:
            self.pool.release_window(ids[old:new])
            self._win_from[request_id] = new

    def _win_prompt_end(self, request_id: str, ids: list[int], in_tree: int) -> None:
        """The request computed its whole prompt: the tree keeps the window
        parts of the prompt's last window (a fork, a retry, a shared head
        resume there), once."""
        if request_id not in self._win_prompts and in_tree:
            self._win_prompts.add(request_id)
            self.pool.keep_window(self._last_window(ids, in_tree))

    def _win_release(self, request_id: str, ids: list[int], keep_to: int) -> None:
        """The table goes: the tree keeps the window parts of its path's last
        window (its first keep_to blocks are in the tree), then the table's
        holds are released."""
        self._win_prompts.discard(request_id)
        start = self._win_from.pop(request_id, None)
        if start is None:
            return
        if keep_to:
            self.pool.keep_window(self._last_window(ids, keep_to))
        pending = self._win_pending.pop(request_id, None)
        if pending:
            self.pool.release_window(pending)
        self.pool.release_window(ids[start:])

    def _win_copied(self, request_id: str, idx: int, src: int) -> None:
        """A copy-on-write replaced block idx (src) in the table: its window
        part is released once the copy has run (the next slide)."""
        if idx >= self._win_from.get(request_id, len(self.tables[request_id].block_ids)):
            self._win_pending.setdefault(request_id, []).append(src)

    def _win_dedupe(self, request_id: str, idx: int, ours: int, cached: int) -> bool:
        """cache_computed found the tree holding block idx's tokens already
        (`cached`): may the table take the tree's block for its own? When
        the table's window covers it, the window hold moves to the tree's
        block, which takes our window pages if it has none (the same K and
        V); not if ours are shared too (the table keeps its own block)."""
        if idx < self._win_from.get(request_id, idx + 1):
            return True
        if self.pool.has_window(cached):
            self.pool.hold_window([cached])
            self.pool.release_window([ours])
            return True
        return self.pool.adopt_window(ours, cached)

    def _win_branch(self, ids: list[int], branch: int) -> None:
        """The request's path leaves the tree's at block `branch` (a shared
        head such as a system prompt ends there): the tree keeps the window
        parts before it, where other requests sharing that head resume."""
        if 0 < branch < len(ids):
            self.pool.keep_window(self._last_window(ids, branch))

    def _win_cut(self, ns: Hashable, keys: list[BlockKey], hit: MatchResult) -> MatchResult:
        """The longest prefix of hit whose first query's window has every window part."""
        ids, B = hit.block_ids, self.block_size
        j = len(ids)
        while j > 0:
            start = self.window_start(j * B)
            missing = next((i for i in range(j - 1, start - 1, -1) if not self.pool.has_window(ids[i])), None)
            if missing is None:
                break
            j = missing
        if j == len(ids):
            return hit
        self.num_window_recomputed_tokens += (len(ids) - j) * B
        return self.radix.match_blocks(ns, keys[:j])
