"""A block pool for a model with sliding-window layers: one page per layer.

A dense model's block holds every layer's K and V for B tokens. With
window layers (config.WindowSpec), a block far enough behind every query
that will read it is needed by its global (full-attention) layers only, so
its window layers' K and V can go. Here the unit of memory is a page: one
layer's K and V for B tokens (every layer reads one shared K and one shared
V tensor of pages, model_runner's per-layer page tables). A block is a
logical id with a page per layer, `page_of[block, layer]` (-1: none):

    global part   a page for each global layer, from allocation to free
    window part   a page for each window layer, from allocation until no
                  holder needs it (win_refs[block] = 0)

Holders of a window part: a block table whose window still covers the block
(kv/window_parts.py slides it as the request computes) and the radix tree,
which keeps those of the points worth resuming from (kv/window_parts.py:
prompt ends, path ends, where a path leaves a shared head). The pool's capacity in blocks is in
whole blocks' worth of pages (num_pages // layers, what a new block costs),
so the scheduler's arithmetic in blocks holds; a block that has shed its
window part costs only its global pages, which is how the pool holds more
tokens than its all-global twin.
"""
from __future__ import annotations

import itertools
from collections import deque
from collections.abc import Callable, Iterable, Iterator, Sequence

import numpy as np

from trajserve.kv.block_pool import BlockPool, NoFreeBlocks


class WindowBlockPool(BlockPool):
    def __init__(self, num_pages: int, num_layers: int, window_layers: tuple[int, ...]) -> None:
        wl = sorted(set(window_layers))
        if not wl or wl[0] < 0 or wl[-1] >= num_layers:
            raise ValueError(f"window layers {window_layers} must be some of 0..{num_layers - 1}")
        self.num_layers = num_layers
        self.window_cols = np.asarray(wl, dtype=np.int64)
        self.global_cols = np.asarray([i for i in range(num_layers) if i not in set(wl)], dtype=np.int64)
        g = len(self.global_cols)
        # Block ids: as many as the pages allow once every block shed its window part.
        super().__init__(max(1, num_pages // g if g else num_pages))
        if num_pages < num_layers:
            raise ValueError(f"the KV pool needs at least one block: {num_layers} pages, got {num_pages}")
        self.num_pages = num_pages
        self.num_blocks = num_pages // num_layers  # whole blocks' worth: what the scheduler counts
        self._free_pages: deque[int] = deque(range(num_pages))
        self.page_of = np.full((self.num_ids, num_layers), -1, dtype=np.int64)
        self.win_refs = [0] * self.num_ids
        self.tree_keeps = bytearray(self.num_ids)  # the radix tree holds one of win_refs
        # Blocks in radix nodes nobody locks (what eviction frees), and how
        # many of those have a window part: eviction frees its pages too.
        self.dormant = bytearray(self.num_ids)
        self.num_dormant_windows = 0

    @property
    def num_ids(self) -> int:
        return len(self.ref_counts)

    @property
    def num_free(self) -> int:
        """New blocks that can be allocated: free ids, each with a page for every layer."""
        return min(len(self._free), len(self._free_pages) // self.num_layers)

    @property
    def num_used(self) -> int:
        return self.num_blocks - self.num_free

    @property
    def num_free_pages(self) -> int:
        return len(self._free_pages)

    def allocate(self, n: int) -> list[int]:
        """n blocks, each with every layer's page; the caller holds their
        window parts (win_refs 1: a new block is inside its writer's window)."""
        if n > self.num_free:
            raise NoFreeBlocks(f"asked for {n} blocks, {self.num_free} free")
        pop, take = self._free.popleft, self._free_pages.popleft
        blocks = [pop() for _ in range(n)]
        L = self.num_layers
        for b in blocks:
            self.ref_counts[b] = 1
            self.win_refs[b] = 1
            self.page_of[b] = [take() for _ in range(L)]
        return blocks

    def free(self, blocks: list[int]) -> None:
        """Drop one reference from each block; at the last, its pages (and
        its window holders' references, which end with it) go back."""
        super().free(blocks)
        ref, pages = self.ref_counts, self._free_pages
        for b in blocks:
            row = self.page_of[b]
            if ref[b] == 0 and (row >= 0).any():  # its last reference went just now
                if self.dormant[b]:  # (the tree unmarks a block before it lets go of it)
                    self.num_dormant_windows -= bool(row[self.window_cols[0]] >= 0)
                    self.dormant[b] = 0
                pages.extend(int(p) for p in row if p >= 0)
                row[:] = -1
                self.win_refs[b] = 0
                self.tree_keeps[b] = 0

    def mark_dormant(self, blocks, on: bool) -> None:
        """The radix tree's nodes holding these blocks became unlocked (on)
        or locked / left the tree."""
        d, n = self.dormant, 0
        for b in blocks:
            d[b] = on
            n += self.has_window(b)
        self.num_dormant_windows += n if on else -n

    def reclaimable(self, num_dormant: int) -> int:
        """Whole blocks that evicting the num_dormant dormant blocks would
        add to num_free: their ids, their global pages, and the window
        pages of those that have a window part (the tree's keep is then
        its only holder)."""
        pages = num_dormant * len(self.global_cols) + self.num_dormant_windows * len(self.window_cols)
        after = min(len(self._free) + num_dormant, (len(self._free_pages) + pages) // self.num_layers)
        return max(0, after - self.num_free)

    # ------------------------------------------------------------ window parts
    def has_window(self, block: int) -> bool:
        return self.page_of[block, self.window_cols[0]] >= 0

    def hold_window(self, blocks) -> None:
        """One more holder of each block's window part (which must exist)."""
        for b in blocks:
            if not self.has_window(b):
                raise AssertionError(f"block {b} has no window part to hold")
            self.win_refs[b] += 1

    def release_window(self, blocks) -> None:
        """One holder fewer; a window part nobody holds goes back as pages."""
        for b in blocks:
            rc = self.win_refs[b] - 1
            if rc < 0:
                raise AssertionError(f"window part of block {b} released twice")
            self.win_refs[b] = rc
            if rc == 0:
                self._shed(b)

    def keep_window(self, blocks) -> None:
        """The radix tree holds these blocks' window parts (those that have
        one), once per block, until the block leaves the tree."""
        for b in blocks:
            if not self.tree_keeps[b] and self.has_window(b):
                self.tree_keeps[b] = 1
                self.win_refs[b] += 1

    def adopt_window(self, src: int, dst: int) -> bool:
        """dst (the radix tree's copy of src's tokens, computed earlier and
        since shed of its window part) takes src's window pages, with the
        one hold on them, when only that hold has them: the same tokens at
        the same positions under the same namespace, so the same K and V.
        False (nothing moved) otherwise."""
        if self.has_window(dst) or not self.has_window(src) or self.ref_counts[src] != 1 or self.win_refs[src] != 1:
            return False
        cols = self.window_cols
        self.page_of[dst, cols] = self.page_of[src, cols]
        self.page_of[src, cols] = -1
        self.win_refs[src], self.win_refs[dst] = 0, 1
        self.num_dormant_windows += self.dormant[dst] - self.dormant[src]
        return True

    def imported(self, blocks, windows) -> None:
        """Blocks just loaded from a lower tier (allocated whole, so their
        window part is the allocation's hold) join the radix tree: where
        windows[i] says block i came with its window part, the tree keeps
        it (the allocation's hold becomes the tree's); the others' window
        pages hold nothing and go."""
        for i, b in enumerate(blocks):
            if i < len(windows) and windows[i]:
                self.tree_keeps[b] = 1
            elif self.has_window(b):
                self.win_refs[b] = 0
                self.tree_keeps[b] = 0
                self._shed(b)

    def shed_tree_windows(self, target_free: int, keep: Sequence[int] = (),
                          order: Callable[[], Iterable[int]] = tuple) -> None:
        """Short of pages with nothing left to evict: the window parts only
        the radix tree holds (resume points, on paths in use too) give their
        pages back until num_free reaches target_free whole blocks, except
        keep's (a match about to be admitted): order()'s blocks first (the
        tree's, least recently used first; asked only when shedding can
        help), then any other the tree keeps.
        A hit at a shed point is cut back and recomputed; no running
        request reads them."""
        if len(self._free) < target_free:
            return  # ids, not pages, are short: shedding frees none
        keep = set(keep)
        for b in itertools.chain(order(), self._tree_kept()):
            if self.num_free >= target_free:
                return
            if self.tree_keeps[b] and self.win_refs[b] == 1 and b not in keep:
                self.win_refs[b] = 0
                self.tree_keeps[b] = 0
                self._shed(b)

    def _tree_kept(self) -> Iterator[int]:
        """The blocks whose window part the tree keeps, by id (scanned only
        when asked: shedding's fallback after the tree's own order)."""
        yield from np.flatnonzero(np.frombuffer(self.tree_keeps, dtype=np.uint8)).tolist()

    def _shed(self, b: int) -> None:
        row = self.page_of[b]
        cols = self.window_cols
        if self.dormant[b] and row[cols[0]] >= 0:
            self.num_dormant_windows -= 1
        self._free_pages.extend(int(p) for p in row[cols] if p >= 0)
        row[cols] = -1

    def check(self) -> None:
        super().check()
        assert self.num_dormant_windows == sum(1 for b in range(self.num_ids) if self.dormant[b] and self.has_window(b)), \
            "dormant window parts miscounted"
        used = {int(p) for p in self.page_of.ravel() if p >= 0}
        free = set(self._free_pages)
        assert len(free) == len(self._free_pages), "page on the free list twice"
        assert not used & free, "a page both used and free"
        assert len(used) + len(free) == self.num_pages, "a page lost"
        for b, rc in enumerate(self.ref_counts):
            has = self.has_window(b)
            assert (self.win_refs[b] > 0) == has or rc == 0, f"block {b}: win_refs {self.win_refs[b]}, window {has}"
