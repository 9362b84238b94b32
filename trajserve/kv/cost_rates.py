"""The rates everything that prices KV state moves with: prefill tokens/s
(recomputing), host and disk bytes/s (reloading). Measured on this machine
at start-up (engine/calibration.py) and kept current from real prefills and
copies (EWMA), so the keep policy (sessions/keep_policy.py) and the
preemption pricer (kv/preemption.py) follow the machine they run on, not a
datasheet. Spec: kv-cache-management section 6 (T_recomp, T_reload), table 3.
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import TYPE_CHECKING

from trajserve.plan.keep_offload import transfer_time

if TYPE_CHECKING:
    from trajserve.plan.catalog import DeviceSpec


@dataclass(slots=True)
class CostRates:
    """Measured rates; the engine feeds real prefills and copies back in (EWMA),
    so the policy follows the machine it runs on, not a datasheet."""
    prefill_tokens_per_s: float
    host_bytes_per_s: float     # device<->host copy bandwidth (one direction)
    disk_bytes_per_s: float     # host<->disk
    alpha: float = 0.2          # EWMA weight of the newest observation

    def __post_init__(self) -> None:
        for name in ("prefill_tokens_per_s", "host_bytes_per_s", "disk_bytes_per_s"):
            v = getattr(self, name)
            if not (math.isfinite(v) and v > 0):
                raise ValueError(f"{name} must be a finite rate > 0, got {v}")
        if not 0 < self.alpha <= 1:
            raise ValueError(f"EWMA alpha must be in (0, 1], got {self.alpha}")

    @classmethod
    def from_specs(cls, device: DeviceSpec, params: float, num_devices: int = 1,
                   mfu: float = 0.45) -> CostRates:
        """Starting rates from the catalog, before anything is measured.

        R_prefill = num_devices * peak * MFU and T_recomp = 2 P S / R_prefill
        (section 6), so tokens/s = R_prefill / (2 P). The default MFU is the
        45% the spec assumes for batch-1 prefill (boxes 0.4, 0.6). Each device
        has its own host link and drive (box 0.6), so both scale with devices.
        """
        if device.bf16_flops <= 0 or device.host_link_bandwidth <= 0 or device.nvme_bandwidth <= 0:
            raise ValueError(f"{device.key}: FLOP/s or link bandwidths unknown; calibrate or measure them")
        return cls(prefill_tokens_per_s=num_devices * device.bf16_flops * mfu / (2 * params),
                   host_bytes_per_s=num_devices * device.host_link_bandwidth,
                   disk_bytes_per_s=num_devices * device.nvme_bandwidth)

    def observe_prefill(self, tokens: int, seconds: float) -> None:
        self.prefill_tokens_per_s = self._ewma(self.prefill_tokens_per_s, tokens, seconds)

    def observe_host_copy(self, nbytes: int, seconds: float) -> None:
        self.host_bytes_per_s = self._ewma(self.host_bytes_per_s, nbytes, seconds)

    def observe_disk_copy(self, nbytes: int, seconds: float) -> None:
        self.disk_bytes_per_s = self._ewma(self.disk_bytes_per_s, nbytes, seconds)

    def _ewma(self, old: float, amount: float, secs: float) -> float:
        # An empty or unmeasurably short operation has no rate; a zero or
        # infinite rate would poison every later decision, so skip it.
        if amount <= 0 or not (math.isfinite(secs) and secs > 0):
            return old
        return (1 - self.alpha) * old + self.alpha * (amount / secs)

    def recompute_s(self, num_tokens: int) -> float:
        """T_recomp(S) ~ 2 P S / R_prefill (section 6), with the measured tokens/s
        standing in for R_prefill / 2P. It ignores the quadratic attention term,
        as the spec does below ~32K tokens; measured prefill rates include it."""
        return num_tokens / self.prefill_tokens_per_s

    def host_reload_s(self, nbytes: int) -> float:
        """T_reload = M_KV / B_pcie (section 6), one direction."""
        return transfer_time(nbytes, self.host_bytes_per_s)

    def disk_reload_s(self, nbytes: int) -> float:
        """M_KV / B_nvme (table 3). Disk state reaches the device through host
        staging buffers; blocks stream, so the two hops overlap and the slower
        link sets the time."""
        return transfer_time(nbytes, min(self.disk_bytes_per_s, self.host_bytes_per_s))
