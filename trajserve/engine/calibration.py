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
- the disk is never faster than the host copy that feeds it (a write ends in
  the page cache, which is memory): a disk rate above the host rate is
  capped at it.

What was found, and any correction, is logged in one line.
"""
from __future__ import annotations

import logging
import statistics
import time

import torch

from trajserve.kv.block_format import BlockIdentity, digest
from trajserve.kv.keep_policy import CostRates
from trajserve.sampling import SamplingParams

log = logging.getLogger("trajserve")

COPY_BYTES = 64 << 20
DISK_BYTES = 16 << 20
CHUNK_BYTES = 16 << 20  # blocks borrowed from the pool for one copy (fewer if it holds fewer)
REPEATS = 3
PLAUSIBLE = 10.0


def _median_rate(fn, nbytes: int, repeats: int = REPEATS) -> float:
    fn()  # warm-up: first touch of the pages and the allocator
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t)
    dt = statistics.median(times)
    return nbytes / dt if dt > 0 else float("inf")


def memcpy_rate(nbytes: int) -> float:
    src = torch.empty(max(1, nbytes), dtype=torch.uint8)
    src.fill_(1)
    dst = torch.empty_like(src)
    return _median_rate(lambda: dst.copy_(src), src.numel())


def _host_rate(engine, ids: list[int], reps: int) -> float:
    read = engine.runner.read_blocks

    def copy():
        for _ in range(reps):
            read(ids)
    return _median_rate(copy, len(ids) * engine.block_layout.payload_bytes * reps)


def _disk_rate(disk, block: torch.Tensor, k: int) -> float | None:
    """Write k blocks and read them back with every check; None if the store
    refused (no room) or a block did not come back."""
    ns = digest("trajserve-calibrate")
    idents = [BlockIdentity(ns, digest(f"block-{i}")) for i in range(k)]
    ok = True

    def roundtrip():
        nonlocal ok
        try:
            ok = ok and all(disk.put(f"calibrate-{i}", block, idents[i]) for i in range(k))
            ok = ok and all(disk.get(f"calibrate-{i}", idents[i]) is not None for i in range(k))
        finally:
            for i in range(k):
                disk.discard(f"calibrate-{i}")
    rate = _median_rate(roundtrip, 2 * k * block.nbytes)
    return rate if ok else None


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


def calibrate_rates(engine, rates: CostRates, disk, prefill_tokens: int = 256) -> dict:
    """Measure B_host (device -> host block copy), B_disk (write + read back)
    and R_prefill on this engine, now, into `rates`. disk: a DiskKVStore whose
    owner holds its lock. The engine must be idle; the blocks it borrows go
    back to the pool, the prefill's cache entries are dropped."""
    kv = engine.kv
    block_bytes = engine.block_layout.payload_bytes
    notes: list[str] = []
    n = min(kv.pool.num_free, max(1, -(-CHUNK_BYTES // block_bytes)))
    found = {"block_bytes": block_bytes}
    if n:
        ids = kv.pool.allocate(n)
        try:
            reps = max(1, -(-COPY_BYTES // (n * block_bytes)))
            found["host_copy_bytes"] = n * block_bytes * reps
            ref = memcpy_rate(n * block_bytes)
            found["memcpy_bytes_per_s"] = ref
            host = _host_rate(engine, ids, reps)
            host = _plausible("host copy", host, ref, lambda: _host_rate(engine, ids, reps), notes)
            rates.host_bytes_per_s = host
            block = engine.runner.read_blocks(ids[:1])[0].clone()
            k = max(1, min(n, -(-DISK_BYTES // block_bytes)))
            found["disk_bytes"] = 2 * k * block_bytes
            d = _disk_rate(disk, block, k)
            if d is not None:
                d = _plausible("disk", d, ref, lambda: _disk_rate(disk, block, k), notes)
                if d > host:
                    notes.append(f"disk {d / 1e9:.2f} GB/s above the host copy: capped at it")
                    d = host
                rates.disk_bytes_per_s = d
            else:
                notes.append("disk round trip failed: default disk rate kept")
        finally:
            kv.pool.free(ids)
    # Half the pool at most, so a small pool still runs it.
    prefill_tokens = min(prefill_tokens, kv.token_capacity // 2, engine.max_model_len - 1)
    if prefill_tokens and not engine.has_unfinished_requests():  # stepping must not advance anyone else
        g = torch.Generator().manual_seed(0)
        toks = torch.randint(100, engine.model_config.vocab_size - 100, (prefill_tokens,), generator=g).tolist()
        # Its own cache namespace, dropped whole afterwards: no one else's state is touched.
        salt = "trajserve-calibrate"
        rid = engine.add_request(toks, SamplingParams(max_tokens=1, temperature=0), cache_salt=salt)
        out = None
        while out is None:
            out = next((o for o in engine.step() if o.request_id == rid and o.finished), None)
        engine.invalidate(cache_salt=salt)
        if out.metrics.ttft:
            rates.prefill_tokens_per_s = prefill_tokens / out.metrics.ttft
    result = {"host_bytes_per_s": rates.host_bytes_per_s, "disk_bytes_per_s": rates.disk_bytes_per_s,
              "prefill_tokens_per_s": rates.prefill_tokens_per_s, **found, "notes": notes}
    log.info("calibration: memcpy %.2f GB/s, host copy %.2f GB/s over %d MiB, disk %.2f GB/s over %d MiB, "
             "prefill %.0f tok/s%s", found.get("memcpy_bytes_per_s", 0) / 1e9, rates.host_bytes_per_s / 1e9,
             found.get("host_copy_bytes", 0) >> 20, rates.disk_bytes_per_s / 1e9, found.get("disk_bytes", 0) >> 20,
             rates.prefill_tokens_per_s, f"; {'; '.join(notes)}" if notes else "; checks passed")
    return result
