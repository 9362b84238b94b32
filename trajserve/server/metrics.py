"""Prometheus metrics for `trajserve serve`: latency histograms observed as
requests finish (on the engine thread; prometheus_client is thread-safe),
and engine gauges read at scrape time from the engine's latest snapshot."""
from __future__ import annotations

from collections.abc import Callable, Iterator

from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from trajserve.outputs import RequestOutput
from trajserve.server import log_guard
from trajserve.server.goodput import OUTCOMES, SLO, WINDOW_S, Goodput

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 20.0, 40.0, 80.0, 160.0)
BREAK_BUCKETS = (16, 64, 256, 1024, 4096, 16384, 65536)  # token positions

# snapshot key -> (metric name, help, kind)
GAUGES = {
    "U_KV": ("trajserve_kv_usage_ratio", "U_KV = allocated / total KV blocks (eq. 8)", "gauge"),
    "H_prefix": ("trajserve_prefix_hit_ratio", "H_prefix = cached / prompt tokens since start (eq. 2)", "gauge"),
    "num_blocks": ("trajserve_kv_blocks", "KV blocks in the device pool", "gauge"),
    "free_blocks": ("trajserve_kv_free_blocks", "KV blocks on the free list", "gauge"),
    "cached_blocks": ("trajserve_kv_cached_blocks", "KV blocks held by the radix prefix cache", "gauge"),
    "running": ("trajserve_num_requests_running", "sequences in the running batch", "gauge"),
    "waiting": ("trajserve_num_requests_waiting", "sequences in the admission queue", "gauge"),
    "evicted_blocks": ("trajserve_kv_evicted_blocks", "blocks evicted from the prefix cache", "counter"),
    "preemptions": ("trajserve_preemptions", "sequences preempted (swapped or recomputed)", "counter"),
    "swap_preemptions": ("trajserve_swap_preemptions",
                         "preemptions that swapped their blocks to the host tier (break-even)", "counter"),
    "cow_copies": ("trajserve_kv_cow_copies", "copy-on-write block copies", "counter"),
    "U_KV_active": ("trajserve_kv_active_usage_ratio",
                    "blocks held by requests and pinned paused state / total (admission watches this)", "gauge"),
    "admission_ceiling": ("trajserve_kv_admission_ceiling", "tau_high: above it new requests wait", "gauge"),
    "ceiling_waits": ("trajserve_admission_ceiling_waits", "steps the queue head waited for the ceiling", "counter"),
    "admission_cap": ("trajserve_admission_cap", "--admission: requests the engine may hold; one more gets 429 "
                      "(absent: no cap)", "gauge"),
    "admission_refusals": ("trajserve_admission_refusals", "requests refused at the --admission cap", "counter"),
    "throttled_forks": ("trajserve_throttled_forks", "fork children queued above the ceiling", "counter"),
    "reclaimed_blocks": ("trajserve_kv_reclaimed_blocks", "blocks paused state gave up under pressure",
                         "counter"),
    "spilled_blocks": ("trajserve_prefix_cache_spilled_blocks",
                       "blocks LRU eviction moved to the prefix cache's lower tiers", "counter"),
    "promoted_blocks": ("trajserve_prefix_cache_promoted_blocks",
                        "blocks a match loaded back from the prefix cache's lower tiers", "counter"),
    "window_recomputed_tokens": ("trajserve_prefix_cache_window_recomputed_tokens",
                                 "prefix-hit tokens recomputed because a window layer's part of a block was gone",
                                 "counter"),
}


class _SnapshotCollector(Collector):
    def __init__(self, snapshot: Callable[[], dict], bytes_per_block: int) -> None:
        self._snapshot = snapshot
        self._bytes_per_block = bytes_per_block

    def collect(self) -> Iterator:
        snap = self._snapshot()
        for key, (name, doc, kind) in GAUGES.items():
            if snap.get(key) is None:
                continue
            fam = (GaugeMetricFamily if kind == "gauge" else CounterMetricFamily)(name, doc)
            fam.add_metric([], float(snap[key]))
            yield fam
        tier = GaugeMetricFamily("trajserve_kv_tier_bytes", "KV bytes in use per tier", labels=["tier"])
        used = snap.get("num_blocks", 0) - snap.get("free_blocks", 0)
        tier.add_metric(["device"], float(used * self._bytes_per_block))
        sess = snap.get("sessions")
        if sess is not None:
            tier.add_metric(["host"], float(sess["host_bytes"]))
            tier.add_metric(["disk"], float(sess["disk_bytes"]))
        yield tier
        low = snap.get("lower_tiers")
        if low is not None:
            fam = GaugeMetricFamily("trajserve_prefix_cache_tier_bytes",
                                    "bytes the prefix cache holds below the device, per tier", labels=["tier"])
            fam.add_metric(["host"], float(low["host_bytes"]))
            fam.add_metric(["disk"], float(low["disk_bytes"]))
            yield fam
            for key, name, doc in (
                    ("corrupt_blocks", "trajserve_prefix_cache_corrupt_blocks",
                     "prefix-cache disk blocks rejected on the way back, damaged or mislabelled (recomputed)"),
                    ("mislabelled_blocks", "trajserve_prefix_cache_mislabelled_blocks",
                     "sound blocks refused for their identity: files of another block, model or layout, and blocks "
                     "asked for under a scope (salt, adapter) they were not stored in"),
                    ("write_errors", "trajserve_prefix_cache_write_errors",
                     "prefix-cache disk writes that failed (the block is recomputed when needed)")):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(low[key]))
                yield c
            g = GaugeMetricFamily("trajserve_prefix_cache_restored_blocks",
                                  "disk blocks of earlier runs adopted at start-up (--kv-disk-dir)")
            g.add_metric([], float(low["restored_blocks"]))
            yield g
        spec = snap.get("speculative")
        if spec is not None:
            for key, name, doc in (
                    ("drafts", "trajserve_spec_decode_drafts", "sequence-steps that verified a draft"),
                    ("draft_tokens", "trajserve_spec_decode_draft_tokens", "draft tokens verified"),
                    ("accepted_tokens", "trajserve_spec_decode_accepted_tokens", "draft tokens accepted")):
                c = CounterMetricFamily(name, doc)
                c.add_metric([], float(spec[key]))
                yield c
            for key, name, doc in (
                    ("acceptance_rate", "trajserve_spec_decode_acceptance_ratio", "accepted / draft tokens"),
                    ("mean_accepted_length", "trajserve_spec_decode_mean_accepted_length",
                     "tokens a verified round outputs on average (its accepted drafts + the target's own)")):
                if spec[key] is not None:
                    g = GaugeMetricFamily(name, doc)
                    g.add_metric([], float(spec[key]))
                    yield g
        lora = snap.get("lora")
        if lora is not None:  # per adapter (names match config.LORA_NAME: safe as label values)
            for key, name, doc in (
                    ("requests", "trajserve_lora_requests", "requests queued per LoRA adapter"),
                    ("prompt_tokens", "trajserve_lora_prompt_tokens", "prompt tokens per LoRA adapter"),
                    ("cached_tokens", "trajserve_lora_cached_prompt_tokens",
                     "prompt tokens of finished requests served from the prefix cache, per LoRA adapter"),
                    ("generation_tokens", "trajserve_lora_generation_tokens",
                     "tokens generated by finished requests, per LoRA adapter")):
                c = CounterMetricFamily(name, doc, labels=["adapter"])
                for adapter, counts in lora["adapters"].items():
                    c.add_metric([adapter], float(counts[key]))
                yield c
            g = GaugeMetricFamily("trajserve_lora_adapters", "LoRA adapters loaded and resident in slots",
                                  labels=["state"])
            g.add_metric(["loaded"], float(len(lora["loaded"])))
            g.add_metric(["resident"], float(len(lora["resident"])))
            yield g
            c = CounterMetricFamily("trajserve_lora_slot_loads", "adapters copied into a slot (loaded on demand)")
            c.add_metric([], float(lora["slot_loads"]))
            yield c
        if sess is None:
            return
        keep = CounterMetricFamily("trajserve_keep_decisions", "tool-pause decisions by kind", labels=["decision"])
        for kind in ("keep", "host", "disk", "drop"):
            keep.add_metric([kind], float(sess["keep_decisions"].get(kind, 0)))
        yield keep
        moved = CounterMetricFamily("trajserve_keep_demotions", "kept paused states moved down a tier (a lease ran "
                                    "out, or pressure), by where they went", labels=["to"])
        for kind in ("host", "disk", "drop"):
            moved.add_metric([kind], float(sess["demoted_to"].get(kind, 0)))
        yield moved
        for key, name, doc in (("swap_out_bytes", "trajserve_kv_swap_out_bytes", "bytes copied to host / disk"),
                               ("swap_in_bytes", "trajserve_kv_swap_in_bytes", "bytes reloaded to the device"),
                               ("corrupt_blocks", "trajserve_kv_corrupt_blocks",
                                "saved disk blocks rejected: damaged, or not the block saved"),
                               ("mislabelled_blocks", "trajserve_kv_mislabelled_blocks",
                                "saved blocks refused because they belong to another scope (salt, adapter), "
                                "block, model or layout"),
                               ("write_errors", "trajserve_kv_write_errors",
                                "session disk writes that failed (the state is recomputed on resume)"),
                               ("lease_demotions", "trajserve_keep_lease_demotions", "kept states moved down"),
                               ("pressure_demotions", "trajserve_keep_pressure_demotions",
                                "kept states moved down to make room for running work"),
                               ("stall_drops", "trajserve_keep_stall_drops",
                                "forced-kept states dropped because nothing could run"),
                               ("prefetches", "trajserve_kv_prefetches", "offloaded states loaded back early"),
                               ("prefetch_hits", "trajserve_kv_prefetch_hits",
                                "resumes that found their state prefetched"),
                               ("resume_stalls", "trajserve_kv_resume_stalls",
                                "resumes that waited for a reload"),
                               ("resume_stall_s", "trajserve_kv_resume_stall_seconds", "time resumes waited"),
                               ("reload_hidden_s", "trajserve_kv_reload_hidden_seconds",
                                "reload copy time hidden behind the resumed turn's prefill"),
                               ("swap_out_s", "trajserve_kv_swap_out_seconds", "time copying state out"),
                               ("swap_in_s", "trajserve_kv_swap_in_seconds", "time copying state back")):
            c = CounterMetricFamily(name, doc)
            c.add_metric([], float(sess[key]))
            yield c
        blocks = GaugeMetricFamily("trajserve_kv_tier_blocks", "KV blocks saved per lower tier", labels=["tier"])
        blocks.add_metric(["host"], float(sess["host_blocks"]))
        blocks.add_metric(["disk"], float(sess["disk_blocks"]))
        yield blocks
        expired = CounterMetricFamily("trajserve_sessions_expired", "sessions the server closed: idle past "
                                      "--session-ttl, or the least recently active over --max-sessions",
                                      labels=["reason"])
        for why, count in sess["expired"].items():
            expired.add_metric([why], float(count))
        yield expired
        for key, name, doc in (("sessions", "trajserve_sessions", "open agent sessions"),
                               ("paused", "trajserve_sessions_paused", "sessions waiting for a tool")):
            g = GaugeMetricFamily(name, doc)
            g.add_metric([], float(sess[key]))
            yield g


class LogCollector(Collector):
    """The log guard's counts (server/log_guard.py): lines written, repeats
    held back by the rate limit, lines lost to a slow or failing log."""

    def collect(self) -> Iterator:
        c = log_guard.counts()
        if c is None:
            return
        for name, doc, value in (
                ("trajserve_log_lines", "log lines written to stderr", c.lines),
                ("trajserve_log_lines_suppressed", "repeated log lines held back by the rate limit", c.suppressed),
                ("trajserve_log_lines_dropped", "log lines lost because stderr was too slow (its pipe full) or "
                                                "failed (a full disk); serving went on", c.dropped)):
            fam = CounterMetricFamily(name, doc)
            fam.add_metric([], float(value))
            yield fam


class _GoodputCollector:
    def __init__(self, goodput: Goodput) -> None:
        self.goodput = goodput

    def collect(self) -> Iterator:
        fam = GaugeMetricFamily("trajserve_goodput_requests_per_second",
                                f"R_good: finished requests on time over the last {WINDOW_S:g} s, per second (8.6.2)")
        fam.add_metric([], self.goodput.rate())
        yield fam


class ServerMetrics:
    def __init__(self, snapshot: Callable[[], dict], bytes_per_block: int, slo: SLO = SLO()) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.goodput = Goodput(slo)
        self.slo_requests = Counter("trajserve_slo_requests", "finished requests by outcome against the SLO and "
                                    "their own deadline: " + ", ".join(OUTCOMES) + " (server/goodput.py)",
                                    ["outcome"], registry=r)
        self.deadline_refusals = Counter("trajserve_deadline_refusals", "requests refused before queuing as "
                                         "predicted to miss their deadline (--deadline-admission), by HTTP status: "
                                         "429 the load, 503 the request itself", ["code"], registry=r)
        self.ttft = Histogram("trajserve_time_to_first_token_seconds", "TTFT", buckets=LATENCY_BUCKETS, registry=r)
        self.itl = Histogram("trajserve_inter_token_latency_seconds", "time between output tokens",
                             buckets=LATENCY_BUCKETS, registry=r)
        self.e2e = Histogram("trajserve_e2e_request_latency_seconds", "arrival to finish",
                             buckets=LATENCY_BUCKETS, registry=r)
        # One per choice (as vLLM counts n > 1), "abort" and "error" included.
        self.requests = Counter("trajserve_requests", "finished sequences (choices) by finish reason",
                                ["finish_reason"], registry=r)
        self.prompt_tokens = Counter("trajserve_prompt_tokens", "prompt tokens of finished requests", registry=r)
        self.cached_tokens = Counter("trajserve_cached_prompt_tokens", "prompt tokens served from the prefix cache",
                                     registry=r)
        self.generation_tokens = Counter("trajserve_generation_tokens", "generated tokens", registry=r)
        # Where conversations' prompts left their previous context, and what it cost (server/prefix_break.py).
        self.break_position = Histogram("trajserve_prefix_break_position_tokens",
                                        "where a turn's prompt first differs from its session's previous context",
                                        buckets=BREAK_BUCKETS, registry=r)
        self.breaks = Counter("trajserve_prefix_breaks", "turns whose prompt broke the session's prefix, by cause",
                              ["cause"], registry=r)
        self.break_lost = Counter("trajserve_prefix_break_lost_tokens",
                                  "tokens prefilled again because a turn's prompt broke the prefix, by cause",
                                  ["cause"], registry=r)
        self.hints = Counter("trajserve_hints", "other engines' hints read (server/hints.py), by envelope, hint "
                             "and outcome: applied, not_applied, no_session, unknown", ["source", "hint", "outcome"],
                             registry=r)
        # Every answer, errors from the outer middleware (401, 413, 431) included: a client
        # refused or failed shows here even when nothing is logged. The code is HTTP's, a bounded set.
        self.http_responses = Counter("trajserve_http_responses", "HTTP responses by status code", ["code"],
                                      registry=r)
        r.register(_SnapshotCollector(snapshot, bytes_per_block))
        r.register(_GoodputCollector(self.goodput))
        r.register(LogCollector())

    def observe_break(self, b) -> None:
        self.break_position.observe(b.position)
        self.breaks.labels(b.cause).inc()
        self.break_lost.labels(b.cause).inc(b.lost_tokens)

    def observe(self, out: RequestOutput, deadline_s: float | None = None) -> None:
        self.slo_requests.labels(self.goodput.record(out, deadline_s)).inc()
        m = out.metrics
        if m.ttft is not None:
            self.ttft.observe(m.ttft)
        for dt in m.inter_token_times:
            self.itl.observe(dt)
        if m.finished_time is not None:
            self.e2e.observe(m.finished_time - m.arrival_time)
        for c in out.outputs:
            self.requests.labels(c.finish_reason or "unknown").inc()
            self.generation_tokens.inc(len(c.token_ids))
        self.prompt_tokens.inc(len(out.prompt_token_ids))
        self.cached_tokens.inc(out.num_cached_tokens)


class CountResponses:
    """ASGI middleware: counts each HTTP response's status code (the app's outermost layer)."""

    def __init__(self, app, counter: Counter) -> None:
        self.app, self.counter = app, counter

    async def __call__(self, scope, receive, send) -> None:
        if scope["type"] != "http":
            return await self.app(scope, receive, send)

        async def counted(message) -> None:
            if message["type"] == "http.response.start":
                self.counter.labels(str(int(message["status"]))).inc()
            await send(message)
        await self.app(scope, receive, counted)
