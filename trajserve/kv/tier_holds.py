"""Paused sessions on the lower tiers: holds on blocks named by their chained hashes.

A session paused to the host or disk tier (sessions/pause_machine.py decides,
sessions/offload.py copies) stores its path's blocks in the same tiers
as the prefix cache's LRU spill (kv/lower_tiers.py), under the same names:
the chained hash of each block's prefix, so a name is an identity (the disk
format checks it, with the CRC). Stored once: a block already on a tier,
because another session saved the same preamble or LRU spilled it, gets one
more hold instead of a second copy.

    reserve(tier, n)   room for n blocks, before the copy starts (a full tier
                       falls through: the pause machine asks host, then disk)
    hold(...)          the copy landed: store what is missing, hold every block
    fetch(...)         the blocks back, in order, up to the first missing or
                       failing its checks (the rest is recomputed)
    release(...)       let go; forget=True also drops what nobody else holds
                       (it is on the device again, or its session closed),
                       forget=False leaves it as an ordinary tier block that
                       the next match promotes (a resume that found no room)

A mixin of LowerTiers: it works on the tiers' own stores, index and lock.
"""
from __future__ import annotations

from collections.abc import Sequence

import torch


class SessionHolds:
    def hold_free_bytes(self, tier: str) -> int:
        """Bytes a session could still hold on the tier: its cap less what is
        held and reserved (LRU blocks give way)."""
        cap = self.host.byte_cap if tier == "host" else (self.disk.byte_cap if self.disk is not None else 0)
        return max(0, cap - self._held_bytes[tier] - self._reserved[tier])

    def reserve(self, tier: str, nbytes: int) -> bool:
        if nbytes > self.hold_free_bytes(tier):
            return False
        self._reserved[tier] += nbytes
        return True

    def unreserve(self, tier: str, nbytes: int) -> None:
        self._reserved[tier] -= nbytes

    def hold(self, namespace_digest: bytes, hashes: Sequence[bytes], blocks: Sequence[torch.Tensor], tier: str,
             reserved: int) -> int:
        """A session's saved blocks landed (their room reserved): each one the
        tiers do not hold yet is stored on `tier`, and every one is held.
        Returns how many are held (all, unless the tier refused one)."""
        self.unreserve(tier, reserved)
        n = 0
        for h, block in zip(hashes, blocks):
            key = h.hex()
            if key not in self._ns:
                self._index(key, namespace_digest)
                ok = self._to_host(key, block, held=True) if tier == "host" else self._to_disk(key, block, held=True)
                if not ok:
                    self._unindex(key)
                    break
            elif self._ns[key] != namespace_digest:
                self.stats.mislabelled_blocks += 1
                break  # a hash of another namespace cannot be this prefix: never share it
            if key not in self._holds:
                where, size = self._held_size(key)
                self._held_bytes[where] += size
            self._holds[key] = self._holds.get(key, 0) + 1
            n += 1
        return n

    def fetch(self, namespace_digest: bytes, hashes: Sequence[bytes]) -> list[torch.Tensor]:
        """The blocks in order, up to the first missing or failing its checks
        (a block still queued for its disk write is served from memory)."""
        out = []
        for h in hashes:
            b, _ = self._lookup(namespace_digest, h)
            if b is None:
                break
            out.append(b)
        return out

    def release(self, hashes: Sequence[bytes], forget: bool) -> None:
        for h in hashes:
            key = h.hex()
            count = self._holds.get(key)
            if count is None:
                continue  # invalidated meanwhile
            if count > 1:
                self._holds[key] = count - 1
                continue
            where, size = self._held_size(key)
            self._held_bytes[where] -= size
            del self._holds[key]
            if forget:
                self._forget(key)

    def num_held(self) -> int:
        return len(self._holds)

    def held_bytes(self) -> dict[str, int]:
        return dict(self._held_bytes)

    def _held_size(self, key: str) -> tuple[str, int]:
        b = self.host.get(key)
        if b is not None:
            return "host", b.nbytes
        return "disk", self._disk_lru.get(key, 0)
