"""`trajserve bench programs`: short and long agent programs at once on the
real engine, under each scheduling policy (--scheduling fcfs, priority,
program; engine/scheduler.py).

A program is an agent's line of calls. --long programs of --long-calls calls
start together; --short programs of --short-calls calls arrive spread over
the first --arrival-window-s seconds, while the long ones run. Each call
sends the whole conversation again (its history, the reply, a tool result
of random length) and gets a --reply-tokens greedy reply; between calls the
program waits for its tool: a gap between the main agent's calls in the
Claude Code traces (at most --wait-cap trace seconds) times --wait-scale.
The engine runs at most --max-num-seqs calls at once (4 here), so calls
queue as they do on a loaded server, over a pool of --kv-cache-memory (2 GiB
here, the same for every policy). The same seeded workload runs under
each policy in turn, in one process, each on a fresh engine.

Per policy and class: the program's end-to-end time (its first call's
arrival to its last call's last token), p50 and p99; the long programs'
throughput (the tokens their calls computed, per second of the long
programs' makespan); and, with --alone (the default), each short program's
time with nothing else running, the floor under every policy's short
percentiles. Greedy replies must be the same under every policy
(a policy changes the order calls run in, never a token), for the
programs every policy ran to their end.

--short-priority P gives the short programs' calls priority P (the long
ones' 0; lower runs first under priority and program scheduling).

--call-deadline-s D gives each short program's calls a deadline of D
seconds from when the call is sent (engine/deadline.py prices it under
--deadline-admission): a refused call ends its program (the agent would
report it or retry later); the report counts the calls refused, admitted
and then late (the must: at most 2 % of those admitted under refuse), and
on time.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import math
import random
import statistics
import time
from dataclasses import dataclass, field

from trajserve.bench.agent_workload import preamble, task, tool_result

POLICIES = ("fcfs", "priority", "program")
TARGETS = {  # against fcfs, in one run
    "short_p99_over_fcfs": ("<=", 0.5),
    "long_throughput_over_fcfs": (">=", 0.9),
}


@dataclass
class Program:
    name: str
    kind: str  # "short" | "long"
    arrival: float
    first: list[int]  # the first call's prompt
    turns: list[tuple[list[int], float]]  # per later call: its tool result's tokens, the wait before it
    # run state
    history: list[int] = field(default_factory=list)
    calls: int = 0
    due: float = 0.0
    rid: str | None = None
    end: float | None = None
    computed: int = 0  # prompt tokens computed (not from the cache) and outputs
    replies: list[list[int]] = field(default_factory=list)
    sent: float = 0.0  # when the call in flight was sent
    refused: int = 0  # calls refused as predicted to miss their deadline (the program then ends)
    late: int = 0  # calls admitted with a deadline that finished after it
    on_time: int = 0


def _percentile(xs: list[float], q: float) -> float:
    s = sorted(xs)
    return s[min(len(s) - 1, max(0, round(q * (len(s) - 1))))]


def build_workload(tok, args, rng: random.Random) -> list[Program]:
    from trajserve.bench.agent_waits import trace_gaps

    gaps = trace_gaps(args)
    pre = preamble(tok, args.preamble_tokens)
    programs = []
    for i in range(args.long + args.short):
        kind = "long" if i < args.long else "short"
        n = args.long_calls if kind == "long" else args.short_calls
        arrival = 0.05 * i if kind == "long" else rng.uniform(0.0, args.arrival_window_s)
        turns = []
        for _ in range(n - 1):
            text = tool_result(tok, rng, rng.randint(args.tool_min_tokens, args.tool_max_tokens))
            obs = f"<|im_end|>\n<|im_start|>user\nTool output:\n{text}<|im_end|>\n<|im_start|>assistant\n"
            turns.append((tok.encode(obs, add_special_tokens=False), rng.choice(gaps) * args.wait_scale))
        first = tok.encode_chat([{"role": "system", "content": pre}, {"role": "user", "content": task(i)}])
        programs.append(Program(f"{kind}{i}", kind, arrival, first, turns))
    return programs


def run_policy(cfg, workload: list[Program], policy: str, args) -> dict:
    from trajserve.engine.deadline import DeadlineMiss
    from trajserve.engine.engine import LLMEngine
    from trajserve.sampling import SamplingParams

    engine = LLMEngine(dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, scheduling=policy)))
    deadline = args.call_deadline_s
    progs = [dataclasses.replace(p, history=[], replies=[]) for p in workload]
    for p in progs:
        p.due = p.arrival
    by_rid: dict[str, Program] = {}
    # --simulate fit: each step's shape and time in the FCFS run, the simulator's cost model fitted to them
    # (one profile a round: each round's FCFS run has the machine's speed in that round).
    steps = [] if args.simulate == "fit" and policy == "fcfs" else None
    sp = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    t0 = time.monotonic()
    try:
        while any(p.end is None for p in progs):
            now = time.monotonic() - t0
            for p in progs:
                if p.end is None and p.rid is None and p.due <= now:
                    ids = p.first if p.calls == 0 else p.history + p.turns[p.calls - 1][0]
                    p.sent = now
                    try:
                        short = p.kind == "short"
                        p.rid = engine.add_request(ids, sp, program=p.name,
                                                   priority=args.short_priority if short else 0,
                                                   deadline_s=deadline if short else None)
                    except DeadlineMiss:
                        p.refused, p.end = p.refused + 1, now
                        continue
                    by_rid[p.rid] = p
            if not engine.has_unfinished_requests():
                due = [p.due for p in progs if p.end is None and p.rid is None]
                if due:  # none: the last programs just ended on a refusal
                    time.sleep(max(0.0, min(due) - now))
                continue
            outs = engine.step()
            if steps is not None and engine.last_schedule is not None:
                steps.append(step_of(engine))
            for out in outs:
                if not out.finished:
                    continue
                p = by_rid.pop(out.request_id)
                reply = list(out.outputs[0].token_ids)
                p.replies.append(reply)
                p.computed += len(out.prompt_token_ids) - out.num_cached_tokens + len(reply)
                p.history = list(out.prompt_token_ids) + reply
                p.calls, p.rid = p.calls + 1, None
                done = time.monotonic() - t0
                if deadline is not None and p.kind == "short":
                    if done - p.sent > deadline:
                        p.late += 1
                    else:
                        p.on_time += 1
                if p.calls == len(p.turns) + 1:
                    p.end = done
                else:
                    p.due = done + p.turns[p.calls - 1][1]
        num_blocks = engine.kv.num_blocks
        if steps:
            from trajserve.bench.programs_sim import profile_of_run
            profile = profile_of_run(engine, steps)
    finally:
        engine.close()
    out = {"policy": policy, "replies": {p.name: p.replies for p in progs if not p.refused}, "num_blocks": num_blocks}
    if steps:
        out["profile"] = profile
    if deadline is not None:
        short = [p for p in progs if p.kind == "short"]
        admitted = sum(p.late + p.on_time for p in short)
        late = sum(p.late for p in short)
        out["deadline"] = {"calls_refused": sum(p.refused for p in short), "calls_admitted": admitted,
                           "admitted_late": late, "late_share": late / admitted if admitted else 0.0,
                           "on_time": sum(p.on_time for p in short)}
    for kind in ("short", "long"):
        e2e = [p.end - p.arrival for p in progs if p.kind == kind] or [math.nan]  # nan: no program of the kind
        out[kind] = {"programs": len([p for p in progs if p.kind == kind]), "p50_s": statistics.median(e2e),
                     "p99_s": _percentile(e2e, 0.99), "mean_s": statistics.fmean(e2e)}
    longs = [p for p in progs if p.kind == "long"]
    span = max(p.end for p in longs) - min(p.arrival for p in longs) if longs else math.nan
    out["long"]["tokens_per_s"] = sum(p.computed for p in longs) / span if longs else math.nan
    return out


def alone(cfg, workload: list[Program], args) -> dict[str, float]:
    """Each short program's end-to-end time with nothing else on the engine:
    its calls one after another on an engine whose prefix cache holds the
    shared preamble (as the mixed runs' does after the long programs' first
    calls), plus its tool waits, added rather than slept (an idle engine
    loses nothing in them). No order of calls beats it, so every percentile
    of a policy's short programs is at least this one's (each program's time
    is at least its own alone), up to the machine's noise."""
    from trajserve.bench.agent import run_one
    from trajserve.engine.engine import LLMEngine
    from trajserve.sampling import SamplingParams

    engine = LLMEngine(dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, scheduling="fcfs")))
    sp = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)

    def call(ids: list[int]) -> tuple[list[int], float]:
        """The call's prompt and reply, and how long it took."""
        t = time.monotonic()
        out = run_one(engine, ids, sp)
        return list(out.prompt_token_ids) + list(out.outputs[0].token_ids), time.monotonic() - t

    try:
        call(workload[0].first)  # the shared preamble into the prefix cache
        times = {}
        for p in workload:
            if p.kind != "short":
                continue
            history, took = call(p.first)
            for obs, wait in p.turns:
                history, t = call(history + obs)
                took += t + wait
            times[p.name] = took
    finally:
        engine.close()
    return times


def _median_run(runs: list[dict]) -> dict:
    """One policy's runs (rounds) as one: each figure's median; replies and
    pool from the first; the fitted profiles (--simulate fit) of every round,
    in order; deadline counts summed."""
    first = runs[0]
    out = {k: v for k, v in first.items() if k != "profile"}
    if "profile" in first:
        out["profiles"] = [r["profile"] for r in runs]
    for kind in ("short", "long"):
        out[kind] = {k: (statistics.median(r[kind][k] for r in runs) if k != "programs" else v)
                     for k, v in first[kind].items()}
    if "deadline" in first:
        d = {k: sum(r["deadline"][k] for r in runs) for k in first["deadline"] if k != "late_share"}
        d["late_share"] = d["admitted_late"] / d["calls_admitted"] if d["calls_admitted"] else 0.0
        out["deadline"] = d
    return out


def rotated(policies: list[str], r: int) -> list[str]:
    """Round r's order: the policies starting at the r-th (mod their number)."""
    k = r % len(policies)
    return policies[k:] + policies[:k]


def step_of(engine):
    """The step the engine just ran, as calibration records one (bench/calibrate.py)."""
    from trajserve.bench.calibrate import Step

    chunks = engine.last_schedule.chunks
    decode = all(c.num_tokens - len(c.draft) == 1 for c in chunks)
    return Step("decode" if decode else "prefill", engine.last_step.total, [(c.num_tokens, c.start) for c in chunks],
                sum(1 + len(c.draft) for c in chunks if c.sample), len(chunks))


def run(args: argparse.Namespace) -> int:
    from trajserve.bench.common import command_line, machine_info
    from trajserve.engine.engine import LLMEngine
    from trajserve.engine.options import config_from_args

    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    if args.simulate == "fit" and "fcfs" not in args.policies.split(","):
        raise ValueError("--simulate fit fits the simulator to the FCFS runs' steps: run --policies with fcfs")
    cfg = config_from_args(args)
    if args.simulate is not None:  # the simulator decodes a token a step: so does the engine it is compared with
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, speculative="off"))
    probe = LLMEngine(cfg)
    tok = probe.tokenizer
    probe.close()
    workload = build_workload(tok, args, random.Random(args.workload_seed))
    policies = args.policies.split(",")
    for policy in policies:
        if policy not in POLICIES:
            raise ValueError(f"--policies: {policy!r} is not one of {', '.join(POLICIES)}")
    # Policies alternate within a round, so a slow spell of the machine falls on all of them, and each
    # round starts at the next policy: the engines of one process need not run alike by their place in
    # a round (on the SPR Xeon, `priority` -- FCFS's order -- run first beat FCFS run second in every
    # round: p99 0.86x, long throughput 1.16x), so no policy keeps the first place.
    runs = [{policy: run_policy(cfg, workload, policy, args) for policy in rotated(policies, r)}
            for r in range(args.rounds)]
    results = {policy: _median_run([r[policy] for r in runs]) for policy in policies}
    base = results.get("fcfs")
    every = [r for rnd in runs for r in rnd.values()]
    ran = set.intersection(*(set(r["replies"]) for r in every))  # programs no refusal ended
    same = all({k: r["replies"][k] for k in ran} == {k: every[0]["replies"][k] for k in ran} for r in every)
    report = {"command": command_line(), "machine": machine_info(), "same_replies": same,
              "workload": {"long": [args.long, args.long_calls], "short": [args.short, args.short_calls],
                           "reply_tokens": args.reply_tokens, "max_num_seqs": cfg.scheduler.max_num_seqs,
                           "short_priority": args.short_priority},
              "rounds": args.rounds,
              "policies": {k: {c: v[c] for c in ("short", "long", "deadline") if c in v} for k, v in results.items()}}
    if args.alone:
        floor = list(alone(cfg, workload, args).values()) or [math.nan]
        report["alone"] = {"short": {"p50_s": statistics.median(floor), "p99_s": _percentile(floor, 0.99)}}
        if base is not None:  # the lowest short p99 / FCFS's any order of calls could reach on this load
            report["alone"]["short_p99_over_fcfs"] = report["alone"]["short"]["p99_s"] / base["short"]["p99_s"]
    if args.rounds > 1:
        report["each_round"] = [{k: {"short_p99_s": v["short"]["p99_s"], "long_tokens_per_s": v["long"]["tokens_per_s"]}
                                 for k, v in rnd.items()} for rnd in runs]  # each in the order it ran
    if args.call_deadline_s is not None:
        report["workload"]["call_deadline_s"] = args.call_deadline_s
        report["workload"]["deadline_admission"] = cfg.scheduler.deadline_admission
    if base is not None:
        for k, v in results.items():
            row = report["policies"][k]
            row["short_p99_over_fcfs"] = v["short"]["p99_s"] / base["short"]["p99_s"]
            row["long_throughput_over_fcfs"] = v["long"]["tokens_per_s"] / base["long"]["tokens_per_s"]
    best = report["policies"].get("program", {})
    report["targets"] = {name: {"want": f"{op} {bound}", "got": best.get(name),
                                "met": best.get(name) is not None and (best[name] <= bound if op == "<="
                                                                       else best[name] >= bound)}
                         for name, (op, bound) in TARGETS.items()}
    if args.simulate is not None:
        from trajserve.bench.programs_sim import compare
        report["simulator"] = compare(cfg, args.simulate, workload, results, args.short_priority)
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"{args.long} long programs x {args.long_calls} calls, {args.short} short x {args.short_calls}, "
          f"replies of {args.reply_tokens} tokens, at most {cfg.scheduler.max_num_seqs} calls at once"
          + (f"; medians of {args.rounds} rounds" if args.rounds > 1 else ""))
    print(f"{'policy':<9} {'short p50':>10} {'short p99':>10} {'long p50':>9} {'long p99':>9} {'long tok/s':>10} "
          f"{'short p99 / fcfs':>17} {'long tok/s / fcfs':>18}")
    for k, v in report["policies"].items():
        print(f"{k:<9} {v['short']['p50_s']:>9.2f}s {v['short']['p99_s']:>9.2f}s {v['long']['p50_s']:>8.2f}s "
              f"{v['long']['p99_s']:>8.2f}s {v['long']['tokens_per_s']:>10.1f} "
              f"{v.get('short_p99_over_fcfs', math.nan):>17.2f} "
              f"{v.get('long_throughput_over_fcfs', math.nan):>18.2f}")
    for k, v in report["policies"].items():
        d = v.get("deadline")
        if d is not None:
            print(f"{k:<9} deadline {args.call_deadline_s:g} s a short call ({cfg.scheduler.deadline_admission}): "
                  f"{d['calls_refused']} refused, {d['calls_admitted']} admitted, {d['admitted_late']} of them late "
                  f"({100 * d['late_share']:.1f} %), {d['on_time']} on time")
    a = report.get("alone")
    if a is not None:
        print(f"{'alone':<9} {a['short']['p50_s']:>9.2f}s {a['short']['p99_s']:>9.2f}s   (each short program with "
              f"nothing else running: the least any order reaches; p99 "
              f"{a.get('short_p99_over_fcfs', math.nan):.2f} of FCFS's)")
    print(f"greedy replies the same under every policy: {same}")
    if args.simulate is not None:
        from trajserve.bench.programs_sim import print_comparison
        print_comparison(report["simulator"], report["policies"])
    for name, t in report["targets"].items():
        print(f"target {name} {t['want']}: {t['got'] if t['got'] is None else round(t['got'], 3)} "
              f"({'met' if t['met'] else 'NOT met'})")
    print(json.dumps(report))
    return 0 if same else 1


def add_parser(bsub) -> None:
    from trajserve.engine.options import add_engine_args

    s = bsub.add_parser("programs", help="short and long agent programs at once under each --scheduling "
                        "policy: program end-to-end p50 / p99 per class")
    s.add_argument("--long", type=int, default=4, help="long programs")
    s.add_argument("--long-calls", type=int, default=10)
    s.add_argument("--short", type=int, default=16, help="short programs")
    s.add_argument("--short-calls", type=int, default=2)
    s.add_argument("--arrival-window-s", type=float, default=10.0,
                   help="short programs arrive at uniform times in [0, this]")
    s.add_argument("--reply-tokens", type=int, default=24)
    s.add_argument("--preamble-tokens", type=int, default=600)
    s.add_argument("--tool-min-tokens", type=int, default=40)
    s.add_argument("--tool-max-tokens", type=int, default=200)
    s.add_argument("--wait-trace", default="claude-code", metavar="DIR",
                   help="tool waits: the gaps between calls in these Claude Code traces ('claude-code': the "
                   "repository's)")
    s.add_argument("--wait-cap", type=float, default=60.0, help="longest trace gap kept, in trace seconds")
    s.add_argument("--wait-scale", type=float, default=0.02, help="trace seconds to seconds here")
    s.add_argument("--policies", default=",".join(POLICIES))
    s.add_argument("--short-priority", type=int, default=0,
                   help="the short programs' calls' priority (lower first; the long ones' 0): what an "
                        "interactive client marks; FCFS ignores it")
    s.add_argument("--call-deadline-s", type=float, default=None,
                   help="each short program's call must finish within this many seconds of being sent "
                   "(priced under --deadline-admission)")
    s.add_argument("--rounds", type=int, default=1,
                   help="run every policy this many times, alternating (each round starting at the next "
                   "policy), and report each figure's median")
    s.add_argument("--alone", action=argparse.BooleanOptionalAction, default=True,
                   help="also time each short program with nothing else running (its calls in turn on a warm "
                   "prefix cache, plus its tool waits): the floor under every policy's latencies")
    s.add_argument("--workload-seed", type=int, default=0)
    s.add_argument("--simulate", default=None, metavar="PROFILE|fit",
                   help="also run each policy's programs through the simulator on this hardware profile "
                   "(`trajserve calibrate`), or on one fitted to each round's FCFS run's own steps (fit: "
                   "the predictions' medians over the rounds), and compare (speculation off in both)")
    s.add_argument("--json", action="store_true", help="print only JSON")
    # One pool size for every policy's engine (a fraction of free memory would vary between them).
    add_engine_args(s, defaults={"max_num_seqs": 4, "kv_cache_memory": "2GiB"})
    s.set_defaults(func=run)
