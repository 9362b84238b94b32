"""Priority on the lower tiers (kv/tier_classes.py): a block the device
spills keeps its path's priority, and the host and disk tiers take the least
urgent class first, the oldest within it, as the device does; retained
prefixes still go last; under FCFS (every class 0) plain LRU."""
from __future__ import annotations

import torch
from test_lower_tiers import B, manager

from trajserve.kv.lower_tiers import LowerTiers
from trajserve.kv.retention import Retention
from trajserve.kv.scope import CacheScope
from trajserve.kv.tier_classes import TierClasses


def run(kv, pool, rid: str, tokens: list[int], priority: int | None = None) -> int:
    """Admit, write the tokens into their blocks, release with `priority`;
    the tokens the cache matched (each matched block checked)."""
    scope = CacheScope(None)
    hit = kv.match(rid, tokens, scope)
    matched = hit.num_tokens if hit else 0
    if hit:
        assert pool.data[hit.block_ids].flatten().tolist() == tokens[:matched]
    assert kv.allocate_slots(rid, len(tokens), hit)
    for i, b in enumerate(kv.table(rid).block_ids):
        if len(tokens[i * B:(i + 1) * B]) == B and i * B >= matched:
            pool.data[b] = torch.tensor(tokens[i * B:(i + 1) * B])
    kv.release(rid, tokens, len(tokens), scope, priority=priority)
    return matched


def test_classes_count_per_tier_and_know_the_least_urgent():
    c = TierClasses()
    c.set("a", -5)
    c.set("b", 7)
    c.set("z", 0)  # class 0 is not recorded
    for k in "abz":
        c.moved("host", True, k)
    assert c.worst("host", 3) == 7 and c.worst("disk", 0) == 0
    c.moved("host", False, "b")
    c.moved("disk", True, "b")
    assert c.worst("host", 2) == 0 and c.worst("disk", 1) == 7
    assert c.worst("host", 1) == -5  # only "a" left there: its class is the least urgent present
    c.moved("disk", False, "b")
    c.forget("b")
    assert c.of("b") == 0 and c.worst("disk", 0) == 0


def test_the_host_tier_drops_a_newer_plain_prefix_before_an_older_urgent_one():
    kv, pool, lower = manager(num_blocks=6, host_blocks=8)
    urgent = list(range(100, 116))           # 4 blocks, priority -5
    run(kv, pool, "urgent", urgent, -5)
    run(kv, pool, "x", list(range(200, 224)), 0)     # 6 blocks: urgent spills to the host
    run(kv, pool, "bulk", list(range(300, 316)), 7)  # x's blocks spill
    run(kv, pool, "y", list(range(400, 416)), 0)     # bulk spills; the host is full: x's go, not urgent's
    assert lower.stats.dropped_blocks > 0
    assert run(kv, pool, "urgent-again", urgent + [1], -5) == 16  # plain LRU would have dropped it first


def test_the_least_urgent_class_leaves_the_host_first_and_keeps_its_class_on_disk(tmp_path):
    kv, pool, lower = manager(num_blocks=6, host_blocks=4, disk_blocks=4, tmp_path=tmp_path)
    plain, bulk = list(range(100, 116)), list(range(200, 216))
    run(kv, pool, "plain", plain, 0)
    run(kv, pool, "bulk", bulk, 7)
    demoted = []
    for k in range(2):  # push both down, host then disk: 16 blocks where 14 fit
        run(kv, pool, f"f{k}", list(range(1000 * (k + 1), 1000 * (k + 1) + 16)), 0)
        demoted += [h for h in lower.contents()["disk"] if lower.classes.of(h.hex()) == 7]
    assert demoted  # bulk's blocks went down to disk with their class
    assert lower.stats.dropped_blocks > 0
    assert run(kv, pool, "plain-again", plain + [1], 0) == 16  # the older class 0 outlived the newer class 7
    assert run(kv, pool, "bulk-again", bulk + [1], 7) < 16


def _tiers(host_blocks: int) -> LowerTiers:
    blocks = torch.zeros(64, 4)
    return LowerTiers(lambda ids: blocks[ids].clone(), lambda ids, data: None, host_blocks * 16)


def test_a_retained_block_goes_last_whatever_its_class():
    t = _tiers(3)
    t.retention = Retention()
    t.save("ns", [b"\x01" * 16], [0], priority=7)
    t.retention.retain([b"\x01" * 16], 300)
    t.save("ns", [b"\x02" * 16], [1], priority=-5)
    t.save("ns", [b"\x03" * 16], [2], priority=0)
    t.save("ns", [b"\x04" * 16], [3], priority=0)  # full: of the unretained, class 0 (the oldest of it) goes
    assert [h[0] for h in t.contents()["host"]] == [1, 2, 4]


def test_fcfs_is_plain_lru():
    t = _tiers(2)
    for i in range(1, 5):
        t.save("ns", [bytes([i]) * 16], [i])
    assert [h[0] for h in t.contents()["host"]] == [3, 4] and not t.classes._of
