"""The pause state machine: where a paused session's KV state waits, and when it moves.

Spec: kv-cache-management section 6 (the break-even wait T*_wait decides
keep / offload / drop), "分层辅助存储" (host and disk tiers), "异步分页换入换出"
(prefetch ahead of the return), "服务遥测动态" (paused state gives way to
running work). The engine's SessionManager (sessions/manager.py) and the
simulator's PauseController (sim/pauses.py) both run this one machine; only
the transfers differ. A `Transfers` object carries out what the machine
decides: the engine's copy engine and tier stores (sessions/offload.py)
move real bytes, the simulator's cost-model link (sim/pauses.py) moves
virtual time.

A paused state's residency:

    KEPT ------lease runs out / pressure------> SAVING --lands--> OFFLOADED
      ^   `----------(no room on any tier)-------------------------> DROPPED
      |                                                  |
      +---------- prefetch lands <---- LOADING <---------+ (prefetch_fraction x the wait,
                                                              less the reload time)

A pause enters at the policy's decision (or the caller's forced one); a
full tier falls through (host -> disk -> drop). Kept state is a pin on the
history's radix path; a resume hands that pin to the admission holds
(kv/admission_hold.py) until its turn is admitted. Transitions are
methods here; everything that touches bytes or time is a Transfers call.

A record is a `PausedRecord`: the machine's part of a paused session. Its
owner sets what is paused (the history, its block keys, its cache scope)
before each pause; the machine writes the rest; the transfers' own state
for a record is declared by them on a subclass (sessions/offload.py
SessionPause for the engine, sim/pauses.py Paused for the simulator).
"""
from __future__ import annotations

import dataclasses
import enum
import heapq
import itertools
import math
from collections import Counter
from collections.abc import Callable, Hashable
from dataclasses import dataclass, field
from typing import Protocol

from trajserve.kv.radix_cache import MatchResult, RadixNode
from trajserve.kv.scope import CacheScope
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.keep_policy import Decision, KeepPolicy, PauseDecision, PauseState

OFFLOAD_TIERS = (Decision.HOST, Decision.DISK)


class Residency(enum.Enum):
    KEPT = "kept"            # pinned on the device (a keep, or a landed prefetch)
    SAVING = "saving"        # copying down to a tier; the device frames are still held
    OFFLOADED = "offloaded"  # on the host or disk tier, nothing on the device
    LOADING = "loading"      # a prefetch copying back; joins the tree when it lands
    DROPPED = "dropped"      # nowhere: the next turn recomputes what the prefix cache lost


@dataclass(eq=False)
class PausedRecord:
    # What is paused, set by the record's owner before each pause.
    history: list[int] = field(default_factory=list)
    keys: list | None = None           # the history's block keys, chunked once by the owner (None: chunk here)
    scope: CacheScope = CacheScope()   # the namespace its blocks live in: salt and adapter (kv/scope.py)
    priority: int = 0                  # its last turn's (lower runs first): pressure moves the least urgent first
    # The machine's own.
    paused_at: float | None = None
    expected_wait_s: float = math.inf  # inf when unknown
    decision: PauseDecision | None = None
    forced: bool = False
    tier: Decision | None = None       # where the state waits (or is going): KEEP / HOST / DISK / DROP
    residency: Residency | None = None
    pin: RadixNode | None = None
    lease_deadline: float | None = None
    prefetch_at: float | None = None
    prefetched: bool = False


class Transfers(Protocol):
    """What carries out the machine's transitions: bytes or virtual time."""

    def free_bytes(self, tier: Decision) -> int: ...

    def reserve(self, tier: Decision, nblocks: int) -> bool:
        """Room for nblocks whole blocks' worth (KVCacheManager.save_blocks) on
        the tier, reserved now; False when it does not fit."""

    def save(self, p: PausedRecord, tier: Decision, hit: MatchResult, sync: bool) -> None:
        """Copy the matched path's device blocks down (room reserved), labelled
        with the namespace and hashes the tree holds them under; the path
        leaves the device when the copy lands."""

    def load(self, p: PausedRecord, now: float, landed: Callable[[PausedRecord, bool], None] | None) -> bool:
        """Bring saved blocks back into the tree: for a resume (landed None) at
        once, for a prefetch in the background, calling landed(p, ok) when the
        blocks join the tree (or nothing came back). False when the device has
        no room: a prefetch leaves the state on its tier, a resume gives it up
        (its turn recomputes it)."""

    def reload_s(self, p: PausedRecord, tier: Decision) -> float: ...

    def busy(self, p: PausedRecord) -> bool:
        """A copy of p's is in flight (no second one starts)."""

    def before_resume(self, p: PausedRecord) -> None:
        """A copy in flight ends before the resume decides (a save is abandoned: tier KEEP)."""

    def land_saves(self, need: int) -> int:
        """Land saves in flight until `need` device blocks are free; returns blocks freed."""

    def land_all(self) -> bool:
        """Land every copy in flight; True if there was any (they held frames)."""


@dataclass
class PauseCounts:
    """What the machine counts (the engine's and the simulator's stats extend it)."""
    decisions: Counter = field(default_factory=Counter)   # one per pause, as the policy (or the caller) made it
    placed: Counter = field(default_factory=Counter)      # where each pause's state went (a full tier falls through)
    demoted_to: Counter = field(default_factory=Counter)  # where kept state went when a lease or pressure moved it
    lease_demotions: int = 0
    pressure_demotions: int = 0   # kept states moved down a tier to make room for running work
    stall_drops: int = 0          # forced-kept states dropped because nothing could run
    prefetches: int = 0
    prefetch_hits: int = 0        # resumes that found prefetched state on the device
    resume_stalls: int = 0        # resumes that had to load state back first
    recomputed_tokens: int = 0    # history a resumed turn found missing on the device


class PauseMachine:
    def __init__(self, kv, policy: KeepPolicy, transfers: Transfers, stats: PauseCounts, *, block_bytes: int,
                 ceiling_blocks: Callable[[], int], clock: Callable[[], float],
                 prefetch_fraction: float = SessionConfig.prefetch_fraction) -> None:
        """kv: the KV cache manager (KVCacheManager); block_bytes: a block's KV
        bytes, whole model, as the policy prices them; ceiling_blocks: the
        scheduler's admission ceiling in blocks (tau_high); clock: now, in the
        caller's time (wall or virtual)."""
        if not 0 <= prefetch_fraction <= 1:
            raise ValueError(f"prefetch_fraction must be in [0, 1], got {prefetch_fraction}")
        self.kv, self.policy, self.transfers, self.stats = kv, policy, transfers, stats
        self.block_bytes = block_bytes
        self.ceiling_blocks, self.clock = ceiling_blocks, clock
        self.prefetch_fraction = prefetch_fraction
        self.paused: dict[Hashable, PausedRecord] = {}  # owner (the admission-hold key) -> its record
        # Leases and prefetches due, in time order; an entry whose record has
        # moved on since (another deadline, another tier) is skipped.
        self._timers: list[tuple[float, int, str, PausedRecord]] = []
        self._seq = itertools.count()
        kv.attach_reclaimer(self.reclaim)  # refuses a KV manager without prefix caching, or with a reclaimer

    def detach(self) -> None:
        self.kv.detach_reclaimer(self.reclaim)

    # ----------------------------------------------------------- transitions
    def pause(self, owner: Hashable, p: PausedRecord, wait_s: float, known: bool,
              forced: Decision | str | None, now: float) -> PauseDecision:
        """p's turn ended at `now`: decide where its state waits (wait_s the
        expected wait, known False for a prior) and put it there."""
        kv = self.kv
        kv.cancel_hold(owner)  # the turn ran: its resume's hold is over
        hit = kv.cached_prefix(p.history, p.scope, p.keys)
        nblocks = len(hit.block_ids)
        d = self.policy.decide(PauseState(  # kv_bytes: what a save copies (a window model's: less than every layer)
            num_tokens=nblocks * kv.block_size, kv_bytes=kv.save_blocks(hit.block_ids) * self.block_bytes,
            expected_wait_s=wait_s,
            pool_usage=self._usage_for(p.priority),
            host_free_bytes=self.transfers.free_bytes(Decision.HOST),
            disk_free_bytes=self.transfers.free_bytes(Decision.DISK)))
        if forced is not None:
            f = Decision(forced)
            # A forced keep holds until resume (no lease): the caller decided.
            d = dataclasses.replace(d, decision=f, lease_s=None, fallback=d.target if f is Decision.KEEP
                                    else d.fallback, reason=f"forced {f.value} (policy: {d.reason})")
        p.paused_at, p.decision, p.forced = now, d, forced is not None
        p.expected_wait_s = wait_s if known else math.inf
        p.prefetched, p.prefetch_at, p.lease_deadline = False, None, None
        self.paused[owner] = p
        self.stats.decisions[d.decision.value] += 1
        self._place(p, d.decision, d.lease_s)
        self.stats.placed[p.tier.value] += 1
        return d

    def resume(self, owner: Hashable, now: float) -> PausedRecord | None:
        """owner's next turn is here: its pin goes to the admission holds, saved
        state comes back (its turn's prefill overlaps the copy where the
        transfers can), and what is missing is counted as recomputed."""
        p = self.paused.pop(owner, None)
        if p is None:
            return None
        kv = self.kv
        self.transfers.before_resume(p)
        if p.pin is not None:  # held until the turn is admitted (kv/admission_hold.py)
            kv.hold(owner, p.pin)
            p.pin = None
        if p.prefetched:
            self.stats.prefetch_hits += 1
        elif p.tier in OFFLOAD_TIERS:
            self.transfers.load(p, now, None)
            self.stats.resume_stalls += 1
        hit = kv.cached_prefix(p.history, p.scope, p.keys)
        self.stats.recomputed_tokens += max(0, len(p.history) - 1 - hit.num_tokens)
        _unpaused(p)
        return p

    def forget(self, owner: Hashable) -> PausedRecord | None:
        """owner is closed: its pin goes (the transfers free its saved copy)."""
        p = self.paused.pop(owner, None)
        if p is not None:
            if p.pin is not None:
                self.kv.unpin(p.pin)
                p.pin = None
            _unpaused(p)
        self.kv.cancel_hold(owner)
        return p

    def tick(self, now: float) -> None:
        """Before a step: leases and prefetches due (in time order), then kept
        state above the admission ceiling leaves the device."""
        timers = self._timers
        while timers and timers[0][0] <= now:
            t, _, kind, p = heapq.heappop(timers)
            if kind == "lease" and p.tier is Decision.KEEP and p.lease_deadline == t:
                self.stats.lease_demotions += 1
                self._demote(p)
            elif kind == "prefetch" and p.prefetch_at == t and p.tier in OFFLOAD_TIERS:
                self._prefetch(p, now)
        over = self.kv.num_active_blocks - self.ceiling_blocks()
        if over > 0 and self.paused:
            self.kv.reclaim(over)

    def next_timer(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def set_lease(self, p: PausedRecord, deadline: float) -> None:
        p.lease_deadline = deadline
        self._timer(deadline, "lease", p)

    def set_prefetch(self, p: PausedRecord, at: float) -> None:
        p.prefetch_at = at
        self._timer(at, "prefetch", p)

    def reclaim(self, need: int) -> int:
        """The KV manager's reclaimer: free `need` blocks by moving kept paused state
        down a tier, the least urgent sessions' first (the highest priority
        number; all 0 under FCFS) and within a priority the state expected
        back last first (its hold costs the most block-seconds). Saves in
        flight land first (their frames are leaving anyway). Forced keeps
        stay; a prefetch's hold is the machine's own, so it can go again."""
        freed = self.transfers.land_saves(need)
        now = self.clock()
        cands = [p for p in self.paused.values() if p.pin is not None and (p.prefetched or not p.forced)]
        cands.sort(key=lambda p: (p.priority, p.paused_at + p.expected_wait_s - now), reverse=True)
        kv = self.kv
        for p in cands:
            if freed >= need:
                break
            before = kv.num_free_blocks
            self._demote(p, sync=True)
            self.stats.pressure_demotions += 1
            freed += kv.num_free_blocks - before
        return freed

    def _usage_for(self, priority: int) -> float:
        """U_KV (eq. 8, cold cache left out) as a session of this priority
        prices holding its state: the kept state of less urgent sessions is
        not counted, since pressure moves it first (`reclaim`). A block such
        state shares with others is not counted either: a little below the
        truth, where sessions share a preamble. All priorities are 0 under
        FCFS: the pool's active usage."""
        kv = self.kv
        yielding = sum(len(q.history) // kv.block_size for q in self.paused.values()
                       if q.pin is not None and q.priority > priority and (q.prefetched or not q.forced))
        return min(1.0, max(0.0, (kv.num_active_blocks - yielding) / kv.num_blocks))

    def relieve_stall(self) -> bool:
        """Nothing could run and nothing was released: land copies in flight
        (they hold frames), else drop the oldest pinned paused state (the
        engine's stand-in for an out-of-memory failure), else release the
        admission holds. False when none of that freed anything. The oldest
        of the least urgent priority goes first."""
        if self.transfers.land_all():
            return True
        victims = [p for p in self.paused.values() if p.pin is not None]
        if not victims:
            return self.kv.release_all_holds() > 0
        v = min(victims, key=lambda p: (-p.priority, p.paused_at))
        self.kv.unpin(v.pin)
        v.pin = None
        self.kv.evict_prefix(v.history, v.scope, v.keys)
        v.tier, v.residency, v.prefetched = Decision.DROP, Residency.DROPPED, False
        self.stats.stall_drops += 1
        return True

    def prefetch_landed(self, p: PausedRecord, ok: bool) -> None:
        """A prefetch's blocks joined the tree (ok) or nothing came back."""
        if ok:
            # Held on the device until the resume (the reclaimer may still move it).
            p.pin = self.kv.pin(p.history, p.scope, p.keys)
            p.tier, p.residency, p.prefetched, p.lease_deadline = Decision.KEEP, Residency.KEPT, True, None
            self.stats.prefetches += 1
        else:
            p.tier, p.residency = Decision.DROP, Residency.DROPPED

    def observe_prefill(self, computed_tokens: int, ttft_s: float) -> None:
        """Recompute estimates follow measured prefills (short ones are mostly overhead)."""
        if computed_tokens >= 64 and ttft_s > 0:
            self.policy.rates.observe_prefill(computed_tokens, ttft_s)

    # -------------------------------------------------------------- private
    def _place(self, p: PausedRecord, d: Decision, lease_s: float | None, sync: bool = False) -> None:
        kv, now = self.kv, self.clock()
        if d is Decision.KEEP:
            p.pin = kv.pin(p.history, p.scope, p.keys)
            p.residency = Residency.KEPT
            p.lease_deadline = None
            if lease_s is not None:
                self.set_lease(p, now + lease_s)
        elif d in OFFLOAD_TIERS:
            d = self._save(p, d, sync)
        if d is Decision.DROP:
            kv.evict_prefix(p.history, p.scope, p.keys)
            p.residency = Residency.DROPPED
        p.tier = d
        if d in OFFLOAD_TIERS and math.isfinite(p.expected_wait_s) and self.prefetch_fraction > 0:
            # A safe lower bound of the return, less the time the reload takes.
            at = p.paused_at + max(0.0, self.prefetch_fraction * p.expected_wait_s - self.transfers.reload_s(p, d))
            if at > now:  # else the return is due already: the resume loads it
                self.set_prefetch(p, at)

    def _save(self, p: PausedRecord, d: Decision, sync: bool) -> Decision:
        """Copy the path's device blocks to the tier; a tier without room falls
        to the next (host -> disk -> drop)."""
        hit = self.kv.cached_prefix(p.history, p.scope, p.keys)
        if not hit.block_ids:
            return Decision.DROP
        n = self.kv.save_blocks(hit.block_ids)  # what the copy takes, in whole blocks' worth
        if d is Decision.HOST and not self.transfers.reserve(Decision.HOST, n):
            d = Decision.DISK
        if d is Decision.DISK and not self.transfers.reserve(Decision.DISK, n):
            return Decision.DROP
        p.residency = Residency.SAVING
        self.transfers.save(p, d, hit, sync)
        return d

    def _demote(self, p: PausedRecord, sync: bool = False) -> None:
        """Kept state leaves the device: where the policy said it goes once the
        lease is over (its fallback). sync: the pool needs the frames now."""
        if p.pin is not None:
            self.kv.unpin(p.pin)
            p.pin = None
        p.prefetched = False
        to = (p.decision.fallback if p.decision is not None else None) or self.policy.demote(Decision.KEEP)
        self.stats.demoted_to[to.value] += 1
        self._place(p, to, None, sync)

    def _prefetch(self, p: PausedRecord, now: float) -> None:
        """Load offloaded state back ahead of the return and hold it; not above
        the ceiling (it would only push other state out)."""
        p.prefetch_at = None
        if self.kv.active_usage() >= self.policy.admission_ceiling or self.transfers.busy(p):
            return
        p.residency = Residency.LOADING
        if not self.transfers.load(p, now, self.prefetch_landed):
            p.residency = Residency.OFFLOADED  # no room now: the state stays on its tier, the resume tries again

    def _timer(self, t: float, kind: str, p: PausedRecord) -> None:
        heapq.heappush(self._timers, (t, next(self._seq), kind, p))


def _unpaused(p: PausedRecord) -> None:
    """p is no longer paused: its timers go stale (they check the tier and the
    deadline they were set for)."""
    p.tier, p.residency, p.lease_deadline, p.prefetch_at, p.prefetched = None, None, None, None, False
