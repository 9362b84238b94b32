"""The cluster's prefix directory: which replica holds which block, where.

kv-cache-management, "跨轮次前缀缓存" (figure 7): a prompt is cut into
blocks and fingerprinted as a rolling hash chain h_k = H(h_{k-1} || c_k);
a central directory of those hashes says which worker holds a matching
prefix. The hashes are the radix cache's own (kv/radix_node.py chain_hash,
h_0 = the namespace's hash: model, cache_salt and LoRA adapter), so a hash
names a whole prefix under one namespace: salts and adapters partition the
directory by construction, and "replica r holds h_k" means it holds the
first k blocks' KV of every prompt that starts that way.

Replicas report KV events (blocks stored on a tier, or gone from it; the
radix cache reports its own: kv/radix_cache.py on_event): `apply` keeps,
per hash, the tiers each replica holds it on (a bit each: a block loaded
back to the device may keep its host copy). `match` walks a prompt's hashes
for one replica and counts the blocks it holds, each at its best tier, up
to the first block it does not hold (a block after a gap is of no use: its
prefix would be recomputed anyway). A prefix a request sent there is
computing counts as held on the device (`promise` / `settle`).
"""
from __future__ import annotations

from collections.abc import Hashable, Iterable, Sequence
from dataclasses import dataclass

from trajserve.kv.radix_node import chain_hash, namespace_hash

TIERS = ("device", "host", "disk")  # the order a block moves down
_BIT = {t: 1 << i for i, t in enumerate(TIERS)}
_BEST = {bits: TIERS[(bits & -bits).bit_length() - 1] for bits in range(1, 8)}  # lowest set bit


def prompt_hashes(namespace: Hashable, token_ids: Sequence[int], block_size: int) -> list[bytes]:
    """The chained hashes of a prompt's full blocks, as a replica's radix
    cache computes them (KVCacheManager.prefix_hashes) for namespace
    (model_id, cache scope)."""
    h = namespace_hash(namespace)
    out = []
    for i in range(0, len(token_ids) - block_size + 1, block_size):
        h = chain_hash(h, tuple(token_ids[i:i + block_size]))
        out.append(h)
    return out


@dataclass(frozen=True, slots=True)
class KVEvent:
    """What a replica reports: `hashes` stored on `tier` there (or gone from it)."""
    replica: int
    hashes: tuple[bytes, ...]
    tier: str = "device"
    stored: bool = True


@dataclass(frozen=True, slots=True)
class Held:
    """A replica's blocks of one prompt's prefix, by tier (leading run)."""
    device: int = 0
    host: int = 0
    disk: int = 0

    @property
    def blocks(self) -> int:
        return self.device + self.host + self.disk


class PrefixDirectory:
    def __init__(self) -> None:
        self._where: dict[bytes, dict[int, int]] = {}  # hash -> {replica: tier bits}
        # Prefixes a replica was sent and is computing (or has queued): hash ->
        # {replica: requests}. A router that sees only stored blocks would send
        # a second agent with the same preamble elsewhere while the first one's
        # prefill runs (or before the replica's report of it arrives) and
        # compute the preamble twice; a promise counts as held on the device
        # until the request is done, by which time its own events have come.
        self._promised: dict[bytes, dict[int, int]] = {}
        self.num_events = 0

    def promise(self, replica: int, hashes: Iterable[bytes]) -> None:
        for h in hashes:
            holders = self._promised.setdefault(h, {})
            holders[replica] = holders.get(replica, 0) + 1

    def settle(self, replica: int, hashes: Iterable[bytes]) -> None:
        """The request that promised hashes on replica is done (or failed)."""
        for h in hashes:
            holders = self._promised.get(h)
            if holders is None or replica not in holders:
                continue
            holders[replica] -= 1
            if not holders[replica]:
                del holders[replica]
                if not holders:
                    del self._promised[h]

    def apply(self, event: KVEvent) -> None:
        bit = _BIT.get(event.tier)
        if bit is None:
            raise ValueError(f"KV event tier must be one of {', '.join(TIERS)}, got {event.tier!r}")
        self.num_events += 1
        r = event.replica
        for h in event.hashes:
            holders = self._where.get(h)
            if event.stored:
                if holders is None:
                    holders = self._where[h] = {}
                holders[r] = holders.get(r, 0) | bit
            elif holders is not None and r in holders:
                left = holders[r] & ~bit
                if left:
                    holders[r] = left
                else:
                    del holders[r]
                    if not holders:
                        del self._where[h]

    def forget_replica(self, replica: int) -> int:
        """A replica died or restarted empty: none of its blocks (or promises) count. Returns the hashes it held."""
        for h in list(self._promised):
            holders = self._promised[h]
            if holders.pop(replica, None) is not None and not holders:
                del self._promised[h]
        n = 0
        for h in list(self._where):
            holders = self._where[h]
            if holders.pop(replica, None) is not None:
                n += 1
                if not holders:
                    del self._where[h]
        return n

    def match(self, replica: int, hashes: Iterable[bytes]) -> Held:
        counts = dict.fromkeys(TIERS, 0)
        for h in hashes:
            bits = self._where.get(h, {}).get(replica)
            if not bits:
                if replica not in self._promised.get(h, ()):
                    break
                bits = _BIT["device"]  # being computed there
            counts[_BEST[bits]] += 1
        return Held(**counts)

    def __len__(self) -> int:
        return len(self._where)
