"""`trajserve bench programs` on the embedded model, a small workload:
every policy runs it, the replies match across policies, the report says
each class's latencies and the long programs' throughput beside FCFS's."""
from __future__ import annotations

import contextlib
import io
import json

from trajserve.cli import main


def test_bench_programs_runs_every_policy_on_the_same_workload():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "programs", "--long", "2", "--long-calls", "3", "--short", "3", "--short-calls", "2",
                   "--reply-tokens", "4", "--arrival-window-s", "0.5", "--wait-scale", "0.001",
                   "--preamble-tokens", "100", "--kv-cache-memory", "256MiB", "--json"])
    assert rc == 0
    report = json.loads(out.getvalue())
    assert report["same_replies"] is True
    assert set(report["policies"]) == {"fcfs", "priority", "program"}
    for name, p in report["policies"].items():
        assert p["short"]["programs"] == 3 and p["long"]["programs"] == 2
        assert 0 < p["short"]["p50_s"] <= p["short"]["p99_s"] and p["long"]["tokens_per_s"] > 0
        assert p["short_p99_over_fcfs"] > 0
    assert report["policies"]["fcfs"]["long_throughput_over_fcfs"] == 1.0
    assert set(report["targets"]) == {"short_p99_over_fcfs", "long_throughput_over_fcfs"}


def test_bench_programs_counts_calls_refused_late_and_on_time_against_a_deadline():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "programs", "--long", "2", "--long-calls", "4", "--short", "4", "--short-calls", "2",
                   "--reply-tokens", "8", "--arrival-window-s", "4.0", "--wait-scale", "0.001",
                   "--preamble-tokens", "100", "--kv-cache-memory", "256MiB", "--policies", "program",
                   "--call-deadline-s", "0.0001", "--json"])
    assert rc == 0
    report = json.loads(out.getvalue())
    d = report["policies"]["program"]["deadline"]
    assert report["workload"]["deadline_admission"] == "refuse"
    # 0.1 ms a call: no call can meet it; what the fitted model sees is refused, the rest is admitted and late.
    assert d["on_time"] == 0 and d["admitted_late"] == d["calls_admitted"]
    assert d["calls_refused"] + d["calls_admitted"] >= 4  # every short program sent its first call
    assert d["calls_refused"] > 0  # the long programs' steps fit the model before the last short arrivals
