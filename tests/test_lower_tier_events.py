"""The host and disk tiers report every block that enters or leaves them
(LowerTiers.on_event, which the cluster's prefix directory follows through
a replica's reports): a directory fed by those events agrees with what the
tiers hold after any sequence of spills, demotions, loads, session holds,
invalidations and clears."""
from __future__ import annotations

import random

import torch

from trajserve.cluster.directory import KVEvent, PrefixDirectory
from trajserve.kv.tiers import namespace_digest
from trajserve.kv.lower_tiers import LowerTiers


def _held(tiers: LowerTiers) -> dict[str, set[bytes]]:
    return {tier: set(hashes) for tier, hashes in tiers.contents().items()}


def test_tier_events_track_both_tiers_through_random_operations():
    rng = random.Random(7)
    tiers = LowerTiers.stand_in(host_blocks=5, disk_blocks=7)
    seen = {"host": set(), "disk": set()}
    directory = PrefixDirectory()

    def on_event(tier: str, stored: bool, h: bytes) -> None:
        (seen[tier].add if stored else seen[tier].discard)(h)
        directory.apply(KVEvent(0, (h,), tier, stored))
    tiers.on_event = on_event
    namespaces = [("model", None), ("model", "salt")]
    hashes = [bytes([i]) * 16 for i in range(24)]
    block = torch.zeros(1, dtype=torch.uint8)
    counts = {"save": 0, "load": 0, "hold": 0, "release": 0, "discard": 0, "clear": 0}
    for _ in range(400):
        op = rng.choices(list(counts), weights=[8, 4, 2, 2, 1, 0.3])[0]
        ns = rng.choice(namespaces)
        start = rng.randrange(0, 20)
        run = hashes[start:start + rng.randrange(1, 5)]
        if op == "save":
            tiers.save(ns, run, list(range(len(run))))
        elif op == "load":
            tiers.load(ns, run, list(range(len(run))))
        elif op == "hold" and tiers.reserve("host", len(run)):
            tiers.hold(namespace_digest(ns), run, [block] * len(run), "host", len(run))
        elif op == "release":
            tiers.release(run, forget=rng.random() < 0.5)
        elif op == "discard":
            tiers.discard_namespace(ns)
        elif op == "clear":
            tiers.clear()
        counts[op] += 1
        assert seen == _held(tiers), op
        assert seen["host"] == {bytes.fromhex(k) for k in tiers.host._blocks}  # contents() is what the tiers hold
    assert min(counts.values()) > 0, counts  # every kind of operation ran
    assert tiers.stats.demoted_blocks > 0 and tiers.stats.loaded_host_blocks > 0
    held = _held(tiers)
    for h in hashes:  # the directory's view, a tier bit each
        got = directory.match(0, [h])
        assert (got.host, got.disk) == (int(h in held["host"]), int(h in held["disk"] and h not in held["host"]))
