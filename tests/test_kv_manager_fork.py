"""KVCacheManager with the radix cache, forks and copy-on-write, driven the way
the scheduler drives it. A stand-in KV pool (one token id per slot) is
written through the block tables and the manager's copy list, so a wrong
share, a missed copy or a hit on the wrong block shows as a request reading
back tokens it never wrote."""
from collections import Counter

from hypothesis import HealthCheck, settings, strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from trajserve.kv.block_table import blocks_for
from trajserve.kv.cache_manager import KVCacheManager
from trajserve.kv.scope import CacheScope


def write(kv: KVCacheManager, content: dict, rid: str, tokens: list[int], start: int) -> None:
    """Run the pending copies (all reads before writes, like the executor),
    then store tokens[start:] in the request's slots."""
    copies = kv.take_copies()
    snapshot = {src: list(content.get(src, [None] * kv.block_size)) for src, _ in copies}
    for src, dst in copies:
        content[dst] = list(snapshot[src])
    table = kv.table(rid).block_ids
    B = kv.block_size
    for p in range(start, len(tokens)):
        content.setdefault(table[p // B], [None] * B)[p % B] = tokens[p]


def read(kv: KVCacheManager, content: dict, rid: str, n: int) -> list:
    table, B = kv.table(rid).block_ids, kv.block_size
    return [content.get(table[p // B], [None] * B)[p % B] for p in range(n)]


def test_fork_shares_every_block_and_copies_only_the_written_tail():
    B = 4
    kv = KVCacheManager(32, B, 0.0, enable_prefix_caching=True)
    content: dict = {}
    parent = list(range(100, 114))  # 3 full blocks + 2 tokens in the tail
    assert kv.allocate_slots("p", len(parent), write_from=0)
    write(kv, content, "p", parent, 0)
    kv.cache_computed("p", parent, len(parent), CacheScope())
    used = kv.pool.num_used
    kv.fork("p", "c1")
    kv.fork("p", "c2")
    assert kv.pool.num_used == used, "a fork must not allocate"
    assert kv.table("c1").block_ids == kv.table("p").block_ids
    tail = kv.table("p").block_ids[-1]
    assert kv.pool.ref_counts[tail] == 3

    # c1 appends: its copy of the partial tail is made, nothing else.
    c1 = parent + [7, 7, 7]
    assert kv.allocate_slots("c1", len(c1), write_from=len(parent))
    assert kv._copies == [(tail, kv.table("c1").block_ids[3])]
    write(kv, content, "c1", c1, len(parent))
    assert kv.table("c1").block_ids[:3] == kv.table("p").block_ids[:3]
    assert kv.pool.ref_counts[tail] == 2
    # c2 appends too; the parent then holds the old tail alone and writes in place.
    c2 = parent + [8, 8, 8, 8, 8]
    assert kv.allocate_slots("c2", len(c2), write_from=len(parent))
    write(kv, content, "c2", c2, len(parent))
    p2 = parent + [9]
    assert kv.allocate_slots("p", len(p2), write_from=len(parent))
    assert not kv._copies and kv.table("p").block_ids[-1] == tail
    write(kv, content, "p", p2, len(parent))
    assert kv.num_cow_copies == 2
    for rid, toks in (("p", p2), ("c1", c1), ("c2", c2)):
        assert read(kv, content, rid, len(toks)) == toks, rid
    for rid, toks in (("p", p2), ("c1", c1), ("c2", c2)):
        kv.release(rid, toks, len(toks), CacheScope())
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks
    kv.pool.check()


def test_spec_fork_example_uses_131_blocks_not_416():
    """Spec "通过写时复制分支实现零复制审慎推理": 4 branches over a 95-block
    prefix with 9 private blocks each: 95 + 4 x 9 = 131 physical blocks,
    where copying the prefix per branch needs 4 x (95 + 9) = 416."""
    B, prefix_blocks, branches, private = 16, 95, 4, 9
    kv = KVCacheManager(200, B, 0.0, enable_prefix_caching=True)  # 416 would not fit
    prefix = list(range(prefix_blocks * B))
    assert kv.allocate_slots("p", len(prefix), write_from=0)
    kv.cache_computed("p", prefix, len(prefix), CacheScope())
    kids = [f"b{i}" for i in range(branches)]
    for k in kids:
        kv.fork("p", k)
    kv.release("p")  # the parent is pruned, its branches go on
    for i, k in enumerate(kids):
        toks = prefix + [10_000 * (i + 1) + j for j in range(private * B)]
        assert kv.allocate_slots(k, len(toks), write_from=len(prefix))
        kv.cache_computed(k, toks, len(toks), CacheScope())
    assert kv.pool.num_used == prefix_blocks + branches * private == 131
    assert kv.num_cow_copies == 0  # the prefix ends on a block boundary: nothing to copy
    assert all(kv.pool.ref_counts[b] == branches + 1 for b in kv.table("b0").block_ids[:prefix_blocks])
    for k in kids:
        kv.release(k)
    kv.clear_cache()
    assert kv.pool.num_free == kv.num_blocks


# ------------------------------------------------------- stateful property test

B = 2
PREFIXES = [[1, 2, 3, 4, 5], [1, 2, 3, 4, 6, 6, 6], [9, 9, 9], []]
SALTS = [CacheScope(), CacheScope("tenant")]


class KVMachine(RuleBasedStateMachine):
    """add (match + allocate) / fork / append / finish / cancel / evict /
    match / invalidate / clear, checked after every step: refcount = table
    references + tree references, free + used = total, nothing both free and
    referenced, no parent evicted before a child, and every request reads
    back exactly the tokens it holds."""

    def __init__(self):
        super().__init__()
        self.kv = KVCacheManager(24, B, 0.0, enable_prefix_caching=True)
        self.content: dict = {}
        self.reqs: dict[str, tuple[list[int], str | None]] = {}
        self.n = 0

    def _new_id(self) -> str:
        self.n += 1
        return f"r{self.n}"

    def _pick(self, data) -> str:
        return data.draw(st.sampled_from(sorted(self.reqs)))

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=5),
          salt=st.sampled_from(SALTS))
    def add(self, prefix, suffix, salt):
        toks = prefix + suffix
        if not toks:
            return
        rid = self._new_id()
        hit = self.kv.match(rid, toks, salt)
        start = hit.num_tokens if hit else 0
        assert start % B == 0 and start < len(toks)
        if not (self.kv.can_admit(rid, len(toks), hit)
                and self.kv.allocate_slots(rid, len(toks), hit, write_from=start)):
            assert rid not in self.kv.tables
            return
        if hit:  # the hit serves exactly the tokens it claims
            assert read(self.kv, self.content, rid, start) == toks[:start]
        write(self.kv, self.content, rid, toks, start)
        self.kv.cache_computed(rid, toks, len(toks), salt)
        self.reqs[rid] = (toks, salt)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data(), more=st.lists(st.integers(0, 3), min_size=1, max_size=5), cache=st.booleans())
    def append(self, data, more, cache):
        rid = self._pick(data)
        toks, salt = self.reqs[rid]
        new = toks + more
        if not self.kv.allocate_slots(rid, len(new), write_from=len(toks)):
            return
        write(self.kv, self.content, rid, new, len(toks))
        if cache:
            self.kv.cache_computed(rid, new, len(new), salt)
        self.reqs[rid] = (new, salt)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def fork(self, data):
        rid = self._pick(data)
        child = self._new_id()
        used = self.kv.pool.num_used
        self.kv.fork(rid, child)
        assert self.kv.pool.num_used == used
        self.reqs[child] = (list(self.reqs[rid][0]), self.reqs[rid][1])

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def finish(self, data):
        rid = self._pick(data)
        toks, salt = self.reqs.pop(rid)
        self.kv.release(rid, toks, len(toks), salt)

    @precondition(lambda self: self.reqs)
    @rule(data=st.data())
    def cancel(self, data):
        rid = self._pick(data)
        self.reqs.pop(rid)
        self.kv.release(rid)

    @rule(k=st.integers(0, 10))
    def evict(self, k):
        free = self.kv.pool.num_free
        freed = self.kv.radix.evict(k)
        assert self.kv.pool.num_free == free + freed

    @rule(prefix=st.sampled_from(PREFIXES), suffix=st.lists(st.integers(0, 3), max_size=5),
          salt=st.sampled_from(SALTS))
    def match(self, prefix, suffix, salt):
        toks = prefix + suffix
        hit = self.kv.match("probe", toks, salt)
        if hit:
            B_ = self.kv.block_size
            got = [self.content[b][i] for b in hit.block_ids for i in range(B_)]
            assert got == toks[:hit.num_tokens]

    @rule(prefix=st.sampled_from(PREFIXES), salt=st.sampled_from(SALTS), whole=st.booleans())
    def invalidate(self, prefix, salt, whole):
        self.kv.invalidate(None if whole else prefix, salt)
        if whole or prefix:
            probe = prefix + [0] * 4
            hit = self.kv.match("probe", probe, salt)
            assert hit is None or (not whole and hit.num_tokens <= (len(prefix) - 1) // B * B)

    @rule()
    def clear(self):
        self.kv.clear_cache()
        assert self.kv.radix.num_evictable_blocks == 0

    # --- invariants
    def _pinned_nodes(self):
        seen = {id(n): n for n in self.kv.radix.iter_nodes()}
        for st_ in self.kv._prefix.values():
            n = st_.node
            while n is not None and not n.is_root:
                seen.setdefault(id(n), n)
                n = n.parent
        return list(seen.values())

    @invariant()
    def refcounts_and_contents(self):
        kv = self.kv
        kv.pool.check()
        assert kv.pool.num_free + kv.pool.num_used == kv.num_blocks
        assert set(kv.tables) == set(self.reqs)
        refs = Counter(b for t in kv.tables.values() for b in t.block_ids)
        refs.update(b for n in self._pinned_nodes() for b in n.block_ids)
        for b in range(kv.num_blocks):
            assert kv.pool.ref_counts[b] == refs.get(b, 0), f"block {b}"
        assert not set(kv.pool._free) & set(refs), "a free block is referenced"
        for rid, (toks, _) in self.reqs.items():
            assert len(kv.table(rid)) == blocks_for(len(toks), B)
            assert read(kv, self.content, rid, len(toks)) == toks, rid
        assert not kv._copies

    @invariant()
    def no_parent_gone_before_a_child(self):
        for n in self.kv.radix.iter_nodes():
            assert not n.detached and not n.parent.detached
            assert n.parent.children[n.key[0]] is n

    def teardown(self):
        for rid, (toks, salt) in list(self.reqs.items()):
            self.kv.release(rid, toks, len(toks), salt)
        self.kv.clear_cache()
        assert self.kv.pool.num_free == self.kv.num_blocks
        self.kv.pool.check()


KVMachine.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                       suppress_health_check=[HealthCheck.too_slow])
test_kv_manager_stateful = KVMachine.TestCase


class KVMachineWithLowerTiers(KVMachine):
    """The same machine with the hierarchical cache attached: LRU eviction
    spills to a 6-block host tier and a 6-block disk tier (demoting, then
    dropping), and matches load blocks back into the tree. The stand-in KV
    travels with them, so a block loaded under the wrong hash, in the wrong
    order or after an invalidation reads back wrong tokens."""

    def __init__(self):
        super().__init__()
        import torch

        from trajserve.kv.lower_tiers import LowerTiers

        def read_blocks(ids):
            rows = [self.content.get(b, [None] * B) for b in ids]
            return torch.tensor([[-1 if t is None else t for t in r] for r in rows], dtype=torch.long)

        def write_blocks(ids, data):
            for b, row in zip(ids, data.tolist()):
                self.content[b] = [None if t == -1 else t for t in row]

        per = B * 8  # one stand-in block: B int64 tokens
        self.lower = LowerTiers(read_blocks, write_blocks, 6 * per, 6 * per, files=False)
        self.kv.attach_lower_tiers(self.lower)

    @invariant()
    def tiers_within_caps(self):
        assert self.lower.num_host_blocks <= 6 and self.lower.num_disk_blocks <= 6

    def teardown(self):
        super().teardown()
        assert self.lower.num_host_blocks == 0 and self.lower.num_disk_blocks == 0


KVMachineWithLowerTiers.TestCase.settings = settings(max_examples=200, stateful_step_count=40, deadline=None,
                                                     suppress_health_check=[HealthCheck.too_slow])
test_kv_manager_stateful_with_lower_tiers = KVMachineWithLowerTiers.TestCase
