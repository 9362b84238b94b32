"""`trajserve bench programs` on the embedded model, a small workload:
every policy runs it, the replies match across policies, the report says
each class's latencies and the long programs' throughput beside FCFS's."""
from __future__ import annotations

import contextlib
import io
import json

from trajserve.cli import main

SMALL = ["--long", "2", "--long-calls", "3", "--short", "3", "--short-calls", "2", "--arrival-window-s", "0.5",
         "--wait-scale", "0.001", "--kv-cache-memory", "256MiB", "--no-alone", "--json"]


def _programs(*flags: str) -> tuple[int, str]:
    """`trajserve bench programs` on the small workload (flags after SMALL win): exit code and stdout."""
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "programs", *SMALL, *flags])
    return rc, out.getvalue()


def test_bench_programs_runs_every_policy_on_the_same_workload():
    rc, out = _programs("--reply-tokens", "4", "--preamble-tokens", "100")
    assert rc == 0
    report = json.loads(out)
    assert report["same_replies"] is True
    assert set(report["policies"]) == {"fcfs", "priority", "program"}
    for name, p in report["policies"].items():
        assert p["short"]["programs"] == 3 and p["long"]["programs"] == 2
        assert 0 < p["short"]["p50_s"] <= p["short"]["p99_s"] and p["long"]["tokens_per_s"] > 0
        assert p["short_p99_over_fcfs"] > 0
    assert report["policies"]["fcfs"]["long_throughput_over_fcfs"] == 1.0
    assert set(report["targets"]) == {"short_p99_over_fcfs", "long_throughput_over_fcfs"}


def test_rounds_alternate_the_policies_and_report_each_figures_median(monkeypatch):
    from trajserve.bench import programs

    ran, real = [], programs.run_policy

    def run_policy(cfg, workload, policy, args):
        ran.append(policy)
        return real(cfg, workload, policy, args)
    monkeypatch.setattr(programs, "run_policy", run_policy)
    rc, out = _programs("--reply-tokens", "4", "--preamble-tokens", "100", "--policies", "fcfs,program",
                        "--rounds", "3")
    assert rc == 0
    # Each round starts at the next policy: none holds the first place.
    assert ran == ["fcfs", "program", "program", "fcfs", "fcfs", "program"]
    report = json.loads(out)
    assert report["rounds"] == 3 and len(report["each_round"]) == 3 and report["same_replies"] is True
    assert [list(r) for r in report["each_round"]] == [["fcfs", "program"], ["program", "fcfs"], ["fcfs", "program"]]
    for policy, p in report["policies"].items():
        p99s = sorted(r[policy]["short_p99_s"] for r in report["each_round"])
        tputs = sorted(r[policy]["long_tokens_per_s"] for r in report["each_round"])
        assert p["short"]["p99_s"] == p99s[1] and p["long"]["tokens_per_s"] == tputs[1]
    fcfs, program = report["policies"]["fcfs"], report["policies"]["program"]
    assert program["short_p99_over_fcfs"] == program["short"]["p99_s"] / fcfs["short"]["p99_s"]
    assert _programs("--rounds", "0")[0] == 2


def test_short_programs_calls_carry_the_priority_asked(monkeypatch):
    from trajserve.engine.engine import LLMEngine

    seen: dict[str, set[int]] = {}
    real = LLMEngine.add_request

    def add(self, *args, **kw):
        seen.setdefault(kw["program"].rstrip("0123456789"), set()).add(kw["priority"])
        return real(self, *args, **kw)
    monkeypatch.setattr(LLMEngine, "add_request", add)
    rc, out = _programs("--reply-tokens", "4", "--preamble-tokens", "100", "--policies", "fcfs,priority",
                        "--short-priority", "-1")
    report = json.loads(out)
    assert rc == 0 and report["workload"]["short_priority"] == -1 and report["same_replies"] is True
    assert seen == {"short": {-1}, "long": {0}}


def test_bench_programs_counts_calls_refused_late_and_on_time_against_a_deadline():
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        rc = main(["bench", "programs", "--long", "2", "--long-calls", "4", "--short", "4", "--short-calls", "2",
                   "--no-alone", "--reply-tokens", "8", "--arrival-window-s", "4.0", "--wait-scale", "0.001",
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


def test_the_simulator_runs_the_same_programs_beside_the_engine(tmp_path):
    """--simulate: each policy's programs through the simulator (the engine's
    scheduler over a cost model) on a profile, the engine's replies replayed;
    predicted / measured per class and the policies' order. The profile here
    is made up (its ratios mean nothing): what is checked is that every
    program ran in the simulator, with the engine's tokens."""
    from test_sim_cli import profile_doc

    prof = tmp_path / "p.json"
    prof.write_text(json.dumps(profile_doc()))
    rc, out = _programs("--reply-tokens", "4", "--preamble-tokens", "100", "--policies", "fcfs,program",
                        "--simulate", str(prof))
    assert rc == 0
    sim = json.loads(out)["simulator"]
    assert set(sim["predicted"]) == {"fcfs", "program"}
    for policy, figures in sim["predicted"].items():
        for kind in ("short", "long"):
            assert 0 < figures[kind]["p50_s"] <= figures[kind]["p99_s"]
            assert sim["ratios"][policy][f"{kind}_p50_ratio"] > 0
        assert figures["long"]["tokens_per_s"] > 0
    for v in sim["same_order"].values():
        assert 0 <= v["same"] <= v["pairs"] <= 1


def test_the_simulator_fitted_to_the_fcfs_runs_steps(monkeypatch):
    """--simulate fit: the cost model is fitted to the FCFS run's own steps
    (their shapes and times) and predicts the other policies' runs; with
    rounds, each round's FCFS run gives a profile, each profile predicts
    every policy, and the prediction is their median."""
    from trajserve.bench import programs_sim

    fitted, real_fit = [], programs_sim.profile_of_run
    runs, real_sim = [], programs_sim.simulate_policy

    def profile_of_run(engine, steps):
        fitted.append(real_fit(engine, steps))
        return fitted[-1]

    def simulate_policy(cfg, profile, *args):
        runs.append((args[-2], fitted.index(profile), real_sim(cfg, profile, *args)))
        return runs[-1][2]
    monkeypatch.setattr(programs_sim, "profile_of_run", profile_of_run)
    monkeypatch.setattr(programs_sim, "simulate_policy", simulate_policy)
    rc, out = _programs("--reply-tokens", "8", "--preamble-tokens", "300", "--policies", "fcfs,program",
                        "--simulate", "fit", "--rounds", "2")
    assert rc == 0
    report = json.loads(out)
    sim = report["simulator"]
    assert sim["profile"] == "fit" and sim["profiles"] == 2 and len(fitted) == 2
    assert [(policy, k) for policy, k, _ in runs] == [("fcfs", 0), ("fcfs", 1), ("program", 0), ("program", 1)]
    for policy in ("fcfs", "program"):
        a, b = (r for p, _, r in runs if p == policy)
        for kind in ("short", "long"):
            assert sim["predicted"][policy][kind]["p50_s"] == (a[kind]["p50_s"] + b[kind]["p50_s"]) / 2
    for policy in ("fcfs", "program"):
        for kind in ("short", "long"):
            # Fitted to this machine's steps: the right order of magnitude at least (a made-up profile is not).
            assert 0.3 < sim["ratios"][policy][f"{kind}_p50_ratio"] < 3
    err = io.StringIO()
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(err):
        rc = main(["bench", "programs", "--long", "1", "--long-calls", "2", "--short", "1", "--short-calls", "2",
                   "--no-alone", "--reply-tokens", "2", "--arrival-window-s", "0.1", "--wait-scale", "0.001",
                   "--preamble-tokens", "50", "--kv-cache-memory", "256MiB", "--policies", "program",
                   "--simulate", "fit", "--json"])
    assert rc != 0 and "run --policies with fcfs" in err.getvalue()


def test_a_program_is_a_session_that_replays_the_engines_calls():
    from trajserve.bench.programs import Program
    from trajserve.bench.programs_sim import sessions_for

    p = Program("long0", "long", 0.3, [1, 2, 3], [([7, 8], 0.5), ([9], 0.25)])
    (s,) = sessions_for([p], {"long0": [[4], [5, 6], [10]]})
    first, second, third = s.calls
    assert first.arrival == 0.3 and first.prompt([]) == [1, 2, 3] and first.output_ids == [4]
    history = [1, 2, 3, 4]  # what the simulator hands the next call: the prompt and its outputs
    assert second.wait == 0.5 and second.prompt(history) == [1, 2, 3, 4, 7, 8] and second.output_len == 2
    assert third.prompt([1, 2, 3, 4, 7, 8, 5, 6]) == [1, 2, 3, 4, 7, 8, 5, 6, 9] and third.wait == 0.25
    short = Program("short4", "short", 1.0, [1, 2], [([3], 0.1)])
    marked = sessions_for([p, short], {"long0": [[4], [5, 6], [10]], "short4": [[5], [6]]}, short_priority=-1)
    assert [[c.priority for c in s.calls] for s in marked] == [[0, 0, 0], [-1, -1]]  # as the engine's calls


def test_alone_is_each_short_programs_calls_in_turn_plus_its_tool_waits(monkeypatch):
    """The floor: every short program run by itself, its waits added unslept;
    its p99 over FCFS's is what no policy can go below on the load."""
    from trajserve.bench import programs

    floors = {}
    real = programs.alone

    def alone(cfg, workload, args):
        floors.update(real(cfg, workload, args))
        waits.update({p.name: sum(w for _, w in p.turns) for p in workload if p.kind == "short"})
        return floors
    waits: dict[str, float] = {}
    monkeypatch.setattr(programs, "alone", alone)
    rc, out = _programs("--reply-tokens", "4", "--preamble-tokens", "100", "--policies", "fcfs",
                        "--wait-scale", "0.05", "--alone")
    assert rc == 0
    report = json.loads(out)
    assert set(floors) == set(waits) and len(floors) == 3
    # Each floor is its tool waits plus its calls' time (two calls of 4 tokens: some milliseconds, not seconds).
    assert all(waits[n] < floors[n] < waits[n] + 5.0 for n in floors)
    assert report["alone"]["short"]["p99_s"] == max(floors.values())
    assert report["alone"]["short"]["p50_s"] == sorted(floors.values())[1]
    fcfs = report["policies"]["fcfs"]["short"]["p99_s"]
    assert report["alone"]["short_p99_over_fcfs"] == report["alone"]["short"]["p99_s"] / fcfs
    assert "alone" not in json.loads(_programs("--reply-tokens", "4", "--preamble-tokens", "100", "--policies",
                                               "fcfs")[1])
