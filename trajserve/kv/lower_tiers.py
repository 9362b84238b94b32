"""The radix cache's lower tiers: a hierarchical KV cache (device -> host -> disk).

Spec: kv-cache-management "分层辅助存储" (host DRAM holds seconds-scale
state, NVMe minutes and longer) and "动态基数树淘汰" (leaf-first LRU).

Without lower tiers, a block the radix cache evicts is gone and the next
request that needs it recomputes it. With them:

    device  --LRU evict-->  host  --LRU when full-->  disk  --LRU when full-->  dropped
       ^                      |                         |
       +------ a match reaches a block held below: loaded back into the tree

"LRU" is the order within a priority: a spilled block keeps its path's
priority, and each tier takes its least urgent class first
(kv/tier_classes.py), retained prefixes last (kv/retention.py).

Blocks are named by their chained hash (radix_cache.chain_hash: the hash of
a block's tokens chained through every block before it, under the
namespace's hash), so equal names mean equal prefixes: a block loaded back
is exactly the KV the tree would have computed for that position. Each tier
is exclusive: a block loaded back leaves the tier (it is on the device, and
will come down again if evicted again).

Paused agent sessions store their state here too (sessions/offload.py),
under the same chained hashes: a block already on a tier (a shared preamble
another session saved, or LRU spilled) is held, not stored again. A held
block is never evicted by LRU (its room was reserved before its copy began);
when the last hold goes it is an ordinary tier block, which a match can
promote, or is forgotten when the session has it back on the device.

Disk blocks carry their identity and a checksum (kv/tiers.py): a
block that is damaged or is not the one asked for (another namespace,
hash, model or layout) is reported missing, so the match stops there and
the rest of the prompt is recomputed -- never served corrupt or mislabelled.

A --kv-disk-dir survives restarts (kv/tier_restarts.py): the tier holds the directory's lock
(a second engine on it is refused), scans it at start-up and keeps the
blocks of this model and layout, newest first, up to the cap (the rest,
temporary and foreign files are removed); a clean close writes what the
device tree and the host tier hold down to disk first, so a conversation
computed before a restart hits after it. A crash loses only blocks not yet
on disk: files are written under a temporary name and renamed.

Copies between the device and the host run on the engine thread: an
eviction reads the blocks before the pool reuses them, a load writes them
before the step that reads them. Disk writes (host -> disk demotions) run
on one background thread, so a step never waits for a write it does not
need: a block queued for writing is already counted against the disk cap,
is served from memory if a match wants it back first, and is simply not
written if it leaves the tier before its turn.
"""
from __future__ import annotations

import functools
import logging
import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from dataclasses import dataclass

import torch

from trajserve.kv.dir_lock import ScratchDir, sweep_orphans
from trajserve.kv.retention import Retention
from trajserve.kv.tier_classes import TierClasses
from trajserve.kv.tier_holds import SessionHolds
from trajserve.kv.tier_restarts import DiskRestarts
from trajserve.kv.tiers import BlockIdentity, BlockLayout, DiskKVStore, HostKVStore, namespace_digest

log = logging.getLogger("trajserve")

ReadBlocks = Callable[[list[int]], Sequence[torch.Tensor]]  # ModelRunner.read_blocks: a tensor of rows
WriteBlocks = Callable[[list[int], torch.Tensor], None]  # ModelRunner.write_blocks


@dataclass(slots=True)
class LowerTierStats:
    saved_blocks: int = 0       # evicted from the device into the host tier (or straight to disk)
    demoted_blocks: int = 0     # host -> disk, LRU, to make room
    dropped_blocks: int = 0     # fell off the last tier (or had nowhere to go)
    loaded_host_blocks: int = 0
    loaded_disk_blocks: int = 0
    corrupt_blocks: int = 0     # failed the disk checks on the way back (damaged or mislabelled)
    # Sound blocks refused for their identity: files that held another block or
    # layout, and blocks asked for under a namespace (scope) they were not stored in.
    mislabelled_blocks: int = 0
    discarded_blocks: int = 0   # invalidated or cleared
    write_errors: int = 0       # disk writes that failed (the block is dropped, recomputed on demand)
    restored_blocks: int = 0    # found on disk at start-up, of this model and layout


class _DiskBookkeeping(HostKVStore):
    """The disk tier's capacity and LRU order without files, for stand-in
    tiers (millions of simulated blocks must not become millions of files)."""
    num_corrupt = 0

    @staticmethod
    def file_bytes(block: torch.Tensor) -> int:
        return block.nbytes

    num_rejected = num_mislabelled = 0  # nothing is read back from a file

    def put(self, key: str, block: torch.Tensor, copy: bool = False) -> bool:
        return super().put(key, block, copy)

    def get(self, key: str, expect: BlockIdentity | None = None) -> torch.Tensor | None:
        return super().get(key)


@functools.lru_cache(maxsize=4096)
def _ns_digest(namespace: Hashable) -> bytes:
    return namespace_digest(namespace)


class LowerTiers(SessionHolds, DiskRestarts):
    def __init__(self, read_blocks: ReadBlocks, write_blocks: WriteBlocks, host_bytes: int,
                 disk_bytes: int = 0, disk_dir: str | None = None, *, layout: BlockLayout | None = None,
                 window_layout: BlockLayout | None = None, files: bool = True, copy: bool = True,
                 keep_files: bool = True) -> None:
        """layout: the engine's KV block layout (model fingerprint, dtype,
        shape), which every disk file carries; window_layout: a window model's
        block with its window part (kv/window_parts.py). disk_dir: a directory kept
        across restarts (keep_files False: locked while in use, emptied at
        close: paused sessions' state does not outlive its manager); without
        one, a scratch directory removed at close."""
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError("lower tier sizes must be >= 0 bytes")
        self._read, self._write = read_blocks, write_blocks
        self._carried = layout.shape[0] if layout and window_layout else None  # more layers: a window part too
        self._copy = copy  # stand-in blocks are one shared byte: nothing to copy
        self.host = HostKVStore(host_bytes)
        self._tmp: ScratchDir | None = None
        self.persistent = False
        self.disk: DiskKVStore | _DiskBookkeeping | None = None
        if disk_bytes and not files:
            self.disk = _DiskBookkeeping(disk_bytes)
        elif disk_bytes:
            if layout is None:
                raise ValueError("a disk tier needs the KV block layout its files carry")
            sweep_orphans()  # scratch directories of engines that were killed (a scratch tier sweeps too)
            if disk_dir is None:
                self._tmp = ScratchDir("cache")
                self.disk = DiskKVStore(self._tmp.name, disk_bytes, layout, lock=False, window_layout=window_layout)
            else:
                self.disk = DiskKVStore(disk_dir, disk_bytes, layout, window_layout=window_layout)
                self.persistent = keep_files
        self._ns: dict[str, bytes] = {}            # key -> namespace digest
        self._by_ns: dict[bytes, set[str]] = {}    # namespace digest -> keys in either tier
        self.stats = LowerTierStats()
        # The disk tier's LRU order and sizes, written or still queued (the cap counts both).
        self._disk_lru: OrderedDict[str, int] = OrderedDict()
        self._disk_used = 0
        # Real files: one writer thread; the disk store is touched under the lock.
        self._pending: dict[str, tuple[torch.Tensor, BlockIdentity]] = {}
        # Paused sessions' holds: key -> number of holders, and the bytes per
        # tier held or reserved for saves still copying (LRU never takes them).
        self._holds: dict[str, int] = {}
        self._held_bytes = {"host": 0, "disk": 0}
        self._reserved = {"host": 0, "disk": 0}
        self._lock = threading.Lock()
        self.on_event: Callable[[str, bool, bytes], None] | None = None  # subscribe()
        self.retention: Retention | None = None  # prefixes clients asked to keep: LRU takes them last
        self.classes = TierClasses()  # spilled blocks' priorities: LRU takes the least urgent class first
        self._loading: set[str] = set()  # blocks a promotion is about to load: LRU never takes them
        self._io = (ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajserve-kv-cache-io")
                    if isinstance(self.disk, DiskKVStore) else None)
        if self.persistent:
            self._restore()

    @classmethod
    def stand_in(cls, host_blocks: int, disk_blocks: int = 0) -> LowerTiers:
        """Tiers for a control plane without a model (bench replay, simulator):
        one-byte stand-in blocks under caps of host_blocks / disk_blocks
        blocks, so they evict, demote and load back as the real ones would."""
        block = torch.zeros(1, dtype=torch.uint8)
        # A list, not a tensor of rows: millions of spilled blocks need no row views.
        return cls(lambda ids: [block] * len(ids), lambda ids, data: None, host_blocks, disk_blocks,
                   files=False, copy=False)

    # ------------------------------------------------------------ the spill
    def save(self, namespace: Hashable, hashes: list[bytes], block_ids: list[int], priority: int = 0) -> None:
        """The radix cache is evicting these device blocks: keep their KV.
        priority: their path's eviction class (kv/tier_classes.py)."""
        if not block_ids:
            return
        ns = _ns_digest(namespace)
        data = self._read(block_ids)
        for h, block in zip(hashes, data):
            key = h.hex()
            if key in self._holds:
                continue  # a paused session holds this very prefix here already
            self._forget(key)  # an older copy of the same prefix (evicted, recomputed, evicted again)
            self.stats.saved_blocks += 1
            self._index(key, ns)
            self.classes.set(key, priority)
            if not (self._to_host(key, block) or self._to_disk(key, block)):
                self._unindex(key)
                self.stats.dropped_blocks += 1

    def contains(self, block_hash: bytes) -> bool:
        return block_hash.hex() in self._ns

    @contextmanager
    def loading(self, hashes: list[bytes]):
        """While the device makes room for these blocks (its eviction spills
        blocks down here), LRU does not take them to make room in turn."""
        keys = {h.hex() for h in hashes}
        self._loading |= keys
        try:
            yield
        finally:
            self._loading -= keys

    def load(self, namespace: Hashable, hashes: list[bytes], block_ids: list[int]) -> list[bool]:
        """The blocks named by hashes into block_ids, up to the first missing or
        failing its checks; for each one loaded: did it carry its window part?"""
        blocks = []
        ns = _ns_digest(namespace)
        for h in hashes[:len(block_ids)]:
            b, where = self._lookup(ns, h)
            if b is None:
                if where == "disk":  # missing (a failed write) or rejected: recompute from here
                    self._forget(h.hex())
                break
            if where == "host":
                self.stats.loaded_host_blocks += 1
            else:
                self.stats.loaded_disk_blocks += 1
            blocks.append(b)
        if blocks:  # a list where some carry their window part
            self._write(block_ids[:len(blocks)], torch.stack(blocks) if len({b.shape for b in blocks}) == 1 else blocks)
            for h in hashes[:len(blocks)]:
                if h.hex() not in self._holds:  # a paused session keeps its copy until it lets go
                    self._forget(h.hex())  # exclusive tiers: it lives on the device now
        return [self.carries_window(b) for b in blocks]

    def carries_window(self, block: torch.Tensor) -> bool:
        """Does this saved block carry its window part (a window model's)?"""
        return self._carried is not None and block.shape[0] > self._carried

    def _lookup(self, ns: bytes, h: bytes) -> tuple[torch.Tensor | None, str | None]:
        """The block named h in namespace ns and the tier it came from: the
        host, or the disk (a block queued for its write is served from memory;
        a file passes its identity and CRC checks, a rejected one is counted).
        (None, None): not here; (None, "disk"): missing or rejected on disk.
        Touches no index, so a session's prefetch may call it off the engine thread."""
        key = h.hex()
        have = self._ns.get(key)
        if have != ns:
            if have is not None:  # held for another namespace (salt, adapter): never served under this one
                self.stats.mislabelled_blocks += 1
            return None, None
        b = self.host.get(key)
        if b is not None:
            return b, "host"
        if self.disk is None:
            return None, None
        before, mislabelled = self.disk.num_rejected, self.disk.num_mislabelled
        with self._lock:
            queued = self._pending.get(key)
            b = queued[0] if queued is not None else self.disk.get(key, BlockIdentity(ns, h))
        if b is None:
            self.stats.corrupt_blocks += self.disk.num_rejected - before
            self.stats.mislabelled_blocks += self.disk.num_mislabelled - mislabelled
        return b, "disk"

    def discard_namespace(self, namespace: Hashable) -> None:
        for key in list(self._by_ns.get(_ns_digest(namespace), ())):
            self._forget(key)
            self.stats.discarded_blocks += 1

    def clear(self) -> None:
        """Drop every block in both tiers that no paused session holds (in bulk
        when none does: a simulated run may end with millions of them)."""
        if self._holds:
            for key in [k for k in self._ns if k not in self._holds]:
                self._forget(key)
                self.stats.discarded_blocks += 1
            return
        self.stats.discarded_blocks += len(self._ns)
        if self.on_event is not None:
            for key in self.host.keys():
                self.on_event("host", False, bytes.fromhex(key))
            for key in self._disk_lru:
                self.on_event("disk", False, bytes.fromhex(key))
        self.host.clear()
        if isinstance(self.disk, _DiskBookkeeping):
            self.disk.clear()
        elif self.disk is not None:
            with self._lock:
                self._pending.clear()
                for key in self._disk_lru:  # each one's file
                    self.disk.discard(key)
        self._disk_lru.clear()
        self._disk_used = 0
        self.classes.clear()
        self._ns.clear()
        self._by_ns.clear()

    def subscribe(self, sink: Callable[[str, bool, bytes], None]) -> None:
        """sink(tier, stored, chained hash) as a block enters or leaves the host or disk
        tier, on the thread that changes it (the cluster's directory follows them)."""
        self.on_event = sink

    @contextmanager
    def exclusive_disk(self):
        """The disk store, the writer thread kept out meanwhile (calibration times its own blocks there)."""
        with self._lock:
            yield self.disk

    def flush(self) -> None:
        """Wait until every queued disk write has landed (or been skipped)."""
        if self._io is not None:
            self._io.submit(lambda: None).result()

    def close(self) -> None:
        """A persistent tier keeps its files (queued writes land first) and
        lets go of the directory; a scratch one is emptied and removed."""
        if not self.persistent:
            self._holds.clear()  # whoever held blocks here is gone: everything goes
            self._held_bytes = {"host": 0, "disk": 0}
            self.clear()
        if self._io is not None:
            self._io.shutdown(wait=True)
        if isinstance(self.disk, DiskKVStore):
            self.disk.release()  # its directory lock, if it holds one
        if self._tmp is not None:
            self._tmp.cleanup()

    # ---------------------------------------------------------- inspection
    @property
    def num_host_blocks(self) -> int:
        return len(self.host)

    @property
    def num_disk_blocks(self) -> int:
        """Blocks in the disk tier, written or queued."""
        return len(self._disk_lru)

    @property
    def num_pending_writes(self) -> int:
        with self._lock:
            return len(self._pending)

    def contents(self) -> dict[str, list[bytes]]:
        """The chained hashes each tier holds now (what on_event reports from here on)."""
        return {"host": [bytes.fromhex(k) for k in self.host.keys()],
                "disk": [bytes.fromhex(k) for k in self._disk_lru]}

    def metrics(self) -> dict:
        st = self.stats
        return {"host_blocks": self.num_host_blocks, "host_bytes": self.host.nbytes,
                "disk_blocks": self.num_disk_blocks, "disk_bytes": self._disk_used,
                "pending_disk_writes": self.num_pending_writes,
                "saved_blocks": st.saved_blocks, "demoted_blocks": st.demoted_blocks,
                "dropped_blocks": st.dropped_blocks, "loaded_host_blocks": st.loaded_host_blocks,
                "loaded_disk_blocks": st.loaded_disk_blocks, "corrupt_blocks": st.corrupt_blocks,
                "mislabelled_blocks": st.mislabelled_blocks, "discarded_blocks": st.discarded_blocks,
                "write_errors": st.write_errors, "restored_blocks": st.restored_blocks}

    # ------------------------------------------------------------- private
    def _to_host(self, key: str, block: torch.Tensor, held: bool = False) -> bool:
        size = block.nbytes
        # Room held or reserved for sessions is not LRU's; a held block uses its own reservation.
        keep = self._held_bytes["host"] + (0 if held else self._reserved["host"])
        if size > self.host.byte_cap - keep:
            return False
        while self.host.free_bytes - (0 if held else self._reserved["host"]) < size:
            if not self._demote_oldest_host():
                return False
        if not self.host.put(key, block, self._copy):
            return False
        self._note("host", True, key)
        return True

    def _victim(self, tier: str, keys: Iterable[str], blocks: int) -> str | None:
        """The block LRU takes next from a tier's keys (oldest first): never
        one a paused session holds or a promotion is loading; retained ones
        last; of the rest the tier's least urgent class first, the oldest
        within it (kv/tier_classes.py). Stops at the first key of that class."""
        worst = self.classes.worst(tier, blocks)
        best, best_rank = None, None
        for key in keys:
            if key in self._holds or key in self._loading:
                continue
            retained = bool(self.retention) and self.retention.holds_hex(key)
            p = self.classes.of(key)
            if not retained and p == worst:
                return key
            if best_rank is None or (retained, -p) < best_rank:
                best, best_rank = key, (retained, -p)
        return best

    def _demote_oldest_host(self) -> bool:
        key = self._victim("host", self.host.in_lru_order(), len(self.host))
        if key is None:
            return False
        block = self.host.get(key)
        self.host.discard(key)
        self._note("host", False, key)
        if self._to_disk(key, block):
            self.stats.demoted_blocks += 1
        else:
            self._unindex(key)
            self.stats.dropped_blocks += 1
        return True

    def _to_disk(self, key: str, block: torch.Tensor, held: bool = False) -> bool:
        disk = self.disk
        if disk is None:
            return False
        size = disk.file_bytes(block)
        room = disk.byte_cap - (0 if held else self._reserved["disk"])
        if size > room - self._held_bytes["disk"]:
            return False
        while self._disk_used + size > room:
            old = self._victim("disk", self._disk_lru, len(self._disk_lru))
            if old is None:
                return False
            self._disk_discard(old)
            self._unindex(old)
            self.stats.dropped_blocks += 1
        self._disk_lru[key] = size
        self._disk_used += size
        self._note("disk", True, key)
        if self._io is None:
            return disk.put(key, block)
        with self._lock:
            self._pending[key] = (block, BlockIdentity(self._ns[key], bytes.fromhex(key)))
        self._io.submit(self._write_disk, key)
        return True

    def _write_disk(self, key: str) -> None:
        """On the writer thread: the file is written outside the lock (the engine
        thread never waits for it); a block that left the tier meanwhile is
        skipped, or its fresh file removed. A write that fails (disk full, an
        I/O error) is logged and counted; the block is then missing, and a
        match that reaches it recomputes."""
        with self._lock:
            queued = self._pending.get(key)
        if queued is None:
            return
        block, ident = queued
        try:
            self.disk.write_file(key, block, ident)
        except Exception as e:  # noqa: BLE001 - on the writer thread: nobody else would see it
            log.warning("prefix cache disk tier: writing a block failed (%s); it will be recomputed", e)
            with self._lock:
                self._pending.pop(key, None)
                self.stats.write_errors += 1
            self.disk.path(key).with_suffix(".tmp").unlink(missing_ok=True)
            return
        with self._lock:
            if self._pending.pop(key, None) is None:
                self.disk.path(key).unlink(missing_ok=True)
            else:
                self.disk.register(key, ident, self.disk.file_bytes(block))

    def _disk_discard(self, key: str) -> None:
        size = self._disk_lru.pop(key, None)
        if size is None:
            return
        self._disk_used -= size
        self._note("disk", False, key)
        with self._lock:
            self._pending.pop(key, None)
            self.disk.discard(key)

    def _forget(self, key: str) -> None:
        if key in self._holds:  # invalidated (or cleared) under a session: it recomputes
            tier, size = self._held_size(key)
            self._held_bytes[tier] -= size
            del self._holds[key]
        if key in self._ns:
            if self.host.get(key) is not None:
                self.host.discard(key)
                self._note("host", False, key)
            self._disk_discard(key)
            self._unindex(key)

    def _note(self, tier: str, stored: bool, key: str) -> None:
        self.classes.moved(tier, stored, key)
        if self.on_event is not None:
            self.on_event(tier, stored, bytes.fromhex(key))

    def _index(self, key: str, ns: bytes) -> None:
        self._ns[key] = ns
        self._by_ns.setdefault(ns, set()).add(key)

    def _unindex(self, key: str) -> None:
        self.classes.forget(key)
        ns = self._ns.pop(key, None)
        if ns is not None:
            keys = self._by_ns.get(ns)
            if keys is not None:
                keys.discard(key)
                if not keys:
                    del self._by_ns[ns]
