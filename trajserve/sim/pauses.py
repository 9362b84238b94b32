"""Tool pauses in the simulator: the engine's keep policy on a virtual clock.

When a session's call finishes and its next call is due later (a tool run,
a human's think time), the session pauses, and -- as the engine's
SessionManager does (trajserve/engine/session.py) -- the same KeepPolicy
decides where its KV state waits (kv-cache-management section 6, the
break-even wait T*_wait; "分层辅助存储" for the tiers):

    keep   pin the history's radix path on the device, with a lease T*_wait;
           when it runs out the state moves to the policy's fallback tier
    host   copy the path's blocks over the host link, free them on the device
    disk   the same copy to host staging, then a background write to NVMe
    drop   free them; the next call recomputes (prefill) what is missing

and the same mechanics around it: kept state gives way to running work
before anyone is preempted (the KV manager's reclaimer, the session
expected back last first), state above the admission ceiling leaves the
device, offloaded state is prefetched at prefetch_fraction x the expected
wait less the reload time, and if nothing at all can run because of forced
keeps, the oldest is dropped (a stall drop).

Transfers take time per link, from the cost model (bytes per device over
that device's link; a disk reload streams NVMe -> host -> device, so the
slower link sets the pace). The engine copies on its own thread between
steps, so copies and forward passes serialize: a copy issued at time t
delays the next step until it is done (copy_free_at). Disk writes run in
the background, as the engine's I/O thread does; a reload of state whose
write has not landed waits for it.

The policy's rates start from the cost model (what the engine's start-up
calibration would measure) and follow observed prefills (EWMA), like the
engine's. The expected wait is the true one (an agent harness that
announces its tool's deadline: `exact`), or the engine's WaitEstimator fed
with every observed wait (`estimate`: no hints, history only).
"""
from __future__ import annotations

import dataclasses
import heapq
import itertools
import math
from collections import Counter
from dataclasses import dataclass, field

from trajserve.engine.scheduler import Scheduler
from trajserve.kv.keep_policy import CostRates, Decision, KeepPolicy, PauseDecision, PauseState
from trajserve.kv.radix_cache import RadixNode
from trajserve.kv.wait_estimator import WaitEstimator
from trajserve.sim.cost_model import CostModel
from trajserve.sim.workload import Session

MODES = ("policy", "keep", "host", "disk", "drop")
WAIT_HINTS = ("exact", "estimate")


@dataclass(slots=True, eq=False)
class Paused:
    """One paused session and where its state waits."""
    history: list[int]
    keys: list                      # its block keys, chunked once (a history can be 10^5 tokens)
    cache_salt: str | None
    paused_at: float
    expected_wait_s: float          # inf when unknown (no hint, no history)
    decision: PauseDecision
    forced: bool
    tier: Decision | None = None
    pin: RadixNode | None = None
    saved_blocks: int = 0           # blocks held on the host / disk tier
    saved_bytes: int = 0
    lease_deadline: float | None = None
    prefetch_at: float | None = None
    prefetched: bool = False
    io_done: float = 0.0            # when its disk write has landed


@dataclass(slots=True)
class PauseStats:
    pauses: int = 0
    decisions: Counter = field(default_factory=Counter)   # one per pause, as the policy (or the mode) made it
    placed: Counter = field(default_factory=Counter)      # where each pause's state went (a full tier falls through)
    demoted_to: Counter = field(default_factory=Counter)  # where kept state went when a lease or pressure moved it
    blocks_out: Counter = field(default_factory=Counter)  # per tier: blocks written to host / disk
    blocks_in: Counter = field(default_factory=Counter)   # per tier: blocks loaded back
    link_s: Counter = field(default_factory=Counter)      # seconds per link: host (both ways), nvme
    copy_wait_s: float = 0.0        # time steps waited for copies (the engine thread copies)
    lease_demotions: int = 0
    pressure_demotions: int = 0
    stall_drops: int = 0
    prefetches: int = 0
    prefetch_hits: int = 0
    resume_stalls: int = 0          # resumes that had to load state back first
    resume_stall_s: float = 0.0
    recomputed_tokens: int = 0      # history a resumed call found missing on the device
    host_peak_bytes: int = 0
    disk_peak_bytes: int = 0

    def to_dict(self) -> dict:
        # Not dataclasses.asdict: it rebuilds a Counter from (key, value) pairs, counting the pairs.
        return {f.name: dict(v) if isinstance(v := getattr(self, f.name), Counter) else v
                for f in dataclasses.fields(self)}


def rates_from_cost(cost: CostModel, chunk: int) -> CostRates:
    """What the engine's start-up calibration would measure on this hardware:
    a prefill of one chunk from an empty cache, and the links. Rates are for
    whole-model bytes (PauseState.kv_bytes): each device moves its KV share
    over its own link, so the aggregate rate is link / share. A link the
    catalog does not know gets a token rate; its tier has no capacity then."""
    t = cost.step_for([(chunk, 0)]).total_s
    share = cost.model.kv_share
    host, nvme = cost.hw.host_link_bandwidth, cost.hw.nvme_bandwidth
    return CostRates(prefill_tokens_per_s=chunk / t, host_bytes_per_s=(host or 1.0) / share,
                     disk_bytes_per_s=(nvme or 1.0) / share)


class PauseController:
    def __init__(self, sched: Scheduler, cost: CostModel, *, mode: str = "policy", wait_hint: str = "exact",
                 host_bytes: float = 0.0, disk_bytes: float = 0.0, prefetch_fraction: float = 0.8,
                 policy: KeepPolicy | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"keep policy mode {mode!r}: use one of {', '.join(MODES)}")
        if wait_hint not in WAIT_HINTS:
            raise ValueError(f"wait hint {wait_hint!r}: use one of {', '.join(WAIT_HINTS)}")
        if not 0 <= prefetch_fraction <= 1:
            raise ValueError(f"prefetch_fraction must be in [0, 1], got {prefetch_fraction}")
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError("host and disk tier capacities must be >= 0 bytes")
        kv = sched.kv
        if kv.radix is None:
            raise ValueError("tool pauses keep state in the prefix cache: enable prefix caching")
        if kv.reclaimer is not None:
            raise ValueError("this KV manager already has a reclaimer")
        self.sched, self.kv, self.cost = sched, kv, cost
        self.mode, self.prefetch_fraction = mode, prefetch_fraction
        self.block_bytes = int(cost.model.m_token * kv.block_size)  # whole model, as the engine's policy sees it
        hw = cost.hw
        # A tier behind a link of unknown speed cannot be priced: no room in it.
        self.host_cap = int(host_bytes) if hw.host_link_bandwidth > 0 else 0
        self.disk_cap = int(disk_bytes) if hw.nvme_bandwidth > 0 and hw.host_link_bandwidth > 0 else 0
        self.host_used = self.disk_used = 0
        self.policy = policy or KeepPolicy(rates_from_cost(cost, sched.config.max_prefill_chunk),
                                           admission_ceiling=sched.config.admission_ceiling)
        self.waits = WaitEstimator() if wait_hint == "estimate" else None
        self.paused: dict[Session, Paused] = {}
        self.stats = PauseStats()
        self.copy_free_at = 0.0     # the engine thread is copying until then
        self._disk_free_at = 0.0    # the I/O thread's queue of writes
        self._timers: list[tuple[float, int, str, Paused]] = []
        self._seq = itertools.count()
        self._now = 0.0
        kv.reclaimer = self._reclaim

    # ------------------------------------------------------------ simulator
    def pause(self, s: Session, history: list[int], cache_salt: str | None, wait_s: float, now: float) -> None:
        """s's call ended at `now`; its next call arrives wait_s later."""
        self._now = now
        kv = self.kv
        kv.holds.cancel(s)  # the call ran: its resume's hold is over
        keys = kv.radix.block_keys(history)
        hit = kv.cached_prefix(history, cache_salt, keys)
        nblocks = len(hit.block_ids)
        if self.waits is None:
            expected, known = wait_s, True
        else:
            est = self.waits.estimate(None, None)
            expected, known = est.seconds, est.source != "prior"
        d = self.policy.decide(PauseState(
            num_tokens=nblocks * kv.block_size, kv_bytes=nblocks * self.block_bytes, expected_wait_s=expected,
            pool_usage=min(1.0, max(0.0, kv.active_usage())), host_free_bytes=self.host_cap - self.host_used,
            disk_free_bytes=self.disk_cap - self.disk_used))
        forced = self.mode != "policy"
        if forced:
            # As SessionManager.pause with a forced decision: no lease, the caller decided.
            f = Decision(self.mode)
            d = dataclasses.replace(d, decision=f, lease_s=None, fallback=d.target if f is Decision.KEEP
                                    else d.fallback, reason=f"forced {f.value} (policy: {d.reason})")
        p = Paused(history, keys, cache_salt, now, expected if known else math.inf, d, forced)
        self.paused[s] = p
        self.stats.pauses += 1
        self.stats.decisions[d.decision.value] += 1
        self._place(p, d.decision, d.lease_s)
        self.stats.placed[p.tier.value] += 1

    def resume(self, s: Session, arrival: float, now: float) -> None:
        """s's next call arrived at `arrival` and enters the scheduler at `now`:
        bring its state back so the prompt's match finds it."""
        p = self.paused.pop(s, None)
        if p is None:
            return
        self._now = now
        if self.waits is not None:
            self.waits.observe(None, max(0.0, arrival - p.paused_at))
        kv = self.kv
        if p.pin is not None:  # held until the turn is admitted (kv/admission_hold.py)
            kv.holds.hold(s, p.pin)
            p.pin = None
        if p.prefetched:
            self.stats.prefetch_hits += 1
        elif p.tier in (Decision.HOST, Decision.DISK):
            self._reload(p, now)
            self.stats.resume_stalls += 1
            # Its call (and the whole next step) waits for the copy queue to drain.
            self.stats.resume_stall_s += max(0.0, self.copy_free_at - now)
        hit = kv.cached_prefix(p.history, p.cache_salt, p.keys)
        self.stats.recomputed_tokens += max(0, len(p.history) - 1 - hit.num_tokens)
        p.tier, p.lease_deadline, p.prefetch_at = None, None, None  # its timers are stale now

    def tick(self, now: float) -> None:
        """Before a step: leases and prefetches due, then the admission ceiling."""
        self._now = now
        timers = self._timers
        while timers and timers[0][0] <= now:
            t, _, kind, p = heapq.heappop(timers)
            if kind == "lease" and p.tier is Decision.KEEP and p.lease_deadline == t:
                self.stats.lease_demotions += 1
                self._demote(p)
            elif kind == "prefetch" and p.prefetch_at == t and p.tier in (Decision.HOST, Decision.DISK):
                self._prefetch(p, now)
        over = self.kv.num_active_blocks - self.sched.ceiling_blocks
        if over > 0 and self.paused:
            self.kv.reclaim(over)

    def next_timer(self) -> float | None:
        return self._timers[0][0] if self._timers else None

    def relieve_stall(self) -> bool:
        """Nothing can run and nothing was released: drop the oldest pinned
        paused state (SessionManager._relieve_stall)."""
        victims = [p for p in self.paused.values() if p.pin is not None]
        if not victims:
            return self.kv.holds.release_all() > 0
        v = min(victims, key=lambda p: p.paused_at)
        self.kv.unpin(v.pin)
        v.pin = None
        self.kv.evict_prefix(v.history, v.cache_salt, v.keys)
        v.tier, v.prefetched = Decision.DROP, False
        self.stats.stall_drops += 1
        return True

    def observe_prefill(self, computed_tokens: int, ttft_s: float) -> None:
        """As SessionManager._observe_prefill: recompute estimates follow measured prefills."""
        if computed_tokens >= 64 and ttft_s > 0:
            self.policy.rates.observe_prefill(computed_tokens, ttft_s)

    def summary(self) -> dict:
        out = self.stats.to_dict()
        out.update(mode=self.mode, wait_hint="estimate" if self.waits else "exact",
                   host_capacity_bytes=self.host_cap, disk_capacity_bytes=self.disk_cap,
                   prefill_tokens_per_s=self.policy.rates.prefill_tokens_per_s)
        return out

    # ------------------------------------------------------------ placement
    def _place(self, p: Paused, d: Decision, lease_s: float | None) -> None:
        kv, now = self.kv, self._now
        if d is Decision.KEEP:
            p.pin = kv.pin(p.history, p.cache_salt, p.keys)
            p.lease_deadline = None if lease_s is None else now + lease_s
            if p.lease_deadline is not None:
                self._timer(p.lease_deadline, "lease", p)
        elif d in (Decision.HOST, Decision.DISK):
            d = self._save(p, d)
            kv.evict_prefix(p.history, p.cache_salt, p.keys)
        else:
            kv.evict_prefix(p.history, p.cache_salt, p.keys)
        p.tier = d
        if d in (Decision.HOST, Decision.DISK) and math.isfinite(p.expected_wait_s) and self.prefetch_fraction > 0:
            reload_s = self._reload_s(p.saved_blocks, d)
            at = p.paused_at + max(0.0, self.prefetch_fraction * p.expected_wait_s - reload_s)
            if at > now:
                p.prefetch_at = at
                self._timer(at, "prefetch", p)

    def _save(self, p: Paused, d: Decision) -> Decision:
        """Copy the path's device blocks to the tier; a full tier falls to the
        next one (host -> disk -> drop), as SessionManager._save does."""
        hit = self.kv.cached_prefix(p.history, p.cache_salt, p.keys)
        n = len(hit.block_ids)
        if not n:
            return Decision.DROP
        nbytes = n * self.block_bytes
        if d is Decision.HOST and self.host_used + nbytes > self.host_cap:
            d = Decision.DISK
        if d is Decision.DISK and self.disk_used + nbytes > self.disk_cap:
            return Decision.DROP
        # Device -> host first (the engine reads the blocks on its thread), for both tiers.
        self._copy(n, "host", self._now)
        if d is Decision.HOST:
            self.host_used += nbytes
            self.stats.host_peak_bytes = max(self.stats.host_peak_bytes, self.host_used)
        else:
            write = self.cost.transfer_time(n, self.kv.block_size, "nvme")
            p.io_done = self._disk_free_at = max(self.copy_free_at, self._disk_free_at) + write
            self.stats.link_s["nvme"] += write
            self.disk_used += nbytes
            self.stats.disk_peak_bytes = max(self.stats.disk_peak_bytes, self.disk_used)
        self.stats.blocks_out[d.value] += n
        p.saved_blocks, p.saved_bytes = n, nbytes
        return d

    def _reload(self, p: Paused, now: float) -> bool:
        """Saved blocks back into fresh device blocks and into the tree.
        False when the device has no room: the next call recomputes them."""
        kv = self.kv
        got = kv.begin_import(p.history, p.cache_salt, p.saved_blocks, p.keys)
        if got is None:
            self._release_saved(p)
            return False
        hit, new_ids = got
        k = len(new_ids)
        if k:
            start = max(now, p.io_done) if p.tier is Decision.DISK else now
            if p.tier is Decision.DISK:
                read = self.cost.transfer_time(k, kv.block_size, "nvme")
                self.stats.link_s["nvme"] += read
                self._copy(k, "host", start, at_least=read)
            else:
                self._copy(k, "host", start)
            self.stats.blocks_in[p.tier.value] += k
        kv.finish_import(p.history, p.cache_salt, hit, new_ids, k, p.keys)
        self._release_saved(p)
        return True

    def _prefetch(self, p: Paused, now: float) -> None:
        """Load offloaded state back ahead of the return and hold it; not above
        the ceiling (it would only push other state out)."""
        p.prefetch_at = None
        if self.kv.active_usage() >= self.policy.admission_ceiling:
            return
        if self._reload(p, now):
            p.pin = self.kv.pin(p.history, p.cache_salt, p.keys)
            p.tier, p.prefetched, p.lease_deadline = Decision.KEEP, True, None
            self.stats.prefetches += 1

    def _demote(self, p: Paused) -> None:
        if p.pin is not None:
            self.kv.unpin(p.pin)
            p.pin = None
        p.prefetched = False
        to = p.decision.fallback or self.policy.demote(Decision.KEEP)
        self.stats.demoted_to[to.value] += 1
        self._place(p, to, None)

    def _reclaim(self, need: int) -> int:
        """The KV manager's reclaimer (SessionManager._reclaim): kept paused state
        moves down a tier, the session expected back last first; forced keeps
        stay, a prefetch's hold can go again."""
        now = self._now
        cands = [p for p in self.paused.values() if p.pin is not None and (p.prefetched or not p.forced)]
        cands.sort(key=lambda p: p.paused_at + p.expected_wait_s - now, reverse=True)
        pool = self.kv.pool
        freed = 0
        for p in cands:
            if freed >= need:
                break
            before = pool.num_free
            self._demote(p)
            self.stats.pressure_demotions += 1
            freed += pool.num_free - before
        return freed

    def _release_saved(self, p: Paused) -> None:
        if p.saved_bytes:
            if p.tier is Decision.DISK:
                self.disk_used -= p.saved_bytes
            else:
                self.host_used -= p.saved_bytes
        p.saved_blocks = p.saved_bytes = 0

    # --------------------------------------------------------------- timing
    def _copy(self, nblocks: int, link: str, start: float, at_least: float = 0.0) -> None:
        """A copy on the engine thread, after whatever it is copying already."""
        dt = max(self.cost.transfer_time(nblocks, self.kv.block_size, link), at_least)
        begin = max(start, self.copy_free_at)
        self.copy_free_at = begin + dt
        self.stats.link_s[link] += dt

    def _reload_s(self, nblocks: int, tier: Decision) -> float:
        B = self.kv.block_size
        t = self.cost.transfer_time(nblocks, B, "host")
        return max(t, self.cost.transfer_time(nblocks, B, "nvme")) if tier is Decision.DISK else t

    def _timer(self, t: float, kind: str, p: Paused) -> None:
        heapq.heappush(self._timers, (t, next(self._seq), kind, p))
