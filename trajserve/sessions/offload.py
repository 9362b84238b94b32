"""The engine's transfers for paused sessions: real copies to the host and disk tiers.

The pause state machine (sessions/pause_machine.py) decides; this carries its
decisions out on the engine's hardware (spec "异步分页换入换出", "分层辅助存储"):

    save  the runner's copy engine (kv/copy_engine.py) reads the path's
          device blocks while it stays pinned; when the host copy lands the
          session's tiered block table is remapped to the tier, the device
          frames are freed, and a disk save goes on to the writer thread
          (identity + checksum per block, kv/tiers.py)
    load  resume: the saved blocks are read (a disk block passes its checks
          before anyone can hit it) and join the tree at once, while their KV
          streams in under the turn's prefill (the forward waits per layer);
          prefetch: read and copied in the background, adopted when it lands

The tiers are the prefix cache's lower tiers (kv/lower_tiers.py): the
engine's when it has them (--kv-host-cache / --kv-disk-cache), else a pair
this offload makes and attaches for matching only (LRU does not spill into
it). Saved blocks are ordinary tier blocks named by their chained hashes
(never by a client's session id), held while their session waits
(kv/tier_holds.py): a preamble two sessions share, or one LRU spilled, is
stored once. Room is reserved when a save starts, so a full tier falls
through before anything is copied; one writer thread writes the disk tier.
A block that fails its checks on the way back (identity or CRC) ends the
run there: everything from it on is recomputed, never served corrupt. A
resume without room on the device lets go of its holds and leaves the
blocks on their tier, where the turn's own match promotes what it can.
"""
from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass

import torch

from trajserve.engine.calibration import calibrate_rates
from trajserve.kv.copy_engine import CopyJob
from trajserve.kv.cost_rates import CostRates
from trajserve.kv.lower_tiers import LowerTiers
from trajserve.kv.radix_cache import MatchResult, RadixNode
from trajserve.kv.tiered_table import Tier, TieredBlockTable
from trajserve.kv.tiers import DISK_HEADER_BYTES, namespace_digest
from trajserve.sessions.host import EngineHost
from trajserve.sessions.keep_policy import Decision
from trajserve.sessions.pause_machine import PausedRecord, Residency

TIER_NAME = {Decision.HOST: "host", Decision.DISK: "disk"}


@dataclass(eq=False)
class SessionPause(PausedRecord):
    """A session's pause record (sessions/manager.py Session.record): the
    machine's fields, and these, the offload's own."""
    session_id: str = ""
    # Where each block of the state is (device / host / disk) while it is
    # saved or moved; None when it is simply on the device.
    table: TieredBlockTable | None = None
    copy: CopyJob | None = None  # a save or load in flight on the copy engine
    hold: RadixNode | None = None  # pins the device frames a copy reads or writes
    saving: tuple | None = None  # a save's target tier, blocks, and the namespace digest and hashes it carries
    importing: tuple[MatchResult, list[int], object] | None = None  # a prefetch's blocks, adopted when it lands

    @property
    def saved_blocks(self) -> int:
        """Blocks of the state held on the host or disk tier."""
        return 0 if self.table is None else len(self.table) - self.table.counts()["device"]


class SessionOffload:
    """Transfers (sessions/pause_machine.py) over the runner's copy engine and
    the lower tiers, on SessionPause records."""

    def __init__(self, engine: EngineHost, rates: CostRates, stats, host_bytes: int, disk_dir: str | None,
                 disk_bytes: int, overlap_reload: bool = True) -> None:
        self.engine, self.rates, self.stats = engine, rates, stats
        self.block_bytes = engine.block_bytes
        if engine.lower is not None:  # one store: the prefix cache's tiers
            self.tiers, self._own = engine.lower, False
        else:
            # Saved state does not outlive the manager: its directory (or a
            # scratch one) is locked while it runs and emptied at shutdown.
            self.tiers = LowerTiers(engine.runner.read_blocks, engine.runner.write_blocks, host_bytes, disk_bytes,
                                    disk_dir, layout=engine.block_layout, window_layout=engine.window_layout,
                                    keep_files=False)
            engine.kv.attach_lower_tiers(self.tiers, spill=False)
            self._own = True
        # False: a resume waits for its whole reload before the turn runs (the
        # serial baseline the overlap is measured against).
        self.overlap_reload = overlap_reload
        self.copying: dict[str, object] = {}  # session id -> session with a copy in flight (pruned by poll)

    # ------------------------------------------------------------- capacity
    def _nbytes(self, tier: Decision, nblocks: int) -> int:
        return nblocks * (self.block_bytes if tier is Decision.HOST else DISK_HEADER_BYTES + self.block_bytes)

    def free_bytes(self, tier: Decision) -> int:
        return self.tiers.hold_free_bytes(TIER_NAME[tier])

    def reserve(self, tier: Decision, nblocks: int) -> bool:
        return self.tiers.reserve(TIER_NAME[tier], self._nbytes(tier, nblocks))

    def _unreserve(self, tier: Decision, nblocks: int) -> None:
        self.tiers.unreserve(TIER_NAME[tier], self._nbytes(tier, nblocks))

    def reload_s(self, s, tier: Decision) -> float:
        """The policy's estimate of the reload (what the decision priced)."""
        d = s.decision
        return 0.0 if d is None else (d.t_reload_host_s if tier is Decision.HOST else d.t_reload_disk_s)

    # ----------------------------------------------------------------- save
    def save(self, s, tier: Decision, hit, sync: bool) -> None:
        assert s.copy is None, "one copy per session at a time (pause lands a reload first)"
        kv = self.engine.kv
        s.hold = kv.pin(s.history, s.scope, s.keys)
        s.table = TieredBlockTable(Tier.DEVICE, hit.block_ids)
        # Labelled by the tree that holds the blocks: a copy never claims a
        # namespace its bytes were not computed under.
        namespace, hashes = kv.path_identity(hit)
        reserved = kv.save_blocks(hit.block_ids)  # as the pause machine reserved it
        windows = kv.hold_copy_windows(hit.block_ids)  # a window model's last window goes along, held meanwhile
        s.saving = (tier, reserved, namespace_digest(namespace), hashes, (hit.block_ids, windows))
        s.copy = self.engine.runner.copy.save(hit.block_ids, windows)
        self.copying[s.session_id] = s
        if sync:
            self._land_save(s)

    def _land_save(self, s) -> None:
        """The host copy is there (waits for it if not): store it, remap the
        table to the tier, free the device frames. A disk save goes on to
        the disk writer thread from here."""
        job, (tier, nblocks, ns, hashes, windows) = s.copy, s.saving
        self.engine.runner.copy.finish(job)
        self.engine.kv.release_copy_windows(*windows)
        s.copy, s.saving = None, None
        data, job.data = job.data, None
        held = self.tiers.hold(ns, hashes, data, TIER_NAME[tier], self._nbytes(tier, nblocks))
        # The table names the blocks by their chained hashes (the disk writer thread may still be writing them).
        s.table = TieredBlockTable(Tier.HOST if tier is Decision.HOST else Tier.DISK, hashes[:held])
        if tier is Decision.HOST:
            self.rates.observe_host_copy(job.nbytes, job.seconds)
        s.residency = Residency.OFFLOADED
        self.stats.swap_out_bytes += job.nbytes
        self.stats.swap_out_s += job.seconds
        self.engine.kv.unpin(s.hold)
        s.hold = None
        self.engine.kv.evict_prefix(s.history, s.scope, s.keys)

    def land_saves(self, need: int | None = None) -> int:
        """Land saves in flight (all, or until `need` blocks are free); returns blocks freed."""
        kv, freed = self.engine.kv, 0
        for s in list(self.copying.values()):
            if need is not None and freed >= need:
                break
            if s.copy is not None and s.copy.kind == "save":
                before = kv.num_free_blocks
                self._land_save(s)
                freed += kv.num_free_blocks - before
        return freed

    def _abandon_save(self, s) -> None:
        """Resumed or closed before the save landed: the blocks never left
        the device, so the copy is thrown away."""
        tier, nblocks, _, _, windows = s.saving
        self.engine.runner.copy.finish(s.copy)
        self.engine.kv.release_copy_windows(*windows)
        s.copy.data = None
        s.copy, s.saving, s.table = None, None, None
        self._unreserve(tier, nblocks)
        self.engine.kv.unpin(s.hold)
        s.hold = None

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
        if s.table is None:  # nothing saved
            return False
        got = kv.begin_import(s.history, s.scope, len(s.table), s.keys)
        if got is None and self.land_saves():
            # Other sessions' saves in flight still held their frames: landed, try again.
            got = kv.begin_import(s.history, s.scope, len(s.table), s.keys)
        if got is None:
            self.stats.reload_no_room += 1
            if landed is None:  # a resume: the blocks stay on their tier, unheld, for the turn's match to promote
                self.release_saved(s, forget=False)
            return False  # a prefetch: the state stays held on its tier for the resume to try again
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
        kv.finish_import(s.history, s.scope, hit, new_ids, filled, s.keys, self._windows(data))
        self.release_saved(s)
        if filled:
            # Device-resident now (the KV still streaming in): the table says so until it lands.
            s.table = TieredBlockTable(Tier.DEVICE, hit.block_ids + new_ids[:filled])
            s.hold = kv.pin(s.history, s.scope, s.keys)  # nobody evicts blocks still being written
            s.copy = copy.load(new_ids[:filled], data)
            self.copying[s.session_id] = s
        return True

    def _fetch(self, s, start: int, end: int) -> list[torch.Tensor]:
        """Saved blocks [start, end) from their tiers, up to the first one
        missing or failing its checks (may run on the copy thread). Host
        blocks are not copied here: the copy engine gathers them per layer."""
        ns = namespace_digest(self.engine.kv.namespace(s.scope))
        return self.tiers.fetch(ns, s.table.frames[start:min(end, len(s.table))])

    def _windows(self, data: list[torch.Tensor]) -> list[bool]:
        """Which fetched blocks carry their window part (a window model's)."""
        return [self.tiers.carries_window(b) for b in data]

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
            kv.finish_import(s.history, s.scope, hit, new_ids, job.filled, s.keys, job.windows)
            self.release_saved(s)
            landed(s, job.filled > 0)
        else:
            kv.unpin(s.hold)
            s.hold, s.table = None, None
            self.stats.resume_stall_s += job.waited_s + waited  # what the copy did not hide
            self.stats.reload_hidden_s += max(0.0, job.seconds - job.waited_s - waited)
        self.stats.swap_in_bytes += job.nbytes
        self.stats.swap_in_s += job.seconds
        self.stats.corrupt_blocks = self.tiers.stats.corrupt_blocks
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

    def release_saved(self, s, forget: bool = True) -> None:
        """Let go of the session's blocks on the tiers; forget: also drop those
        nobody else holds (they are on the device again, or the session closed)."""
        if s.table is None:
            return
        for tier in (Tier.HOST, Tier.DISK):  # device frames (a reload streaming in) hold nothing on a tier
            self.tiers.release([h for _, h in s.table.frames_in(tier)], forget)
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
        got = kv.begin_import(s.history, s.scope, len(s.table), s.keys)
        if got is None:
            return  # no room: the children recompute
        hit, new_ids = got
        have = len(hit.block_ids)
        data = self._fetch(s, have, have + len(new_ids))
        if data:
            self.engine.runner.write_blocks(new_ids[:len(data)], data)
        kv.finish_import(s.history, s.scope, hit, new_ids, len(data), s.keys, self._windows(data))
        self.stats.corrupt_blocks = self.tiers.stats.corrupt_blocks

    def flush(self, sessions) -> None:
        """Land every copy in flight and wait until every queued disk write has landed."""
        for s in sessions:
            self.land(s)
        self.tiers.flush()

    def calibrate(self, prefill_tokens: int) -> dict:
        """Measure the policy's rates on this machine (engine/calibration.py), over the disk tier."""
        if self.tiers.disk is None:
            return calibrate_rates(self.engine, self.rates, None, prefill_tokens)
        with self.tiers.exclusive_disk() as disk:
            return calibrate_rates(self.engine, self.rates, disk, prefill_tokens)

    def close(self) -> None:
        """Queued writes land; tiers of its own are emptied and detached (the
        engine's stay); the copy engine is the runner's: it stays."""
        if self._own:
            self.engine.kv.attach_lower_tiers(None)
            self.tiers.close()
        else:
            self.tiers.flush()
