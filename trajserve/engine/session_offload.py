"""The engine's transfers for paused sessions: real copies to the host and disk tiers.

The pause state machine (kv/pause_machine.py) decides; this carries its
decisions out on the engine's hardware (spec "异步分页换入换出", "分层辅助存储"):

    save  the runner's copy engine (kv/copy_engine.py) reads the path's
          device blocks while it stays pinned; when the host copy lands the
          session's tiered block table is remapped to the tier, the device
          frames are freed, and a disk save goes on to the writer thread
          (identity + checksum per block, kv/block_format.py)
    load  resume: the saved blocks are read (a disk block passes its checks
          before anyone can hit it) and join the tree at once, while their KV
          streams in under the turn's prefill (the forward waits per layer);
          prefetch: read and copied in the background, adopted when it lands

Room on each tier is reserved when a save starts (the host copy and the
queued disk write count against the caps), so a full tier falls through
before anything is copied. A block that fails its checks on the way back
ends the run there: everything from it on is recomputed, never served
corrupt. Saved blocks are keyed by this store's own counter, never by a
client's session id.
"""
from __future__ import annotations

import itertools
import logging
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor

import torch

from trajserve.engine.calibration import calibrate_rates
from trajserve.engine.memory import bytes_per_block
from trajserve.kv.block_format import BlockIdentity, namespace_digest
from trajserve.kv.dir_lock import ScratchDir
from trajserve.kv.keep_policy import CostRates, Decision
from trajserve.kv.pause_machine import Residency
from trajserve.kv.tiered_table import Tier, TieredBlockTable
from trajserve.kv.tiers import DISK_HEADER_BYTES, DiskKVStore, HostKVStore

log = logging.getLogger("trajserve")


class SessionOffload:
    """Transfers (kv/pause_machine.py) over the runner's copy engine and a host
    and a disk store. Works on the engine's Session records (engine/session.py):
    their copy, hold, table, saving, importing and io fields are its own."""

    def __init__(self, engine, rates: CostRates, stats, host_bytes: int, disk_dir: str | None,
                 disk_bytes: int, overlap_reload: bool = True) -> None:
        self.engine, self.rates, self.stats = engine, rates, stats
        self.block_bytes = bytes_per_block(engine.model_config, engine.kv.block_size, engine.dtype)
        self.host = HostKVStore(host_bytes)
        # Saved state does not outlive the manager: a scratch directory of its
        # own (locked while it runs, swept by the next one if it is killed).
        self._tmp = None if disk_dir else ScratchDir("session")
        self.disk = DiskKVStore(disk_dir or self._tmp.name, disk_bytes, engine.block_layout,
                                lock=disk_dir is not None)
        self._saves = itertools.count()  # names saved blocks: never the client's session id
        self._idents: dict[str, BlockIdentity] = {}  # saved block key -> what its file must hold
        # False: a resume waits for its whole reload before the turn runs (the
        # serial baseline the overlap is measured against).
        self.overlap_reload = overlap_reload
        # One writer thread: disk writes leave the engine thread; the disk
        # store is touched under the lock (the thread writes, resume reads).
        self._io = ThreadPoolExecutor(max_workers=1, thread_name_prefix="trajserve-kv-io")
        self._disk_lock = threading.Lock()
        self._disk_pending = 0  # bytes of writes queued, reserved on the disk cap
        self._host_reserved = 0  # bytes of host saves still copying
        self.copying: dict[str, object] = {}  # session id -> session with a copy in flight (pruned by poll)

    # ------------------------------------------------------------- capacity
    def free_bytes(self, tier: Decision) -> int:
        if tier is Decision.HOST:
            return self.host.free_bytes - self._host_reserved
        # Both under the lock: the I/O thread moves bytes from pending to written.
        with self._disk_lock:
            return max(0, self.disk.free_bytes - self._disk_pending)

    def reserve(self, tier: Decision, nblocks: int) -> bool:
        if tier is Decision.HOST:
            nbytes = nblocks * self.block_bytes
            if nbytes > self.free_bytes(Decision.HOST):
                return False
            self._host_reserved += nbytes
            return True
        nbytes = nblocks * (DISK_HEADER_BYTES + self.block_bytes)
        with self._disk_lock:  # check and reserve in one step
            if nbytes > self.disk.free_bytes - self._disk_pending:
                return False
            self._disk_pending += nbytes
        return True

    def _unreserve(self, tier: Decision, nblocks: int) -> None:
        if tier is Decision.HOST:
            self._host_reserved -= nblocks * self.block_bytes
        else:
            with self._disk_lock:
                self._disk_pending -= nblocks * (DISK_HEADER_BYTES + self.block_bytes)

    def reload_s(self, s, tier: Decision) -> float:
        """The policy's estimate of the reload (what the decision priced)."""
        d = s.decision
        return 0.0 if d is None else (d.t_reload_host_s if tier is Decision.HOST else d.t_reload_disk_s)

    # ----------------------------------------------------------------- save
    def save(self, s, tier: Decision, block_ids: list[int], sync: bool) -> None:
        assert s.copy is None, "one copy per session at a time (pause lands a reload first)"
        kv = self.engine.kv
        s.hold = kv.pin(s.history, s.cache_salt)
        s.table = TieredBlockTable(Tier.DEVICE, block_ids)
        s.saving = (tier, len(block_ids), kv.prefix_hashes(s.history, s.cache_salt, len(block_ids)))
        s.copy = self.engine.runner.copy.save(block_ids)
        self.copying[s.session_id] = s
        if sync:
            self._land_save(s)

    def _land_save(self, s) -> None:
        """The host copy is there (waits for it if not): store it, remap the
        table to the tier, free the device frames. A disk save goes on to
        the disk writer thread from here."""
        job, (tier, nblocks, hashes) = s.copy, s.saving
        self.engine.runner.copy.finish(job)
        s.copy, s.saving = None, None
        data, job.data = job.data, None
        save = next(self._saves)
        keys = [f"save{save}-{i}" for i in range(data.shape[0])]
        ns = namespace_digest(self.engine.kv.namespace(s.cache_salt))
        for k, h in zip(keys, hashes):
            self._idents[k] = BlockIdentity(ns, h)
        if tier is Decision.HOST:
            self._unreserve(tier, nblocks)
            for k, block in zip(keys, data):
                ok = self.host.put(k, block, copy=False)  # a fresh host tensor, reserved room
                assert ok, "host tier reservation did not hold"
            self.rates.observe_host_copy(job.nbytes, job.seconds)
        else:
            s.io = self._io.submit(self._write_disk, keys, data, nblocks)
        s.table.remap(0, Tier.HOST if tier is Decision.HOST else Tier.DISK, keys)
        s.residency = Residency.OFFLOADED
        self.stats.swap_out_bytes += job.nbytes
        self.stats.swap_out_s += job.seconds
        self.engine.kv.unpin(s.hold)
        s.hold = None
        self.engine.kv.evict_prefix(s.history, s.cache_salt)

    def land_saves(self, need: int | None = None) -> int:
        """Land saves in flight (all, or until `need` blocks are free); returns blocks freed."""
        pool, freed = self.engine.kv.pool, 0
        for s in list(self.copying.values()):
            if need is not None and freed >= need:
                break
            if s.copy is not None and s.copy.kind == "save":
                before = pool.num_free
                self._land_save(s)
                freed += pool.num_free - before
        return freed

    def _abandon_save(self, s) -> None:
        """Resumed or closed before the save landed: the blocks never left
        the device, so the copy is thrown away."""
        tier, nblocks, _ = s.saving
        self.engine.runner.copy.finish(s.copy)
        s.copy.data = None
        s.copy, s.saving, s.table = None, None, None
        self._unreserve(tier, nblocks)
        self.engine.kv.unpin(s.hold)
        s.hold = None

    def _write_disk(self, keys: list[str], data: torch.Tensor, nblocks: int) -> tuple[int, int, float]:
        """On the I/O thread: write the blocks. Returns (blocks written, bytes,
        seconds); the engine thread accounts them when it collects the result.
        A write that fails (disk full, an I/O error) ends the run there: it is
        logged and counted, and the blocks from it on are recomputed on resume."""
        t = time.perf_counter()
        written = 0
        with self._disk_lock:
            self._disk_pending -= nblocks * (DISK_HEADER_BYTES + self.block_bytes)
            for i, k in enumerate(keys):
                try:
                    if not self.disk.put(k, data[i], self._idents[k]):
                        break
                except Exception as e:  # noqa: BLE001 - on the writer thread: the turn must not fail for ever
                    log.warning("session disk tier: writing a saved block failed (%s); the state from "
                                "block %d on will be recomputed", e, i)
                    self.disk.path(k).with_suffix(".tmp").unlink(missing_ok=True)
                    self.stats.write_errors += 1
                    break
                written += 1
        return written, written * data[0].numel() * data.element_size(), time.perf_counter() - t

    def _collect_write(self, s) -> None:
        """Wait for the session's disk write (if any); entries it could not
        write are dropped from the table (recomputed on resume)."""
        if s.io is None:
            return
        written, nbytes, dt = s.io.result()
        s.io = None
        self.rates.observe_disk_copy(nbytes, dt)
        self.stats.swap_out_s += dt
        if s.table is not None:
            for _, key in s.table.frames_in(Tier.DISK)[written:]:
                self._idents.pop(key, None)
            s.table.truncate(written)

    # ----------------------------------------------------------------- load
    def load(self, s, now: float, landed: Callable | None) -> bool:
        """Bring saved blocks back into fresh device blocks. False when the
        device has no room (the next turn recomputes them)."""
        t = time.perf_counter()
        ok = self._start_load(s, landed)
        if landed is None:  # a resume: the turn's prefill overlaps the copy; what it waits is added at landing
            self.stats.resume_stall_s += time.perf_counter() - t
            if not self.overlap_reload and s.copy is not None:
                self._land_load(s)  # counts its own wait
        return ok

    def _start_load(self, s, landed: Callable | None) -> bool:
        kv = self.engine.kv
        self._collect_write(s)
        if s.table is None:  # nothing saved (released when an earlier load found no room)
            return False
        got = kv.begin_import(s.history, s.cache_salt, len(s.table))
        if got is None and self.land_saves():
            # Other sessions' saves in flight still held their frames: landed, try again.
            got = kv.begin_import(s.history, s.cache_salt, len(s.table))
        if got is None:
            self.stats.reload_no_room += 1
            if landed is None:  # a resume: the turn recomputes what it cannot load
                self.release_saved(s)
            return False  # a prefetch: the state stays on its tier for the resume to try again
        hit, new_ids = got
        have = len(hit.block_ids)
        copy = self.engine.runner.copy
        if landed is not None:
            s.copy = copy.load(new_ids, lambda: self._fetch(s, have, have + len(new_ids)))
            self.copying[s.session_id] = s
            s.importing = (hit, new_ids, landed)
            return True
        data = self._fetch(s, have, have + len(new_ids))
        filled = len(data)
        kv.finish_import(s.history, s.cache_salt, hit, new_ids, filled)
        self.release_saved(s)
        if filled:
            # Device-resident now (the KV still streaming in): the table says so until it lands.
            s.table = TieredBlockTable(Tier.DEVICE, hit.block_ids + new_ids[:filled])
            s.hold = kv.pin(s.history, s.cache_salt)  # nobody evicts blocks still being written
            s.copy = copy.load(new_ids[:filled], data)
            self.copying[s.session_id] = s
        return True

    def _fetch(self, s, start: int, end: int) -> list[torch.Tensor]:
        """Saved blocks [start, end) from their tiers, up to the first one
        missing or failing its checks (may run on the copy thread). Host
        blocks are not copied here: the copy engine gathers them per layer."""
        blocks = []
        with self._disk_lock:
            for i in range(start, min(end, len(s.table))):
                tier, key = s.table.tiers[i], s.table.frames[i]
                b = (self.host.get(key) if tier is Tier.HOST else
                     self.disk.get(key, self._idents[key]) if tier is Tier.DISK else None)
                if b is None:  # missing or corrupt: recompute from here on
                    break
                blocks.append(b)
        return blocks

    def _land_load(self, s) -> None:
        """A load finished (waits for it if not): a prefetch's blocks join the
        tree now; a resume's were there already and are unpinned."""
        job = s.copy
        kv = self.engine.kv
        t = time.perf_counter()
        try:
            self.engine.runner.copy.finish(job)
        except RuntimeError:
            if s.importing is None:
                raise  # a resume's blocks are in the tree already: nothing safe to fall back to
            job.filled = 0  # a failed prefetch adopts nothing: the turn recomputes
        waited = time.perf_counter() - t  # the engine thread waited here, on top of the forward's waits
        s.copy = None
        if s.importing is not None:
            hit, new_ids, landed = s.importing
            s.importing = None
            kv.finish_import(s.history, s.cache_salt, hit, new_ids, job.filled)
            self.release_saved(s)
            landed(s, job.filled > 0)
        else:
            kv.unpin(s.hold)
            s.hold, s.table = None, None
            self.stats.resume_stall_s += job.waited_s + waited  # what the copy did not hide
            self.stats.reload_hidden_s += max(0.0, job.seconds - job.waited_s - waited)
        self.stats.swap_in_bytes += job.nbytes
        self.stats.swap_in_s += job.seconds
        self.stats.corrupt_blocks = self.disk.num_rejected
        if job.nbytes:
            self.rates.observe_host_copy(job.nbytes, job.seconds)

    # --------------------------------------------------------- bookkeeping
    def busy(self, s) -> bool:
        return s.copy is not None

    def land(self, s) -> None:
        """No copy in flight for s afterwards: a save or load lands (waits for it)."""
        if s.copy is not None:
            self._land_save(s) if s.copy.kind == "save" else self._land_load(s)

    def settle(self, s) -> None:
        """No copy in flight for s afterwards, before closing it: a save is thrown away."""
        if s.copy is not None and s.copy.kind == "save":
            self._abandon_save(s)
        elif s.copy is not None:
            self._land_load(s)

    def before_resume(self, s) -> None:
        t = time.perf_counter()
        if s.copy is not None and s.copy.kind == "save":
            self._abandon_save(s)  # back before its save landed: the state never left
            s.tier, s.residency = Decision.KEEP, Residency.KEPT
        elif s.copy is not None:  # a prefetch still loading: it must land first
            self._land_load(s)
            self.stats.resume_stall_s += time.perf_counter() - t

    def land_all(self) -> bool:
        busy = [s for s in self.copying.values() if s.copy is not None]
        for s in busy:
            self.land(s)
        return bool(busy)

    def poll(self) -> None:
        """Between steps: land the copies that are done; forget sessions with none in flight."""
        for sid, s in list(self.copying.items()):
            if s.copy is not None and s.copy.done:
                self.land(s)
            if s.copy is None:
                self.copying.pop(sid, None)

    def release_saved(self, s) -> None:
        """Let go of the session's blocks on the host and disk tiers."""
        self._collect_write(s)  # a write in flight must land before its files go
        if s.table is None:
            return
        with self._disk_lock:
            for _, key in s.table.frames_in(Tier.HOST):
                self.host.discard(key)
                self._idents.pop(key, None)
            for _, key in s.table.frames_in(Tier.DISK):
                self.disk.discard(key)
                self._idents.pop(key, None)
        s.table = None

    def share_saved(self, s) -> None:
        """Forking a session paused on the host or disk: its saved blocks are
        copied back into the tree as cold cache (the parent keeps its saved
        copy and stays where it is), so the children's first turns hit them
        instead of recomputing the whole history."""
        self.land(s)  # a save or prefetch in flight ends first
        if s.table is None or s.tier not in (Decision.HOST, Decision.DISK):
            return  # on the device already (kept, prefetched) or dropped
        kv = self.engine.kv
        self._collect_write(s)
        got = kv.begin_import(s.history, s.cache_salt, len(s.table))
        if got is None:
            return  # no room: the children recompute
        hit, new_ids = got
        have = len(hit.block_ids)
        data = self._fetch(s, have, have + len(new_ids))
        if data:
            self.engine.runner.write_blocks(new_ids[:len(data)], torch.stack(data))
        kv.finish_import(s.history, s.cache_salt, hit, new_ids, len(data))
        self.stats.corrupt_blocks = self.disk.num_rejected

    def flush(self, sessions) -> None:
        """Land every copy in flight and wait until every queued disk write has landed."""
        for s in sessions:
            self.land(s)
            self._collect_write(s)

    def calibrate(self, prefill_tokens: int) -> dict:
        """Measure the policy's rates on this machine (engine/calibration.py), over this disk tier."""
        with self._disk_lock:
            return calibrate_rates(self.engine, self.rates, self.disk, prefill_tokens)

    def close(self) -> None:
        """Queued writes land; the copy engine is the runner's: it stays."""
        self._io.shutdown(wait=True)
        self.disk.release()
        if self._tmp is not None:
            self._tmp.cleanup()
