"""KVCacheManager: the only owner of block tables, the block pool and the
radix prefix cache.

The scheduler asks it for a request's cached prefix (match), for room
(allocate_slots), tells it when blocks fill (cache_computed) and returns room
(release). It never touches blocks itself. Works on token ids and block ids
only, so the simulator can drive it without tensors.

Reference counting (DESIGN.md invariant): pool.ref_counts[b] = number of
block tables holding b + 1 if a radix node stores b. A cached block whose
tables all let go stays in the tree (evictable) until the pool runs short.

Copy-on-write (spec "通过写时复制分支实现零复制审慎推理"): `fork` gives a child
table the parent's block ids (refcount + 1, no KV copied). A block is written
only by a table that holds it alone; before a step writes into a shared block
(in practice the partially filled tail of a fork), allocate_slots gives the
writer a fresh block and queues a (src, dst) copy that the executor runs
before the step's forward. Full blocks are never written again, so they stay
shared for the life of every branch.

Its pool, tree, tables and holds are its own: the rest of the engine asks
through its methods (kv/cache_views.py for counts and snapshots,
kv/radix_paths.py for whole paths and holds), never through those fields.
"""
from __future__ import annotations

from collections.abc import Callable, Hashable
from dataclasses import dataclass, field

from trajserve.kv.block_pool import BlockPool
from trajserve.kv.block_table import BlockTable, blocks_for
from trajserve.kv.cache_views import CacheViews
from trajserve.kv.admission_hold import AdmissionHolds
from trajserve.kv.radix_cache import RadixCache
from trajserve.kv.radix_paths import PathOps
from trajserve.kv.radix_node import BlockKey, LowerTierCache, MatchResult, RadixNode, chain_hash
from trajserve.kv.retention import Retention
from trajserve.kv.scope import CacheScope, namespace_of
from trajserve.kv.window_parts import WindowParts
from trajserve.kv.window_pool import WindowBlockPool


@dataclass(slots=True)
class _PrefixState:
    """What one request has in the radix tree."""
    namespace: Hashable
    keys: list[BlockKey] = field(default_factory=list)  # keys of its blocks stored in the tree
    node: RadixNode | None = None  # locked end of that path


class KVCacheManager(PathOps, CacheViews, WindowParts):
    def __init__(self, num_blocks: int, block_size: int, watermark: float = 0.01,
                 enable_prefix_caching: bool = False, model_id: Hashable = "",
                 window: tuple[int, int, tuple[int, ...]] | None = None) -> None:
        """window: (tokens, layers, window layers) of a model with sliding-window
        layers: a page per layer, window parts freed (kv/window_pool.py), the
        pool's num_blocks blocks' worth of pages."""
        self.block_size = block_size
        if window is not None:
            self.pool = WindowBlockPool(num_blocks * window[1], window[1], window[2])
        else:
            self.pool = BlockPool(num_blocks)
        self._init_window(window[0] if window is not None else 0)
        self.tables: dict[str, BlockTable] = {}
        self.watermark_blocks = int(watermark * num_blocks)
        self.radix = RadixCache(self.pool, block_size) if enable_prefix_caching else None
        # Prefixes clients asked to keep for a while (kv/retention.py): every tier evicts them last.
        self.retention = Retention()
        if self.radix is not None:
            self.radix.retention = self.retention
        # Resumed sessions' pins, held until their turns are admitted (kv/admission_hold.py).
        self.holds = AdmissionHolds(self.radix) if self.radix is not None else None
        self.model_id = model_id
        self._prefix: dict[str, _PrefixState] = {}
        # (src, dst) block copies the executor must run before the next forward.
        self._copies: list[tuple[int, int]] = []
        self.num_cow_copies = 0
        # request id -> (token list, length matched, its block keys): see match().
        self._match_keys: dict[str, tuple[list[int], int, list[BlockKey]]] = {}
        # Asked for n blocks when the pool is short even after evicting cold
        # cache: releases pinned state nobody is computing with (paused agent
        # sessions) and returns how many blocks it made free. Set by the
        # session manager, so running requests are never starved by paused ones.
        self.reclaimer: Callable[[int], int] | None = None
        self.num_reclaimed_blocks = 0
        # Hierarchical cache: LRU-evicted blocks go down to host / disk and
        # come back when a match reaches them (attach_lower_tiers).
        self.lower: LowerTierCache | None = None
        self.num_promoted_blocks = 0

    @property
    def num_blocks(self) -> int:
        return self.pool.num_blocks

    @property
    def token_capacity(self) -> int:
        """The longest sequence a request may grow to: what the pool holds
        with every layer of every block; a window pool's, more
        (sequence_blocks: kv/window_parts.py)."""
        return self.sequence_blocks * self.block_size

    def usage(self) -> float:
        """U_KV = N_allocated_blocks / N_total_blocks   (eq. 8, kv-cache-management).
        Cached blocks no request holds count as allocated (they are reclaimable)."""
        return self.pool.num_used / self.pool.num_blocks

    def active_usage(self) -> float:
        """U_KV without the cold cache: blocks that requests or pinned paused
        state hold, over all blocks. What admission and the keep policy watch:
        cached blocks nobody holds leave the moment anyone needs the room."""
        return (self.pool.num_used - self.num_reclaimable) / self.pool.num_blocks

    @property
    def num_active_blocks(self) -> int:
        return self.pool.num_used - self.num_reclaimable

    def attach_reclaimer(self, reclaimer: Callable[[int], int]) -> None:
        """reclaimer(n): free n blocks of pinned paused state, return how many
        it freed (the pause machine's); one at a time."""
        if self.radix is None:
            raise ValueError("paused state is kept in the prefix cache: enable prefix caching")
        if self.reclaimer is not None:
            raise ValueError("this KV manager already has a reclaimer (a session manager or pause controller)")
        self.reclaimer = reclaimer

    def detach_reclaimer(self, reclaimer: Callable[[int], int]) -> None:
        if self.reclaimer == reclaimer:
            self.reclaimer = None

    @property
    def has_reclaimer(self) -> bool:
        return self.reclaimer is not None

    def reclaim(self, num_blocks: int, keep: MatchResult | None = None) -> int:
        """Ask the reclaimer to free num_blocks blocks of pinned state; the
        blocks it returns are free. `keep`, a match about to be used, is
        locked meanwhile so it cannot go with the paused state it may share."""
        if self.reclaimer is None or num_blocks <= 0:
            return 0
        locked = keep is not None and bool(keep.block_ids)
        if locked:
            self.radix.lock(keep.last_node)
        got = self.reclaimer(num_blocks)
        if locked:
            self.radix.unlock(keep.last_node)
        self.num_reclaimed_blocks += got
        return got

    @property
    def num_reclaimable(self) -> int:
        """Cached blocks nobody holds, in the pool's blocks (a window pool's:
        the whole blocks' worth of pages their eviction frees, window parts
        the tree keeps included)."""
        if self.radix is None:
            return 0
        if self.windowed:
            return self.pool.reclaimable(self.radix.num_evictable_blocks)
        return self.radix.num_evictable_blocks

    def table(self, request_id: str) -> BlockTable:
        return self.tables[request_id]

    # ---------------------------------------------------------------- prefix
    def namespace(self, scope: CacheScope) -> Hashable:
        """Everything besides the tokens that determines the KV state: the
        model and the request's scope (kv/scope.py). Every method that names
        blocks by tokens comes through here, so a bare salt is refused."""
        return namespace_of(self.model_id, scope)

    def match(self, request_id: str, token_ids: list[int], scope: CacheScope) -> MatchResult | None:
        """Cached block-aligned prefix for a request that holds no blocks yet.
        At least one token is left out: its logits give the next token."""
        if self.radix is None or request_id in self.tables or len(token_ids) <= self.block_size:
            return None
        n = len(token_ids) - 1
        # A waiting head that cannot be admitted yet is matched again every
        # step; its tokens do not change while it waits, so chunking them
        # into block keys (the costly part for a long prompt) is done once.
        memo = self._match_keys.get(request_id)
        if memo is not None and memo[0] is token_ids and memo[1] == n:
            keys = memo[2]
        else:
            keys = self.radix.block_keys(token_ids[:n])
            self._match_keys[request_id] = (token_ids, n, keys)
        ns = self.namespace(scope)
        hit = self.radix.match_blocks(ns, keys)
        if self.lower is not None and len(hit.block_ids) < len(keys):
            hit = self._promote(ns, keys, hit, len(token_ids))
        if self.windowed and hit.block_ids:
            hit = self._win_cut(ns, keys, hit)
        return hit if hit.num_tokens else None

    def attach_lower_tiers(self, lower: LowerTierCache | None, spill: bool = True) -> None:
        """A match continues into what `lower` holds; with spill, LRU eviction
        also moves blocks down to it instead of dropping them (without: only
        paused sessions store there)."""
        if self.radix is None:
            raise ValueError("lower KV tiers extend the prefix cache: enable prefix caching")
        self.lower = lower
        self.radix.spill = lower if spill else None
        if lower is not None:
            lower.retention = self.retention

    def _promote(self, ns: Hashable, keys: list[BlockKey], hit: MatchResult, num_tokens: int) -> MatchResult:
        """The device match stopped short: load the blocks that follow it from
        the lower tiers (the longest run they hold) into fresh device blocks
        and the tree, then match again. Takes no room the request itself
        needs for the rest of its prompt, nor the watermark."""
        lower = self.lower
        start = len(hit.block_ids)
        h = self.radix.path_hash(hit.last_node)
        hashes = []
        for k in keys[start:]:
            h = chain_hash(h, k)
            if not lower.contains(h):
                break
            hashes.append(h)
        if not hashes:
            return hit
        node = hit.last_node
        self.radix.lock(node)  # the device part of the match stays while we evict
        rest = blocks_for(num_tokens, self.block_size) - start - len(hashes)
        n = min(len(hashes), self.pool.num_free + self.num_reclaimable - self.watermark_blocks - rest)
        if n > self.pool.num_free:
            with lower.loading(hashes[:n]):  # what the eviction spills must not push them out
                self._evict_for(n - self.pool.num_free)
        n = min(n, self.pool.num_free)
        new_ids = self.pool.allocate(n) if n > 0 else []
        windows = lower.load(ns, hashes[:n], new_ids) if new_ids else []
        got = len(windows)
        self._adopt(ns, hit, keys[start:start + got], new_ids, got, windows)
        if not got:
            return hit
        self.num_promoted_blocks += got
        return self.radix.match_blocks(ns, keys)

    def cache_computed(self, request_id: str, token_ids: list[int], num_computed: int,
                       scope: CacheScope) -> None:
        """Store the request's newly filled blocks in the tree, so a request
        with the same prefix hits while this one is still running; then
        slide its window (kv/window_parts.py: the tree may keep or adopt
        window parts first)."""
        self._cache_blocks(request_id, token_ids, num_computed, scope)
        if self.windowed:
            self._win_slide(request_id, num_computed)

    def _cache_blocks(self, request_id: str, token_ids: list[int], num_computed: int, scope: CacheScope) -> None:
        if self.radix is None:
            return
        table = self.tables.get(request_id)
        if table is None:
            return
        st = self._prefix.get(request_id)
        if st is None:
            st = self._prefix[request_id] = _PrefixState(self.namespace(scope))
        full = num_computed // self.block_size
        if full > len(table.block_ids):
            full = len(table.block_ids)
        have = len(st.keys)
        if full <= have:
            return  # the common case (no block filled this step): keep it cheap
        B = self.block_size
        new_keys = self.radix.block_keys(token_ids[have * B: full * B])
        st.keys.extend(new_keys)
        if st.node is not None and not st.node.detached:
            # Our locked path ends at block `have` (locked nodes are never
            # evicted, and a split keeps the lower node): insert only the new
            # blocks below it, the same result as walking the whole path.
            res = self.radix.insert_blocks(st.namespace, new_keys, table.block_ids[have:full], below=st.node)
            offset = have
        else:
            res = self.radix.insert_blocks(st.namespace, st.keys, table.block_ids[:full])
            offset = 0
        for idx, cached in res.duplicates:
            idx += offset
            if self.windowed and not self._win_dedupe(request_id, idx, table.block_ids[idx], cached):
                continue  # ours has a window part the tree's cannot take: keep ours
            # Same tokens computed twice (two requests raced): keep the tree's
            # block, drop ours, so both requests share one copy.
            self.pool.incref([cached])
            self.pool.free([table.block_ids[idx]])
            table.block_ids[idx] = cached
        self.radix.lock(res.node)
        if st.node is not None:
            self.radix.unlock(st.node)
        st.node = res.node
        if self.windowed:
            if res.duplicates and offset + res.duplicates[-1][0] + 1 < full:  # it left a shared head here
                self._win_branch(table.block_ids, offset + res.duplicates[-1][0] + 1)
            if num_computed == len(token_ids):  # the whole prompt (a decode's: ignored)
                self._win_prompt_end(request_id, table.block_ids, len(st.keys))

    # ------------------------------------------------------------ allocation
    def can_admit(self, request_id: str, num_tokens: int, hit: MatchResult | None = None,
                  others_running: bool = True) -> bool:
        """Admission keeps a watermark of free blocks for running decodes;
        with none running there is nothing to keep it for (a preempted
        request whose own cached history fills the pool could otherwise
        never come back, and as the queue's head it would block the rest)."""
        have = len(hit.block_ids) if hit else 0
        need = max(0, self.blocks_needed(request_id, num_tokens) - have)
        reserve = self.watermark_blocks if others_running else 0
        # Reclaimable blocks the hit itself uses are not reclaimable for it.
        avail = self.pool.num_free + max(0, self.num_reclaimable - have)
        short = need + reserve - avail
        if short > 0:  # paused state makes room, and a window pool's cold blocks (kv/window_parts.py)
            self._make_room(need + reserve, hit)
            avail = self.pool.num_free + max(0, self.num_reclaimable - have)
        return need + reserve <= avail

    def allocate_slots(self, request_id: str, num_tokens: int, hit: MatchResult | None = None,
                       write_from: int | None = None) -> bool:
        """Grow the request's table to hold num_tokens tokens, starting from
        the cached prefix `hit` for a new request, and make every block that
        positions [write_from, num_tokens) touch private to it (copy-on-write).
        Evicts cold cached blocks when the free list is short. False (and no
        change) when the pool is short even so."""
        table = self.tables.get(request_id)
        if table is not None and write_from is not None:
            # Fast path (most decode steps): the write stays in the table's
            # last block, which no one else holds: nothing to allocate or
            # copy, only the low-water eviction below with need = 0.
            ids = table.block_ids
            if (ids and num_tokens <= len(ids) * self.block_size
                    and write_from // self.block_size == len(ids) - 1 and self.pool.ref_counts[ids[-1]] == 1):
                short = self.watermark_blocks - self.pool.num_free
                if short > 0 and self.radix is not None:
                    self._evict_for(short)
                return True
        new_table = table is None
        if new_table:
            table = BlockTable(self.block_size)
            if self.windowed and hit is not None and hit.block_ids and not self._win_ready(hit.block_ids):
                return False  # a window part the hit needs went since the match: match again next step
            if hit is not None and hit.block_ids:
                self.radix.lock(hit.last_node)  # pin before evicting
                self.pool.incref(hit.block_ids)
                table.block_ids = list(hit.block_ids)
                memo = self._match_keys.get(request_id)
                k = len(hit.block_ids)
                # The hit's path keys are the first blocks of the keys match() walked.
                if memo is not None and len(memo[2]) >= k and memo[2][k - 1] == hit.last_node.key[-1]:
                    keys = memo[2][:k]
                else:
                    keys = self._keys_of(hit.last_node)
                self._prefix[request_id] = _PrefixState(hit.last_node.namespace, keys, hit.last_node)
            if self.windowed:
                self._win_hold(request_id, table.block_ids, self.window_start(len(table.block_ids) * self.block_size))
        # Runs for every running request every step: the block arithmetic is
        # inline (one pass, no helper calls) to keep the simulator fast.
        B = self.block_size
        ids = table.block_ids
        have = len(ids)
        end = -(-num_tokens // B)  # blocks_for(num_tokens, B)
        grow = end - have if end > have else 0
        # Existing blocks the write [write_from, num_tokens) lands in that
        # another table (or the tree) also holds: they are copied on write.
        shared = []
        if write_from is not None and have:
            rc = self.pool.ref_counts
            for i in range(write_from // B, min(have, end)):
                if rc[ids[i]] > 1:
                    shared.append(i)
        need = grow + len(shared)
        # Low-water mark: evict cold cached blocks as soon as this allocation
        # would leave fewer than watermark_blocks free, so the free list keeps
        # room for running decodes.
        free = self.pool.num_free
        short = need + self.watermark_blocks - free
        if short > 0 and self.radix is not None:
            self._evict_for(short)
            free = self.pool.num_free
            if need > free and self.reclaimer is not None:
                # This request's blocks (its table, its locked prefix) are not
                # candidates: the reclaimer only releases unlocked paused state.
                self.reclaim(need - free)
                free = self.pool.num_free
        if need > free:
            if new_table:
                self._drop(request_id, table)
            return False
        if new_table:
            self.tables[request_id] = table
            self._match_keys.pop(request_id, None)
            if self.windowed:
                self._win_from.setdefault(request_id, 0)  # a table of its own blocks: it holds them all
        for idx in shared:
            src = ids[idx]
            dst = self.pool.allocate(1)[0]
            # src keeps its other holders, so this never frees it; the copy
            # runs before the forward, ahead of any write to dst or src.
            if self.windowed:
                self._win_copied(request_id, idx, src)
            self.pool.free([src])
            ids[idx] = dst
            self._copies.append((src, dst))
            self.num_cow_copies += 1
        if grow:
            ids.extend(self.pool.allocate(grow))
        return True

    def truncate(self, request_id: str, num_tokens: int) -> None:
        """Speculation's rollback: the table keeps the blocks num_tokens
        need; blocks past them held only rejected draft rows (allocated by
        this step, private, never in the tree) and go back to the pool."""
        ids = self.tables[request_id].block_ids
        keep = -(-num_tokens // self.block_size)
        if len(ids) > keep:
            extra = ids[keep:]
            del ids[keep:]
            self.pool.free(extra[::-1])

    def take_copies(self) -> list[tuple[int, int]]:
        """Pending copy-on-write copies, oldest first; the caller runs them
        before the step's forward."""
        copies, self._copies = self._copies, []
        return copies

    def fork(self, parent_id: str, child_id: str) -> None:
        """The child's table references every block of the parent's (no KV
        copy); the first write into a shared block copies that block only."""
        if child_id in self.tables:
            raise ValueError(f"fork: {child_id!r} already has a block table")
        parent = self.tables[parent_id]
        child = BlockTable(self.block_size)
        child.block_ids = list(parent.block_ids)
        self.pool.incref(child.block_ids)
        self.tables[child_id] = child
        if self.windowed:
            self._win_hold(child_id, child.block_ids, self._win_from.get(parent_id, 0))
        st = self._prefix.get(parent_id)
        if st is not None:
            if st.node is not None:
                self.radix.lock(st.node)
            self._prefix[child_id] = _PrefixState(st.namespace, list(st.keys), st.node)

    def release(self, request_id: str, token_ids: list[int] | None = None, num_computed: int = 0,
                scope: CacheScope | None = None, swap_out: bool = False, priority: int | None = None) -> int:
        """Free a finished or preempted request's blocks; with token_ids, its
        computed full blocks go to the prefix cache first. swap_out (a
        preemption that swaps): the blocks of its path no one else uses move
        to the lower tiers now, so they free at once and come back on a hit.
        priority: its path's eviction class from now (RadixCache.unlock). Returns the blocks swapped out."""
        if token_ids is not None:
            self.cache_computed(request_id, token_ids, num_computed, scope)
        self._match_keys.pop(request_id, None)
        st = self._prefix.get(request_id)
        node = st.node if st is not None else None
        table = self.tables.pop(request_id, None)
        if table is not None:
            self._drop(request_id, table, priority)
        if swap_out and node is not None and self.lower is not None:
            before = self.radix.num_spilled_blocks
            self.radix.evict_path(node, spill=True)
            return self.radix.num_spilled_blocks - before
        return 0

    def _drop(self, request_id: str, table: BlockTable, priority: int | None = None) -> None:
        st = self._prefix.pop(request_id, None)
        if self.windowed:
            self._win_release(request_id, table.block_ids, len(st.keys) if st is not None else 0)
        if st is not None and st.node is not None:
            self.radix.unlock(st.node, priority)
        # Reverse: the tail (least likely to be shared) is reused first.
        self.pool.free(table.block_ids[::-1])

    def _keys_of(self, node: RadixNode) -> list[BlockKey]:
        keys: list[BlockKey] = []
        path = []
        while node.parent is not None:
            path.append(node)
            node = node.parent
        for n in reversed(path):
            keys.extend(n.key)
        return keys

    def blocks_needed(self, request_id: str, num_tokens: int) -> int:
        table = self.tables.get(request_id)
        have = len(table) if table is not None else 0
        return max(0, blocks_for(num_tokens, self.block_size) - have)

    def clear_cache(self) -> int:
        """Drop every cached block no request uses (and the lower tiers' copies)."""
        self.retention.clear()
        if self.lower is not None:
            self.lower.clear()
        return self.radix.clear() if self.radix is not None else 0

    def invalidate(self, prefix_tokens: list[int] | None, scope: CacheScope) -> int:
        ns = self.namespace(scope)
        if self.radix is None:
            return 0
        if self.lower is not None:
            # A lower tier cannot tell which of its blocks follow the stale
            # tokens (a hash names a prefix, it cannot be walked): all of the
            # namespace goes. Losing cache is safe; serving stale KV is not.
            self.lower.discard_namespace(ns)
        return self.radix.invalidate(ns, prefix_tokens)
