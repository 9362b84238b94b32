"""A persistent disk tier across restarts (--kv-disk-dir): what a clean close
writes down, and what the next engine on the directory adopts.

    persist(paths)   before a clean close: the host tier's blocks, then the
                     device tree's, go down to disk (the cap holds: the
                     oldest fall off first)
    _restore()       at start-up: this model's and layout's blocks, newest
                     first up to the cap; the rest are removed

A mixin of LowerTiers (kv/lower_tiers.py): it works on the tiers' own
stores, index, LRU order and stats.
"""
from __future__ import annotations

import logging
from collections.abc import Hashable, Iterable

from trajserve.kv.tiers import namespace_digest

log = logging.getLogger("trajserve")


class DiskRestarts:
    def persist(self, paths: Iterable[tuple[Hashable, list[bytes], list[int]]]) -> int:
        """Before a clean close of a persistent tier: the host tier's blocks,
        then these device blocks (namespace, hashes, block ids; oldest
        first), go down to disk, so the next engine on the directory finds
        them. The cap holds: the oldest fall off first. Returns the blocks sent down."""
        if not self.persistent:
            return 0
        written = 0
        while self._demote_oldest_host():  # all but blocks a session holds (closed sessions hold none)
            written += 1
        for namespace, hashes, block_ids in paths:
            ns = namespace_digest(namespace)
            todo = [(h, b) for h, b in zip(hashes, block_ids) if h.hex() not in self._ns]
            if not todo:
                continue
            data = self._read([b for _, b in todo])
            for (h, _), block in zip(todo, data):
                key = h.hex()
                self._index(key, ns)
                if self._to_disk(key, block):
                    written += 1
                else:
                    self._unindex(key)
        self.flush()
        return written

    def _restore(self) -> None:
        """Adopt the blocks a previous engine left in the directory: this
        model's and layout's, newest first up to the cap; the rest go."""
        found = self.disk.scan(lambda ident: ident.block_hash.hex())
        found.sort(key=lambda e: e[3], reverse=True)
        keep, used = [], 0
        for key, ident, size, _ in found:
            if used + size <= self.disk.byte_cap:
                keep.append((key, ident, size))
                used += size
            else:
                self.disk.path(key).unlink(missing_ok=True)
        for key, ident, size in reversed(keep):  # oldest first: the LRU's order
            self.disk.register(key, ident, size)
            self._disk_lru[key] = size
            self._disk_used += size
            self._index(key, ident.namespace)
            self._note("disk", True, key)
        self.stats.restored_blocks = len(keep)
        self.stats.corrupt_blocks += self.disk.num_rejected
        self.stats.mislabelled_blocks += self.disk.num_mislabelled
        over = len(found) - len(keep)
        log.info("prefix cache disk tier %s: %d blocks (%d bytes) kept from earlier runs%s", self.disk.dir,
                 len(keep), used, f", {over} over the cap removed" if over else "")
