"""`trajserve bench programs --simulate PROFILE|fit`: the same programs
through the simulator, beside what the engine measured.

The simulator runs the engine's own scheduler and KV manager over a cost
model calibrated on this machine: a `trajserve calibrate` profile, or
(`fit`) the same fit made to the steps the engine took in the FCFS run, so
each policy's order, preemptions and prefix hits are the engine's; only
the step times are predicted (for the other policies, by a fit they did
not feed). With several rounds each round's FCFS run gives its own fit,
each fit predicts every policy, and the prediction is the median over the
rounds, as the measured figure is: one round the machine runs slow moves
neither median, where one fit to every round's steps would carry the slow
round's share into every prediction. Each program is a simulator session:
its first call at the program's arrival, each later call its tool result appended to the
history, `wait` seconds after the previous call ended, the replies the
engine produced replayed (the same tokens, so the same cache hits). Per
policy and class: predicted over measured p50 and p99 of the programs'
end-to-end time, and whether the policies come out in the same order.
"""
from __future__ import annotations

import dataclasses
import math
import statistics

from trajserve.sim.build import SimSetup
from trajserve.sim.hardware import Hardware, ModelCost, load_profile
from trajserve.sim.workload import Call, Session, fixed

P50_TOLERANCE = 0.15  # the agreement asked of the simulator on p50
TIE = 0.05  # policies the simulator puts within this of each other are not ordered by it


def sessions_for(workload, replies: dict[str, list[list[int]]], short_priority: int = 0) -> list[Session]:
    out = []
    for p in workload:
        got = replies[p.name]
        prio = short_priority if p.kind == "short" else 0
        calls = [Call(fixed(lambda ids=p.first: list(ids)), len(got[0]), arrival=p.arrival, output_ids=got[0],
                      priority=prio)]
        for k, (obs, wait) in enumerate(p.turns, start=1):
            calls.append(Call(lambda history, obs=obs: history + list(obs), len(got[k]), wait=wait,
                              output_ids=got[k], turn=k, priority=prio))
        out.append(Session(p.name, calls))
    return out


def simulate_policy(cfg, profile: dict, num_blocks: int, workload, replies, policy: str,
                    short_priority: int = 0) -> dict:
    setup = SimSetup(hw=Hardware.from_profile(profile), model=ModelCost.from_profile(profile), num_blocks=num_blocks,
                     block_size=cfg.cache.block_size, scheduler=dataclasses.replace(cfg.scheduler, scheduling=policy),
                     pool_source="the measured engine's pool")
    sim, _ = setup.simulator()
    res = sim.run(sessions_for(workload, replies, short_priority))
    r = res.records
    end: dict[str, float] = {}
    computed: dict[str, int] = {}
    for i, name in enumerate(r.name):
        program = name.rsplit("#", 1)[0]
        end[program] = max(end.get(program, 0.0), r.finish[i])
        computed[program] = computed.get(program, 0) + r.prompt_tokens[i] - r.cached_tokens[i] + r.output_tokens[i]
    out = {}
    for kind in ("short", "long"):
        e2e = sorted(end[p.name] - p.arrival for p in workload if p.kind == kind and p.name in end) or [math.nan]
        out[kind] = {"p50_s": statistics.median(e2e),
                     "p99_s": e2e[min(len(e2e) - 1, max(0, round(0.99 * (len(e2e) - 1))))]}
    longs = [p for p in workload if p.kind == "long" and p.name in end]
    span = max(end[p.name] for p in longs) - min(p.arrival for p in longs) if longs else math.nan
    out["long"]["tokens_per_s"] = sum(computed[p.name] for p in longs) / span if longs else math.nan
    return out


def profile_of_run(engine, steps) -> dict:
    """A hardware profile fitted to the steps a run took (bench/calibrate.py's
    fit, each kind of step, prefill or decode, weighing one in all)."""
    from trajserve.bench.calibrate import copy_bandwidth, disk_bandwidth, profile_from_steps
    from trajserve.bench.common import read_bandwidth

    return profile_from_steps(engine, steps, read_bandwidth(engine.device, 256 * 2**20), copy_bandwidth(64),
                              disk_bandwidth(16), [s.kind for s in steps], "bench programs' FCFS run", 0.0)


def compare(cfg, profile_path: str, workload, measured: dict[str, dict], short_priority: int = 0) -> dict:
    """measured: policy -> its rounds as one (programs.py's _median_run:
    replies, per-class figures, and for FCFS under fit one fitted profile a
    round). profile_path "fit": the median of those profiles' predictions.
    short_priority: the short programs' calls' priority, as the engine ran them."""
    if profile_path == "fit":
        if "fcfs" not in measured:
            raise ValueError("--simulate fit fits the simulator to the FCFS runs' steps: run --policies with fcfs")
        profiles = measured["fcfs"]["profiles"]
    else:
        profiles = [load_profile(profile_path)]
    predicted = {}
    for policy, m in measured.items():
        each = [simulate_policy(cfg, profile, m["num_blocks"], workload, m["replies"], policy, short_priority)
                for profile in profiles]
        predicted[policy] = {kind: {k: statistics.median(p[kind][k] for p in each) for k in each[0][kind]}
                             for kind in each[0]}
    rows = {}
    for policy in measured:
        rows[policy] = {f"{kind}_{q}_ratio": predicted[policy][kind][f"{q}_s"] / measured[policy][kind][f"{q}_s"]
                        for kind in ("short", "long") for q in ("p50", "p99")}

    def agree(kind: str, q: str) -> dict:
        """Pairs of policies the simulator tells apart (more than TIE), and
        how many of them the engine ordered the same way. Policies that run
        the same order on this workload (priority is FCFS when no request
        names one) tie in the simulator, whose clock has no noise."""
        key = f"{q}_s"
        pairs = same = 0
        names = list(measured)
        for i, a in enumerate(names):
            for b in names[i + 1:]:
                pa, pb = predicted[a][kind][key], predicted[b][kind][key]
                if abs(pa - pb) <= TIE * max(pa, pb):
                    continue
                pairs += 1
                same += (pa < pb) == (measured[a][kind][key] < measured[b][kind][key])
        return {"pairs": pairs, "same": same}

    same_order = {f"{kind}_{q}": agree(kind, q) for kind in ("short", "long") for q in ("p50", "p99")}
    p50_within = all(abs(r[f"{kind}_p50_ratio"] - 1) <= P50_TOLERANCE
                     for r in rows.values() for kind in ("short", "long"))
    return {"profile": profile_path, "profiles": len(profiles), "predicted": predicted, "ratios": rows,
            "same_order": same_order, "p50_within_tolerance": p50_within, "tolerance": P50_TOLERANCE}


def print_comparison(cmp: dict, measured: dict) -> None:
    if cmp["profile"] != "fit":
        source = f"profile {cmp['profile']}"
    elif cmp["profiles"] == 1:
        source = "profile fitted to the FCFS run's steps"
    else:
        source = f"a profile fitted to each round's FCFS run's steps, medians of the {cmp['profiles']} predictions"
    print(f"\nsimulator ({source}) beside the engine: predicted / measured")
    print(f"{'policy':<9} {'short p50':>16} {'short p99':>16} {'long p50':>16} {'long p99':>16}")
    for policy, ratios in cmp["ratios"].items():
        cells = []
        for kind in ("short", "long"):
            for q in ("p50", "p99"):
                cells.append(f"{cmp['predicted'][policy][kind][f'{q}_s']:.2f}/{measured[policy][kind][f'{q}_s']:.2f}s"
                             f" {ratios[f'{kind}_{q}_ratio']:.2f}")
        print(f"{policy:<9} " + " ".join(f"{c:>16}" for c in cells))
    agree = ", ".join(f"{k} {v['same']} of {v['pairs']}" for k, v in cmp["same_order"].items())
    print(f"pairs of policies the simulator tells apart, ordered the same by the engine: {agree}")
    print(f"every p50 within {cmp['tolerance']:.0%}: {cmp['p50_within_tolerance']}")
