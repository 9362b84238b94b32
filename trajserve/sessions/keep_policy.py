"""Keep, offload or drop a paused session's KV state (a tool call is running).

Spec: kv-cache-management, "保留、驱逐、重计算或卸载" (section 6; its
"分析机制：盈亏平衡决策边界" derives the break-even wait), "分层辅助存储"
(the disk tier), "服务遥测动态" (U_KV, eq. 8, and the admission ceiling
tau_high = 0.88) and the pitfall "无论等待时间多长，都让暂停状态保持驻留";
inference-optimization 8.3.4 (cache value V_h).

The numbers, per paused session of S tokens and M_KV = S * m_token bytes (eq. 1):

    T_recomp  = S / (measured prefill tokens/s)      (spec: 2 P S / R_prefill)
    T_reload  = M_KV / B per tier                    (host: the device link;
                                                      disk: streamed through host)
    V_h       = p (T_recomp - T_reload) - T_m        (8.3.4; T_m = the write-out)
    T*_wait   = (2 M_KV / B) * mu_HBM / (mu_HBM - mu_DRAM) + dT_stall

Decision for an expected wait T_wait:

    where would the state go?  host if it has room and V_h(host) > 0, unless the
                               wait is long (minutes: host_lease_s) and the disk
                               also pays; else disk if it pays; else drop.
    keep it instead?           when T_wait < T*_wait for that target and U_KV is
                               below the admission ceiling (lease = T*_wait).

T*_wait is never shorter than the target's round trip, so the feasibility rule
T_wait > 2 M_KV / B (an offload must finish before the tool returns) holds
whenever the policy offloads -- except above the ceiling, where the pool needs
the memory now and paused state leaves the device regardless.
"""
from __future__ import annotations

import enum
import math
from dataclasses import dataclass

from trajserve.kv.cost_rates import CostRates
from trajserve.plan.keep_offload import break_even_wait
from trajserve.plan.retention import retention_value
from trajserve.units import seconds as fmt_s

__all__ = ["Decision", "KeepPolicy", "PauseDecision", "PauseState"]


class Decision(enum.Enum):
    KEEP = "keep"        # stay in the device pool (pinned, with a lease)
    HOST = "host"        # offload to host memory, reload on resume
    DISK = "disk"        # offload to the disk tier, reload on resume
    DROP = "drop"        # free it; recompute (prefill) on resume


# One step down the memory hierarchy when a lease expires.
_DEMOTION = {Decision.KEEP: Decision.HOST, Decision.HOST: Decision.DISK,
             Decision.DISK: Decision.DROP, Decision.DROP: Decision.DROP}


@dataclass(slots=True)
class PauseState:
    num_tokens: int            # tokens whose KV the session holds
    kv_bytes: int              # their bytes (num_tokens x m_token, eq. 1)
    expected_wait_s: float     # may be inf (a human with no deadline)
    pool_usage: float          # U_KV now (eq. 8), 0..1
    host_free_bytes: int
    disk_free_bytes: int
    resume_prob: float = 1.0   # p_h of 8.3.4: sessions get abandoned; 1 = it will come back


@dataclass(frozen=True, slots=True)
class PauseDecision:
    decision: Decision
    lease_s: float | None      # when the state should move down a tier if the session is still paused
    t_recompute_s: float
    t_reload_host_s: float
    t_reload_disk_s: float     # the numbers behind the choice
    reason: str                # one line a human can read in logs/metrics
    break_even_wait_s: float   # T*_wait against `target` (the KEEP lease)
    target: Decision           # where the state goes if not kept (HOST, DISK or DROP)
    fallback: Decision         # where it goes when lease_s runs out
    value_host_s: float        # V_h of offloading to host (8.3.4); > 0 means it pays
    value_disk_s: float


class KeepPolicy:
    """Chooses keep / host / disk / drop when a session pauses for a tool.

    Memory pressure enters through the shadow price of HBM. With U_c the
    admission ceiling and phi0 = idle_keep_factor:

        mu_HBM(U) / mu_DRAM = k / (1 - U / U_c),   k = phi0 / (phi0 - 1)

    Why this shape: the opportunity cost of a held byte is the delay it causes
    other work, which grows like a queue's 1 / (1 - load). Load is measured
    against the ceiling, not 1.0, because that is where the pool stops
    admitting work and p99 latency breaks away ("服务遥测动态", fig. 12). At
    the ceiling mu_HBM -> inf, so T*_wait -> the round trip: the spec's limit
    for mu_HBM >> mu_DRAM. At an empty pool HBM costs only k x DRAM, so
    T*_wait = phi0 x round trip: state rides out short tool calls, yet a lease
    always exists and the state still moves if the session stays paused. The
    multiplier mu_HBM / (mu_HBM - mu_DRAM) = 1 / (1 - rho) with
    rho = mu_DRAM / mu_HBM = (1 - 1/phi0)(1 - U/U_c) falls from phi0 to 1 as U
    rises, so a fuller pool never keeps state longer.
    """

    def __init__(self, rates: CostRates, admission_ceiling: float = 0.88, stall_tolerance_s: float = 0.0,
                 idle_keep_factor: float = 10.0, host_lease_s: float = 60.0,
                 disk_lease_s: float | None = None) -> None:
        # 0.88: the spec's admission ceiling tau_high ("服务遥测动态").
        if not 0 < admission_ceiling <= 1:
            raise ValueError(f"admission ceiling must be in (0, 1], got {admission_ceiling}")
        if not (math.isfinite(stall_tolerance_s) and stall_tolerance_s >= 0):
            raise ValueError(f"stall tolerance must be >= 0 s, got {stall_tolerance_s}")
        if not (math.isfinite(idle_keep_factor) and idle_keep_factor >= 1):
            raise ValueError(f"idle keep factor must be a finite number >= 1, got {idle_keep_factor}")
        if not host_lease_s > 0 or (disk_lease_s is not None and not disk_lease_s > 0):
            raise ValueError("host and disk leases must be > 0 s")
        self.rates = rates
        self.admission_ceiling = admission_ceiling
        self.stall_tolerance_s = stall_tolerance_s   # dT_stall of the break-even wait
        self.idle_keep_factor = idle_keep_factor
        # Host DRAM serves "seconds" of tool wait; minutes and longer (human
        # approvals) go to disk ("分层辅助存储"; fig. 10's third region).
        self.host_lease_s = host_lease_s
        self.disk_lease_s = disk_lease_s             # None: disk state waits until resume

    # -- pressure ----------------------------------------------------------

    def dram_price_ratio(self, pool_usage: float) -> float:
        """rho = mu_DRAM / mu_HBM(U_KV), in [0, 1); see the class docstring."""
        load = min(max(pool_usage, 0.0) / self.admission_ceiling, 1.0)
        return (1 - 1 / self.idle_keep_factor) * (1 - load)

    def pressure_factor(self, pool_usage: float) -> float:
        """mu_HBM / (mu_HBM - mu_DRAM): from idle_keep_factor (empty pool) down to 1 (ceiling)."""
        return 1 / (1 - self.dram_price_ratio(pool_usage))

    # -- decision ----------------------------------------------------------

    def decide(self, state: PauseState) -> PauseDecision:
        _check(state)
        r = self.rates
        t_r = r.recompute_s(state.num_tokens)
        t_h = r.host_reload_s(state.kv_bytes)
        t_d = r.disk_reload_s(state.kv_bytes)
        # 8.3.4: fetch time T_f = one reload; upkeep T_m = the write-out, also one transfer.
        v_h = retention_value(state.resume_prob, t_r, t_h, t_h)
        v_d = retention_value(state.resume_prob, t_r, t_d, t_d)
        host_ok = state.host_free_bytes >= state.kv_bytes and v_h > 0
        disk_ok = state.disk_free_bytes >= state.kv_bytes and v_d > 0
        target = self._target(state.expected_wait_s, host_ok, disk_ok)
        t_star = self._break_even(target, state, t_r)
        above = state.pool_usage >= self.admission_ceiling
        keep = not above and state.expected_wait_s < t_star
        decision = Decision.KEEP if keep else target
        lease = {Decision.KEEP: t_star, Decision.HOST: self.host_lease_s,
                 Decision.DISK: self.disk_lease_s, Decision.DROP: None}[decision]
        fallback = target if keep else _fallback(decision, disk_ok)
        reason = self._reason(decision, target, state, t_star, t_r, t_h, t_d, v_h, v_d, above)
        return PauseDecision(decision=decision, lease_s=lease, t_recompute_s=t_r, t_reload_host_s=t_h,
                             t_reload_disk_s=t_d, reason=reason, break_even_wait_s=t_star, target=target,
                             fallback=fallback, value_host_s=v_h, value_disk_s=v_d)

    def demote(self, decision: Decision, state: PauseState | None = None) -> Decision:
        """KEEP -> HOST -> DISK -> DROP when a lease expires. Given the state,
        tiers without room for it are skipped. (PauseDecision.fallback is the
        better-informed choice: it also skips tiers that don't pay.)"""
        nxt = _DEMOTION[decision]
        if state is not None:
            if nxt is Decision.HOST and state.host_free_bytes < state.kv_bytes:
                nxt = Decision.DISK
            if nxt is Decision.DISK and state.disk_free_bytes < state.kv_bytes:
                nxt = Decision.DROP
        return nxt

    def _target(self, wait: float, host_ok: bool, disk_ok: bool) -> Decision:
        """Where the state goes if it leaves the device."""
        if host_ok and (wait < self.host_lease_s or not disk_ok):
            return Decision.HOST
        if disk_ok:
            return Decision.DISK
        return Decision.DROP    # recompute is cheaper than any reload, or nothing else has room

    def _break_even(self, target: Decision, state: PauseState, t_recompute: float) -> float:
        """T*_wait against the target tier (section 6, "分析机制：盈亏平衡决策边界")."""
        rho = self.dram_price_ratio(state.pool_usage)
        if target is Decision.HOST:
            return break_even_wait(state.kv_bytes, self.rates.host_bytes_per_s, rho, self.stall_tolerance_s)
        if target is Decision.DISK:
            # Disk is cheaper to hold than DRAM; pricing it like DRAM keeps state
            # slightly longer, never shorter, than the exact price would.
            bw = min(self.rates.disk_bytes_per_s, self.rates.host_bytes_per_s)
            return break_even_wait(state.kv_bytes, bw, rho, self.stall_tolerance_s)
        # Dropped state costs nothing to hold (mu = 0), so the same equality,
        # mu_HBM M T = mu_HBM M T_recomp, gives T* = T_recomp: the prefill replaces the round trip.
        return t_recompute + self.stall_tolerance_s

    def _reason(self, decision: Decision, target: Decision, s: PauseState, t_star: float, t_r: float,
                t_h: float, t_d: float, v_h: float, v_d: float, above: bool) -> str:
        head = f"{decision.value}: "
        if above:
            head += f"U_KV {s.pool_usage:.2f} >= ceiling {self.admission_ceiling:.2f}, paused state leaves the device; "
        cmp = "<" if s.expected_wait_s < t_star else ">="
        wait = f"wait {fmt_s(s.expected_wait_s)} {cmp} T* {fmt_s(t_star)} vs {target.value}"
        if target is Decision.DROP:
            why = (f"recompute {fmt_s(t_r)}; host {_tier_note(s.host_free_bytes, s.kv_bytes, t_h, v_h)}; "
                   f"disk {_tier_note(s.disk_free_bytes, s.kv_bytes, t_d, v_d)}")
        else:
            t = t_h if target is Decision.HOST else t_d
            why = f"reload {fmt_s(t)} vs recompute {fmt_s(t_r)} ({_ratio(t_r, t)})"
        return f"{head}{wait}; {why}; U_KV {s.pool_usage:.2f} (x{self.pressure_factor(s.pool_usage):.2f})"


def _fallback(decision: Decision, disk_ok: bool) -> Decision:
    if decision is Decision.HOST:
        return Decision.DISK if disk_ok else Decision.DROP
    return Decision.DROP


def _tier_note(free: int, nbytes: int, t_reload: float, value: float) -> str:
    if free < nbytes:
        return "full"
    return f"round trip {fmt_s(2 * t_reload)} (V_h {value:+.3g} s)"


def _ratio(a: float, b: float) -> str:
    return f"{a / b:.1f}x" if b > 0 else "n/a"


def _check(s: PauseState) -> None:
    if s.num_tokens < 0 or s.kv_bytes < 0 or s.host_free_bytes < 0 or s.disk_free_bytes < 0:
        raise ValueError(f"negative size in {s}")
    if math.isnan(s.expected_wait_s) or s.expected_wait_s < 0:
        raise ValueError(f"expected wait must be >= 0 s (inf allowed), got {s.expected_wait_s}")
    if not 0.0 <= s.pool_usage <= 1.0:
        raise ValueError(f"U_KV (eq. 8) must be in [0, 1], got {s.pool_usage}")
    if not 0.0 <= s.resume_prob <= 1.0:
        raise ValueError(f"resume probability must be in [0, 1], got {s.resume_prob}")
