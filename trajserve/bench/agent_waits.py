"""`trajserve bench agent --tool-waits`: concurrent agents that pause for tools.

N trajectories run at once on the real engine; after each turn the agent
runs a tool whose wait is drawn from a mix (short 0.05-0.5 s, medium 1-5 s,
long 10-30 s, times --wait-scale for this CPU), then sends the next turn.
While it waits, its session is paused under one of four policies:

    keep     always keep the state pinned in the pool
    drop     always drop it (recompute on resume)
    host     always offload it to host memory
    policy   the break-even keep policy (sessions/keep_policy.py)

The pool is sized so that keeping every paused state does not fit. Always
keep never gives a paused state up, so it can only serve the agents whose
states fit: like a chat engine reserving for the worst case, it starts an
agent when the pool can hold that agent's whole final history next to the
agents already started (the shared preamble counted once), and the next
agent starts when one finishes. (Were it to start everyone, a full pool of
pinned state would stall the engine; the session manager then drops the
oldest pinned state -- the stand-in for an out-of-memory failure, counted as
`stall_drops` -- which is no longer always-keep.) The other policies start
every agent at once; under the break-even policy kept state leaves the
device when running work needs the room (the session manager is the KV
manager's reclaimer). The same seeded workload runs under each policy in
turn, in one process.

--wait-trace replaces the synthetic mix with the gaps between the main
agent's calls in the Claude Code traces (tool and human time; gaps over
--wait-cap trace seconds, human breaks, are left out), times --wait-scale.
"""
from __future__ import annotations

import argparse
import json
import random
import statistics
import sys
import time
from dataclasses import dataclass, field

from trajserve.bench.agent_workload import preamble, task, tool_result
from trajserve.bench.common import command_line, machine_info
from trajserve.kv.block_table import blocks_for
from trajserve.server.prefix_break import common_prefix
from trajserve.sampling import SamplingParams
from trajserve.sessions.keep_policy import Decision
from trajserve.sessions.config import SessionConfig
from trajserve.sessions.manager import SessionManager, SessionState
from trajserve.traces import default_trace_dir, tool_waits

WAIT_MIX = {"grep": (0.05, 0.5), "build": (1.0, 5.0), "pytest": (10.0, 30.0)}  # seconds, before scaling
POLICIES = ("keep", "drop", "host", "policy")


@dataclass
class Trajectory:
    index: int
    turns: list[tuple[list[int], str, float]]  # per turn: observation tokens, tool, wait (s)
    session_id: str = ""
    turn: int = 0
    resume_at: float | None = None
    request_id: str | None = None
    prompt: list[int] = field(default_factory=list)
    done: bool = False


def trace_gaps(args) -> list[float] | None:
    if args.wait_trace is None:
        return None
    from pathlib import Path
    d = Path(args.wait_trace)
    if args.wait_trace == "claude-code":
        d = default_trace_dir(Path(__file__).resolve().parents[2]) / "claude-code"
    gaps = [g for g in tool_waits(d) if g <= args.wait_cap]
    if not gaps:
        raise ValueError(f"no gap in {d} is at most --wait-cap {args.wait_cap} s")
    return gaps


def draw_waits(args, rng: random.Random) -> list[tuple[str, float]]:
    """--turns (tool, wait in trace or mix seconds): the waits every agent gets, in its own order."""
    gaps = trace_gaps(args)
    waits = []
    for _ in range(args.turns):
        if gaps is None:
            tool = rng.choice(list(WAIT_MIX))
            waits.append((tool, rng.uniform(*WAIT_MIX[tool])))
        else:
            # The trace names no tools: the policy learns one global wait history.
            waits.append(("tool", rng.choice(gaps)))
    return waits


def build_workload(tok, args, rng: random.Random) -> tuple[list[int], list[list[tuple[list[int], str, float]]]]:
    """Every agent gets the same tool waits in its own order: no one agent's
    chain of long waits sets the makespan by itself (throughput would then
    measure that agent's luck, not the engine)."""
    pre = preamble(tok, args.preamble_tokens)
    waits = draw_waits(args, rng)
    trajs = []
    for i in range(args.trajectories):
        turns = []
        order = rng.sample(waits, len(waits))
        for t in range(args.turns):
            tool, wait = order[t]
            text = tool_result(tok, rng, rng.randint(args.tool_min_tokens, args.tool_max_tokens))
            obs = f"<|im_end|>\n<|im_start|>user\nTool {tool} output:\n{text}<|im_end|>\n<|im_start|>assistant\n"
            turns.append((tok.encode(obs, add_special_tokens=False), tool, wait * args.wait_scale))
        first = tok.encode_chat([{"role": "system", "content": pre}, {"role": "user", "content": task(i)}])
        trajs.append((first, turns))
    return trajs


def run_policy(engine, workload, policy: str, args) -> dict:
    engine.kv.clear_cache()
    mgr = SessionManager(engine, SessionConfig(host_bytes=args.host_bytes))
    rates = mgr.calibrate()  # the policy prices with this machine's copy and prefill speed
    m_block = mgr.block_bytes
    sp = SamplingParams(max_tokens=args.reply_tokens, temperature=0, ignore_eos=True)
    trajs = [Trajectory(i, turns) for i, (_, turns) in enumerate(workload)]
    firsts = [f for f, _ in workload]
    outs_by_rid: dict[str, Trajectory] = {}
    resumed_ttft, all_ttft = [], []
    replies: dict[str, list[int]] = {}  # "trajectory.turn" -> greedy reply: the same under every policy
    held_gbs = 0.0  # device GB*s held by paused sessions
    gen_tokens = 0
    start = last = time.monotonic()

    def submit(t: Trajectory, prompt: list[int]) -> None:
        mgr.before_turn(t.session_id, None)
        t.prompt = prompt
        t.request_id = engine.add_request(prompt, sp)
        outs_by_rid[t.request_id] = t

    # Always keep: start an agent only when its worst case fits (see the module docstring).
    B = engine.kv.block_size
    shared = _common_prefix(firsts) // B
    final = [len(f) + sum(len(o) for o, _, _ in turns) + (len(turns) + 1) * args.reply_tokens for f, turns in workload]
    worst = [blocks_for(n, B) - shared for n in final]
    room = engine.kv.num_blocks - engine.kv.watermark_blocks - shared
    if policy == "keep" and max(worst) > room:
        raise ValueError(f"always-keep: one agent's final history ({max(worst) + shared} blocks) does not fit "
                         f"the pool ({engine.kv.num_blocks} blocks)")
    queued = list(trajs)
    reserved = 0

    def start_agents() -> None:
        nonlocal reserved
        while queued and (policy != "keep" or reserved + worst[queued[0].index] <= room):
            t = queued.pop(0)
            reserved += worst[t.index]
            t.session_id = f"agent-{t.index}"
            submit(t, firsts[t.index])

    start_agents()
    max_started = len(trajs) - len(queued)
    while not all(t.done for t in trajs):
        now = time.monotonic()
        dt, last = now - last, now
        # A kept session's device bytes: its pinned path (what cached_prefix finds).
        held_gbs += dt * sum(len(engine.kv.cached_prefix(s.history, s.scope).block_ids) * m_block
                             for s in mgr.sessions.values()
                             if s.state is SessionState.PAUSED and s.tier is Decision.KEEP) / 1e9
        for t in trajs:
            if t.resume_at is not None and now >= t.resume_at:
                t.resume_at = None
                s = mgr.sessions[t.session_id]
                mgr.resume(s)
                obs = t.turns[t.turn - 1][0]
                submit(t, s.history + obs)
        if not engine.has_unfinished_requests():
            mgr.tick()  # leases and prefetch run while every agent waits, too
            nxt = min((t.resume_at for t in trajs if t.resume_at is not None), default=now)
            time.sleep(max(0.0, min(nxt - now, 0.05)))
            continue
        # The manager's hooks: leases, pressure, prefetch; a stall drop if forced-kept state blocks everything.
        outs = engine.step()
        if mgr.stalled:
            raise RuntimeError("nothing can run and no paused state to release: make the pool larger")
        for out in outs:
            if not out.finished or out.request_id not in outs_by_rid:
                continue
            t = outs_by_rid.pop(out.request_id)
            replies[f"{t.index}.{t.turn}"] = list(out.outputs[0].token_ids)
            gen_tokens += len(out.outputs[0].token_ids)
            all_ttft.append(out.metrics.ttft)
            if t.turn > 0:
                resumed_ttft.append(out.metrics.ttft)
            s = mgr.sessions[t.session_id]
            if t.turn >= len(t.turns):
                mgr.after_turn(s, t.prompt, out)
                mgr.close(s)
                t.done = True
                reserved -= worst[t.index]
                start_agents()
                continue
            _, tool, wait = t.turns[t.turn]
            forced = None if policy == "policy" else policy
            mgr.after_turn(s, t.prompt, out, tool_wait_s=None, tool=tool, decision=forced)
            t.turn += 1
            t.resume_at = time.monotonic() + wait
    makespan = time.monotonic() - start
    st = mgr.metrics()
    mgr.shutdown()
    q = statistics.quantiles(resumed_ttft, n=100) if len(resumed_ttft) >= 2 else [resumed_ttft[0]] * 99
    return {"policy": policy, "makespan_s": makespan, "turns": len(all_ttft),
            "throughput_tok_s": gen_tokens / makespan, "turns_per_s": len(all_ttft) / makespan,
            "ttft_resumed_p50_ms": statistics.median(resumed_ttft) * 1e3, "ttft_resumed_p99_ms": q[98] * 1e3,
            "paused_kv_gbs": held_gbs, "bytes_moved": st["swap_out_bytes"] + st["swap_in_bytes"],
            "recomputed_tokens": st["recomputed_tokens"], "stall_drops": st["stall_drops"],
            "pressure_demotions": st["pressure_demotions"], "prefetch_hits": st["prefetch_hits"],
            "resume_stalls": st["resume_stalls"], "resume_stall_s": st["resume_stall_s"],
            "reload_hidden_s": st["reload_hidden_s"], "reload_no_room": st["reload_no_room"],
            "decisions": st["keep_decisions"], "preemptions": engine.scheduler.num_preemptions,
            "calibrated_rates": rates, "agents_started_at_once": max_started,
            "replies": replies}


def run(args: argparse.Namespace) -> int:
    from trajserve.llm import LLM

    if args.num_blocks is None and args.kv_cache_memory is None:
        # Room for the active turns, not for every paused history as well.
        per_traj = args.preamble_tokens + 100 + args.turns * (args.tool_max_tokens + args.reply_tokens + 40)
        args.num_blocks = int(args.trajectories * blocks_for(per_traj, args.block_size) * args.pool_fraction)
    engine = LLM.from_args(args).engine
    rng = random.Random(args.seed)
    workload = build_workload(engine.tokenizer, args, rng)
    policies = [p for p in args.policies.split(",")]
    bad = [p for p in policies if p not in POLICIES]
    if bad:
        raise ValueError(f"unknown policies {bad}; choose from {', '.join(POLICIES)}")
    results = []
    for p in policies:
        preempt0 = engine.scheduler.num_preemptions
        r = run_policy(engine, workload, p, args)
        r["preemptions"] -= preempt0
        results.append(r)
        print(f"{p}: makespan {r['makespan_s']:.1f} s, {r['throughput_tok_s']:.2f} tok/s", file=sys.stderr)
    # Greedy replies must not depend on where paused state waited.
    same = all(r["replies"] == results[0]["replies"] for r in results)
    for r in results:
        del r["replies"]
    res = {"command": command_line(), "machine": machine_info(), "trajectories": args.trajectories,
           "turns": args.turns + 1, "wait_scale": args.wait_scale, "wait_source": args.wait_trace or "mix",
           "waits_s": [w for _, turns in workload for _, _, w in turns], "num_blocks": engine.num_blocks,
           "block_size": engine.kv.block_size, "replies_identical_across_policies": same, "results": results}
    by = {r["policy"]: r for r in results}
    if "policy" in by and "keep" in by:
        res["policy_over_keep_throughput"] = by["policy"]["throughput_tok_s"] / by["keep"]["throughput_tok_s"]
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"\n{res['command']}")
    print(f"{args.trajectories} agents x {args.turns + 1} turns, waits x{args.wait_scale}, "
          f"pool {engine.num_blocks} blocks of {engine.kv.block_size}\n")
    print(f"{'policy':>7} {'makespan':>9} {'tok/s':>7} {'TTFT p50':>9} {'p99':>8} {'paused GB*s':>11} "
          f"{'moved MB':>9} {'recomp':>7} {'stall':>5} {'demote':>6} {'prefetch':>8}  decisions")
    for r in results:
        print(f"{r['policy']:>7} {r['makespan_s']:>8.1f}s {r['throughput_tok_s']:>7.2f} "
              f"{r['ttft_resumed_p50_ms']:>7.0f}ms {r['ttft_resumed_p99_ms']:>6.0f}ms {r['paused_kv_gbs']:>11.3f} "
              f"{r['bytes_moved'] / 1e6:>9.1f} {r['recomputed_tokens']:>7} {r['stall_drops']:>5} "
              f"{r['pressure_demotions']:>6} {r['prefetch_hits']:>4}/{r['resume_stalls']:<3}  {r['decisions']}")
    if "keep" in by:
        print(f"\nalways-keep ran at most {by['keep']['agents_started_at_once']} of {args.trajectories} agents at once "
              "(each one's final history reserved)")
    print(f"greedy replies identical under every policy: {same}")
    if "policy_over_keep_throughput" in res:
        print(f"\nbreak-even policy / always-keep throughput: {res['policy_over_keep_throughput']:.2f}x")
    print("\nJSON:")
    print(json.dumps(res))
    return 0


def _common_prefix(seqs: list[list[int]]) -> int:
    return min((common_prefix(seqs[0], q) for q in seqs[1:]), default=len(seqs[0]))
