"""Start-up measurement of the rates the keep policy and preemption price with.

The keep/offload/recompute decision (spec kv-cache-management "保留、驱逐、
重计算或卸载") compares T_reload = M_KV / B_tier with T_recompute =
S / R_prefill, so B_host, B_disk and R_prefill must be what this machine
does, not defaults. One cold copy of 32 blocks (the first version) came out
at 53-464 MB/s over five start-ups, below the disk rate at four: the first
touch of pages and of the allocator is not a copy rate. So each rate is
taken after a warm-up, as the median of several repeats over at least
COPY_BYTES (64 MiB) for the host copy and DISK_BYTES (16 MiB, written and
read back with every check) for the disk, and checked:

- a memcpy of the same bytes is measured beside them: a copy rate off by
  more than PLAUSIBLE (10x) either way is measured once more, then clamped
  into that range;
- the disk is never faster than the host copy that feeds it: B_disk is the
  rate of a block's whole trip (device -> host -> file -> host -> device,
  every check included), which contains a host copy each way, and the host
  and disk repeats alternate so both see the same moment of a shared machine
  (a VM's first touch of fresh pages varied the host copy 0.4-5.3 GB/s over
  five start-ups when the two were measured one after the other). A disk
  rate still above the host rate is capped at it.

What was found, and any correction, is logged in one line.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch

from trajserve.kv.cost_rates import CostRates
from trajserve.kv.tiers import BlockIdentity, digest
from trajserve.sampling import SamplingParams

log = logging.getLogger("trajserve")

COPY_BYTES = 64 << 20
DISK_BYTES = 16 << 20
CHUNK_BYTES = 16 << 20  # blocks borrowed from the pool for one copy (fewer if it holds fewer)
REPEATS = 3
PLAUSIBLE = 10.0


def _median_rate(fn, nbytes: int, repeats: int = REPEATS) -> float:
    return _median_rates([(fn, nbytes)], repeats)[0]


def _median_rates(jobs, repeats: int = REPEATS) -> list[float]:
    """Bytes per second of each (fn, nbytes): one warm-up each (first touch
    of the pages and the allocator), then `repeats` rounds running them in
    turn, the median of each."""
    for fn, _ in jobs:
        fn()
    times = [[] for _ in jobs]
    for _ in range(repeats):
        for (fn, _), ts in zip(jobs, times):
            t = time.perf_counter()
            fn()
            ts.append(time.perf_counter() - t)
    return [nbytes / dt if (dt := statistics.median(ts)) > 0 else float("inf")
            for (_, nbytes), ts in zip(jobs, times)]


def memcpy_rate(nbytes: int) -> float:
    src = torch.empty(max(1, nbytes), dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    return _median_rate(lambda: dst.copy_(src), src.numel())


def _host_job(engine, ids: list[int], reps: int):
    read = engine.runner.read_blocks

    def copy():
        for _ in range(reps):
            read(ids)
    return copy, len(ids) * engine.block_layout.payload_bytes * reps


class _DiskTrip:
    """k of the borrowed blocks to disk and back into the pool, as a save
    and a reload do it (read_blocks, put, get with every check,
    write_blocks). ok: False if the store refused (no room) or a block did
    not come back."""

    def __init__(self, engine, disk, ids: list[int]) -> None:
        self.runner, self.disk, self.ids = engine.runner, disk, ids
        ns = digest("trajserve-calibrate")
        self.idents = [BlockIdentity(ns, digest(f"block-{i}")) for i in range(len(ids))]
        self.nbytes = 2 * len(ids) * engine.block_layout.payload_bytes
        self.ok = True

    def __call__(self) -> None:
        keys = [f"calibrate-{i}" for i in range(len(self.ids))]
        try:
            for key, b, ident in zip(keys, self.ids, self.idents):
                self.ok = self.ok and self.disk.put(key, self.runner.read_blocks([b])[0], ident)
            for key, b, ident in zip(keys, self.ids, self.idents):
                got = self.disk.get(key, ident) if self.ok else None
                self.ok = got is not None
                if self.ok:
                    self.runner.write_blocks([b], got.unsqueeze(0))
        finally:
            for key in keys:
                self.disk.discard(key)


def _plausible(name: str, rate: float, ref: float, remeasure, notes: list[str]) -> float:
    lo, hi = ref / PLAUSIBLE, ref * PLAUSIBLE
    if lo <= rate <= hi:
        return rate
    again = remeasure()
    if again is not None and lo <= again <= hi:
        notes.append(f"{name} remeasured ({rate / 1e9:.2f} -> {again / 1e9:.2f} GB/s)")
        return again
    clamped = min(max(again if again is not None else rate, lo), hi)
    notes.append(f"{name} {rate / 1e9:.2f} GB/s is over {PLAUSIBLE:g}x off memcpy: "
                 f"clamped to {clamped / 1e9:.2f}")
    return clamped


def _host_and_disk(engine, disk, ids, n, block_bytes, host_job, ref, rates: CostRates, found: dict,
                   notes: list[str]) -> None:
    """B_host and B_disk timed in turns (so neither sees a quieter machine)."""
    trip = _DiskTrip(engine, disk, ids[:max(1, min(n, -(-DISK_BYTES // block_bytes)))])
    found["disk_bytes"] = trip.nbytes
    host, d = _median_rates([host_job, (trip, trip.nbytes)])
    found["host_measured_bytes_per_s"], found["disk_measured_bytes_per_s"] = host, d
    host = _plausible("host copy", host, ref, lambda: _median_rate(*host_job), notes)
    rates.host_bytes_per_s = host
    if trip.ok:
        d = _plausible("disk", d, ref, lambda: _median_rate(trip, trip.nbytes), notes)
    if not trip.ok:
        notes.append("disk round trip failed: default disk rate kept")
    else:
        if d > host:
            notes.append(f"disk {d / 1e9:.2f} GB/s above the host copy: capped at it")
            d = host
        rates.disk_bytes_per_s = d


def random_tokens(engine, n: int, generator: torch.Generator) -> list[int]:
    """n token ids away from the vocabulary's special ends, for timing runs."""
    return torch.randint(100, engine.model_config.vocab_size - 100, (n,), generator=generator).tolist()


def run_private(engine, requests: list[tuple[list[int], SamplingParams]], salt: str, drop: bool = True) -> list:
    """Run these requests to the end on an idle engine, in a cache namespace
    of their own that is dropped whole afterwards (drop False: the caller
    drops it, after later runs that reuse it): no one else's state is
    touched. Their final outputs, in order."""
    if engine.has_unfinished_requests():
        raise RuntimeError("a calibration run needs an idle engine")
    ids = [engine.add_request(toks, params, cache_salt=salt) for toks, params in requests]
    done = {}
    while len(done) < len(ids):
        done.update((o.request_id, o) for o in engine.step() if o.finished)
    if drop:
        engine.invalidate(cache_salt=salt)
    return [done[i] for i in ids]


def calibrate_rates(engine, rates: CostRates, disk, prefill_tokens: int = 256) -> dict:
    """Measure B_host (device -> host block copy), B_disk (write + read back)
    and R_prefill on this engine, now, into `rates`. disk: a DiskKVStore whose
    owner holds its lock (None: no disk tier, the host copy only). The engine must be idle; the blocks it borrows go
    back to the pool, the prefill's cache entries are dropped."""
    kv = engine.kv
    block_bytes = engine.block_layout.payload_bytes
    notes: list[str] = []
    found = {"block_bytes": block_bytes}
    with kv.borrowed(max(1, -(-CHUNK_BYTES // block_bytes))) as ids:
        n = len(ids)
        if n:
            reps = max(1, -(-COPY_BYTES // (n * block_bytes)))
            found["host_copy_bytes"] = n * block_bytes * reps
            ref = memcpy_rate(n * block_bytes)
            found["memcpy_bytes_per_s"] = ref
            host_job = _host_job(engine, ids, reps)
            # Blocks the trip may write: a tier full of blocks kept from earlier runs has no room for one.
            room = 0 if disk is None else disk.free_bytes // engine.block_layout.file_bytes
            if room < 1:  # the host copy alone
                host = _median_rates([host_job])[0]
                found["host_measured_bytes_per_s"] = host
                rates.host_bytes_per_s = _plausible("host copy", host, ref, lambda: _median_rate(*host_job), notes)
                notes.append("no disk tier: default disk rate kept" if disk is None else
                             "the disk tier is full (blocks kept from earlier runs): default disk rate kept")
            else:
                _host_and_disk(engine, disk, ids, min(n, room), block_bytes, host_job, ref, rates, found, notes)
    # Half the pool at most, so a small pool still runs it.
    prefill_tokens = min(prefill_tokens, kv.token_capacity // 2, engine.max_model_len - 1)
    if prefill_tokens and not engine.has_unfinished_requests():  # stepping must not advance anyone else
        toks = random_tokens(engine, prefill_tokens, torch.Generator().manual_seed(0))
        out, = run_private(engine, [(toks, SamplingParams(max_tokens=1, temperature=0))], "trajserve-calibrate")
        if out.metrics.ttft:
            rates.prefill_tokens_per_s = prefill_tokens / out.metrics.ttft
    result = {"host_bytes_per_s": rates.host_bytes_per_s, "disk_bytes_per_s": rates.disk_bytes_per_s,
              "prefill_tokens_per_s": rates.prefill_tokens_per_s, **found, "notes": notes}
    log.info("calibration: memcpy %.2f GB/s, host copy %.2f GB/s over %d MiB, disk %.2f GB/s over %d MiB, "
             "prefill %.0f tok/s%s", found.get("memcpy_bytes_per_s", 0) / 1e9, rates.host_bytes_per_s / 1e9,
             found.get("host_copy_bytes", 0) >> 20, rates.disk_bytes_per_s / 1e9, found.get("disk_bytes", 0) >> 20,
             rates.prefill_tokens_per_s, f"; {'; '.join(notes)}" if notes else "; checks passed")
    return result
