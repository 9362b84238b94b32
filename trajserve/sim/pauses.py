"""Tool pauses in the simulator: the engine's pause state machine on a virtual clock.

When a session's call finishes and its next call is due later (a tool run,
a human's think time), the session pauses, and the engine's own pause state
machine (sessions/pause_machine.py, which the engine's SessionManager runs too)
decides where its KV state waits (kv-cache-management section 6, the
break-even wait T*_wait; "分层辅助存储" for the tiers):

    keep   pin the history's radix path on the device, with a lease T*_wait;
           when it runs out the state moves to the policy's fallback tier
    host   copy the path's blocks over the host link, free them on the device
    disk   the same copy to host staging, then a background write to NVMe
    drop   free them; the next call recomputes (prefill) what is missing

and runs the mechanics around it: kept state gives way to running work
before anyone is preempted (the KV manager's reclaimer, the session
expected back last first), state above the admission ceiling leaves the
device, offloaded state is prefetched at prefetch_fraction x the expected
wait less the reload time, and if nothing at all can run because of forced
keeps, the oldest is dropped (a stall drop).

This module is only the machine's transfers on the cost model's links
(CostModelLink) and the simulator's side of the calls (PauseController).
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
from dataclasses import dataclass, field
from collections import Counter

from trajserve.engine.scheduler import Scheduler
from trajserve.kv.cost_rates import CostRates
from trajserve.kv.radix_cache import MatchResult
from trajserve.kv.scope import CacheScope
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.keep_policy import Decision, KeepPolicy
from trajserve.sessions.pause_machine import PauseCounts, PauseMachine, PausedRecord, Residency
from trajserve.sessions.wait_estimator import WaitEstimator
from trajserve.sim.cost_model import CostModel
from trajserve.sim.workload import Session

MODES = ("policy", "keep", "host", "disk", "drop")
WAIT_HINTS = ("exact", "estimate")


@dataclass(eq=False)
class Paused(PausedRecord):
    """One paused session: the machine's record, and what the cost-model link
    keeps of its saved state."""
    saved_blocks: int = 0           # blocks held on the host / disk tier
    saved_bytes: int = 0
    io_done: float = 0.0            # when its disk write has landed


@dataclass
class PauseStats(PauseCounts):
    pauses: int = 0
    blocks_out: Counter = field(default_factory=Counter)  # per tier: blocks written to host / disk
    blocks_in: Counter = field(default_factory=Counter)   # per tier: blocks loaded back
    link_s: Counter = field(default_factory=Counter)      # seconds per link: host (both ways), nvme
    copy_wait_s: float = 0.0        # time steps waited for copies (the engine thread copies)
    resume_stall_s: float = 0.0
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


class CostModelLink:
    """The pause machine's transfers in virtual time: tier capacities, and
    copies that occupy the engine thread (copy_free_at) or the I/O thread."""

    def __init__(self, kv, cost: CostModel, stats: PauseStats, host_bytes: float, disk_bytes: float) -> None:
        self.kv, self.cost, self.stats = kv, cost, stats
        self.block_bytes = int(cost.model.m_token * kv.block_size)  # whole model, as the engine's policy sees it
        hw = cost.hw
        # A tier behind a link of unknown speed cannot be priced: no room in it.
        self.host_cap = int(host_bytes) if hw.host_link_bandwidth > 0 else 0
        self.disk_cap = int(disk_bytes) if hw.nvme_bandwidth > 0 and hw.host_link_bandwidth > 0 else 0
        self.host_used = self.disk_used = 0
        self.copy_free_at = 0.0     # the engine thread is copying until then
        self._disk_free_at = 0.0    # the I/O thread's queue of writes
        self.now = 0.0

    def free_bytes(self, tier: Decision) -> int:
        return self.host_cap - self.host_used if tier is Decision.HOST else self.disk_cap - self.disk_used

    def reserve(self, tier: Decision, nblocks: int) -> bool:
        nbytes = nblocks * self.block_bytes
        if nbytes > self.free_bytes(tier):
            return False
        st = self.stats
        if tier is Decision.HOST:
            self.host_used += nbytes
            st.host_peak_bytes = max(st.host_peak_bytes, self.host_used)
        else:
            self.disk_used += nbytes
            st.disk_peak_bytes = max(st.disk_peak_bytes, self.disk_used)
        return True

    def save(self, p: Paused, tier: Decision, hit: MatchResult, sync: bool) -> None:
        n = len(hit.block_ids)
        # Device -> host first (the engine reads the blocks on its thread), for both tiers.
        self._copy(n, "host", self.now)
        if tier is Decision.DISK:
            write = self.cost.transfer_time(n, self.kv.block_size, "nvme")
            p.io_done = self._disk_free_at = max(self.copy_free_at, self._disk_free_at) + write
            self.stats.link_s["nvme"] += write
        self.stats.blocks_out[tier.value] += n
        p.saved_blocks, p.saved_bytes = n, n * self.block_bytes
        p.residency = Residency.OFFLOADED  # the time is in copy_free_at; the frames go now
        self.kv.evict_prefix(p.history, p.scope, p.keys)

    def load(self, p: Paused, now: float, landed) -> bool:
        ok = self._reload(p, now, keep_if_no_room=landed is not None)
        if landed is None:  # a resume: its call (and the whole next step) waits for the copy queue to drain
            self.stats.resume_stall_s += max(0.0, self.copy_free_at - now)
        elif ok:
            landed(p, True)
        return ok

    def _reload(self, p: Paused, now: float, keep_if_no_room: bool) -> bool:
        """Saved blocks back into fresh device blocks and into the tree (a
        disk reload streams NVMe -> host -> device: the slower link sets the
        pace). No room: a prefetch leaves the state on its tier (the resume
        tries again), a resume gives it up (the call recomputes it)."""
        kv = self.kv
        got = kv.begin_import(p.history, p.scope, p.saved_blocks, p.keys)
        if got is None:
            if not keep_if_no_room:
                self._release(p)
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
        kv.finish_import(p.history, p.scope, hit, new_ids, k, p.keys)
        self._release(p)
        return True

    def reload_s(self, p: Paused, tier: Decision) -> float:
        B = self.kv.block_size
        t = self.cost.transfer_time(p.saved_blocks, B, "host")
        return max(t, self.cost.transfer_time(p.saved_blocks, B, "nvme")) if tier is Decision.DISK else t

    # Copies here finish in virtual time: nothing is ever in flight to land.
    def busy(self, p: Paused) -> bool:
        return False

    def before_resume(self, p: Paused) -> None:
        pass

    def land_saves(self, need: int) -> int:
        return 0

    def land_all(self) -> bool:
        return False

    def _release(self, p: Paused) -> None:
        if p.saved_bytes:
            if p.tier is Decision.DISK:
                self.disk_used -= p.saved_bytes
            else:
                self.host_used -= p.saved_bytes
        p.saved_blocks = p.saved_bytes = 0

    def _copy(self, nblocks: int, link: str, start: float, at_least: float = 0.0) -> None:
        """A copy on the engine thread, after whatever it is copying already."""
        dt = max(self.cost.transfer_time(nblocks, self.kv.block_size, link), at_least)
        begin = max(start, self.copy_free_at)
        self.copy_free_at = begin + dt
        self.stats.link_s[link] += dt


class PauseController:
    """The simulator's side: pauses at call ends, resumes at arrivals, a tick before each step."""

    def __init__(self, sched: Scheduler, cost: CostModel, *, mode: str = "policy", wait_hint: str = "exact",
                 host_bytes: float = 0.0, disk_bytes: float = 0.0, prefetch_fraction: float = SessionConfig.prefetch_fraction,
                 policy: KeepPolicy | None = None) -> None:
        if mode not in MODES:
            raise ValueError(f"keep policy mode {mode!r}: use one of {', '.join(MODES)}")
        if wait_hint not in WAIT_HINTS:
            raise ValueError(f"wait hint {wait_hint!r}: use one of {', '.join(WAIT_HINTS)}")
        if host_bytes < 0 or disk_bytes < 0:
            raise ValueError("host and disk tier capacities must be >= 0 bytes")
        self.sched, self.kv, self.mode = sched, sched.kv, mode
        self.stats = PauseStats()
        self.link = CostModelLink(sched.kv, cost, self.stats, host_bytes, disk_bytes)
        self.policy = policy or KeepPolicy(rates_from_cost(cost, sched.config.max_prefill_chunk),
                                           admission_ceiling=sched.config.admission_ceiling)
        self.waits = WaitEstimator() if wait_hint == "estimate" else None
        self.machine = PauseMachine(sched.kv, self.policy, self.link, self.stats, block_bytes=self.link.block_bytes,
                                    ceiling_blocks=lambda: sched.ceiling_blocks, clock=lambda: self.link.now,
                                    prefetch_fraction=prefetch_fraction)
        self.paused = self.machine.paused

    @property
    def copy_free_at(self) -> float:
        return self.link.copy_free_at

    @property
    def host_used(self) -> int:
        return self.link.host_used

    @property
    def disk_used(self) -> int:
        return self.link.disk_used

    def pause(self, s: Session, history: list[int], scope: CacheScope, wait_s: float, now: float) -> None:
        """s's call ended at `now`; its next call arrives wait_s later."""
        self.link.now = now
        if self.waits is None:
            expected, known = wait_s, True
        else:
            est = self.waits.estimate(None, None)
            expected, known = est.seconds, est.source != "prior"
        p = Paused(history, self.kv.block_keys(history), scope)
        self.stats.pauses += 1
        self.machine.pause(s, p, expected, known, None if self.mode == "policy" else self.mode, now)

    def resume(self, s: Session, arrival: float, now: float) -> None:
        """s's next call arrived at `arrival` and enters the scheduler at `now`:
        bring its state back so the prompt's match finds it."""
        p = self.paused.get(s)
        if p is None:
            return
        self.link.now = now
        if self.waits is not None:
            self.waits.observe(None, max(0.0, arrival - p.paused_at))
        self.machine.resume(s, now)

    def tick(self, now: float) -> None:
        self.link.now = now
        self.machine.tick(now)

    def next_timer(self) -> float | None:
        return self.machine.next_timer()

    def relieve_stall(self) -> bool:
        return self.machine.relieve_stall()

    def observe_prefill(self, computed_tokens: int, ttft_s: float) -> None:
        self.machine.observe_prefill(computed_tokens, ttft_s)

    def summary(self) -> dict:
        out = self.stats.to_dict()
        out.update(mode=self.mode, wait_hint="estimate" if self.waits else "exact",
                   host_capacity_bytes=self.link.host_cap, disk_capacity_bytes=self.link.disk_cap,
                   prefill_tokens_per_s=self.policy.rates.prefill_tokens_per_s)
        return out
