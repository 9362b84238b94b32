"""`trajserve bench agent --tool-waits --api messages`: agents that speak
Anthropic's Messages API over HTTP, pausing for tools, in three modes:

    lru       no conversation named: paused state is left to the prefix
              cache's LRU (what a harness that sends no trajserve field got
              before conversations were inferred)
    inferred  each agent names its conversation as Claude Code does
              (metadata.user_id's session_id) and nothing else: the server
              infers the session and pauses it on each tool_use reply
              (server/conversations.py)
    explicit  each agent sends trajserve's session_id and the tool it runs
              (the wait left to the estimator, as bench agent's `policy`)

Every reply is a forced tool call (tool_choice any: the reply is the call's
JSON), the client waits the tool's time (the Claude Code traces' gaps with
--wait-trace, else the synthetic mix; times --wait-scale), then sends the
history with the tool_use and its tool_result. The server runs on a local
port (uvicorn, as `serve`); each mode gets a fresh server over the same
engine, its prefix cache emptied. TTFT is timed by the client: request sent
to the first content event of the stream.
"""
from __future__ import annotations

import asyncio
import json
import random
import socket
import statistics
import sys
import threading
import time

from trajserve.bench.agent_waits import draw_waits
from trajserve.bench.agent_workload import preamble, task, tool_result
from trajserve.bench.common import command_line, machine_info
from trajserve.kv.block_table import blocks_for

MODES = ("lru", "inferred", "explicit")


def build_workload(tok, args, rng: random.Random) -> tuple[str, list[list[tuple[str, str, float]]]]:
    """The system prompt, and per agent its turns: (tool, tool output text,
    wait in seconds); every agent has the same waits in its own order."""
    waits = draw_waits(args, rng)
    agents = []
    for _ in range(args.trajectories):
        order = rng.sample(waits, len(waits))
        agents.append([(tool, tool_result(tok, rng, rng.randint(args.tool_min_tokens, args.tool_max_tokens)),
                        wait * args.wait_scale) for tool, wait in order])
    return preamble(tok, args.preamble_tokens), agents


def _tools(names) -> list[dict]:
    # A short path: a forced call's JSON must fit the reply's max_tokens.
    return [{"name": n, "description": f"Run {n} on a path", "input_schema": {
        "type": "object", "properties": {"path": {"type": "string", "maxLength": 12}}, "required": ["path"]}}
            for n in names]


class _Server:
    """The app on 127.0.0.1 (a free port), run by uvicorn on a thread."""

    def __init__(self, app) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.port = self.sock.getsockname()[1]
        self.server = uvicorn.Server(uvicorn.Config(app, log_level="error", log_config=None))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        while not self.server.started:
            time.sleep(0.01)

    def close(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=30)


async def _agent(client, url: str, i: int, system: str, turns, mode: str, args, out: dict) -> None:
    tools = _tools(sorted({t for t, _, _ in turns}))
    messages = [{"role": "user", "content": task(i)}]
    for turn in range(len(turns) + 1):
        body = {"model": "m", "max_tokens": args.reply_tokens, "temperature": 0, "stream": True,
                "system": system, "messages": messages, "tools": tools,
                "tool_choice": {"type": "any", "disable_parallel_tool_use": True} if turn < len(turns)
                else {"type": "none"}}
        if mode == "inferred":
            body["metadata"] = {"user_id": json.dumps({"device_id": "bench", "session_id": f"agent-{i}"})}
        elif mode == "explicit":
            body["session_id"] = f"agent-{i}"
            if turn < len(turns):
                body["tool"] = turns[turn][0]
        sent = time.monotonic()
        first = None
        blocks: list[dict] = []
        output_tokens = 0
        async with client.stream("POST", url, json=body, timeout=None) as r:
            if r.status_code != 200:
                raise RuntimeError(f"agent {i} turn {turn}: {r.status_code} {await r.aread()}")
            async for line in r.aiter_lines():
                if not line.startswith("data: "):
                    continue
                e = json.loads(line[6:])
                if e["type"] == "content_block_start":
                    first = first or time.monotonic()
                    blocks.append(e["content_block"])
                elif e["type"] == "content_block_delta" and e["delta"]["type"] == "text_delta":
                    blocks[-1]["text"] = blocks[-1].get("text", "") + e["delta"]["text"]
                elif e["type"] == "content_block_delta" and e["delta"]["type"] == "input_json_delta":
                    blocks[-1]["input"] = json.loads(e["delta"]["partial_json"])
                elif e["type"] == "message_delta":
                    output_tokens = e["usage"]["output_tokens"]
        out["ttft"].append((turn, first - sent if first else None))
        out["tokens"] += output_tokens
        # What the model wrote (a call's id is the server's, new each time).
        out["replies"][f"{i}.{turn}"] = json.dumps([{k: v for k, v in b.items() if k != "id"} for b in blocks],
                                                  sort_keys=True)
        if turn == len(turns):
            return
        tool, text, wait = turns[turn]
        use = next((b for b in blocks if b["type"] == "tool_use"), None)
        if use is None:
            raise RuntimeError(f"agent {i} turn {turn}: a forced reply without a tool_use block: {blocks}")
        messages += [{"role": "assistant", "content": blocks},
                     {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use["id"], "content": text}]}]
        await asyncio.sleep(wait)


def run_mode(engine, workload, mode: str, args) -> dict:
    import httpx

    from trajserve.server.app import build_app
    from trajserve.server.config import ServerConfig
    from trajserve.sessions.config import SessionConfig

    engine.kv.clear_cache()
    app = build_app(engine, ServerConfig(served_model_names=("m",), sessions=SessionConfig(
        host_bytes=args.host_bytes, idle_ttl_s=3600.0, max_sessions=4096, idle_keep_factor=args.idle_keep_factor)))
    app.state.engine.start()
    server = _Server(app)
    system, agents = workload
    out = {"ttft": [], "tokens": 0, "replies": {}}
    preempt0 = engine.scheduler.num_preemptions

    async def main() -> tuple[float, dict]:
        async with httpx.AsyncClient() as client:
            t0 = time.monotonic()
            await asyncio.gather(*(_agent(client, f"http://127.0.0.1:{server.port}/v1/messages", i, system, turns,
                                          mode, args, out) for i, turns in enumerate(agents)))
            makespan = time.monotonic() - t0
        # The last turns' ends (their pauses) reach the engine thread after their replies: wait for them.
        mgr = app.state.sessions
        while await app.state.engine.call(lambda _: any(s.in_flight for s in mgr.sessions.values())):
            await asyncio.sleep(0.01)
        return makespan, await app.state.engine.call(lambda _: mgr.metrics())
    try:
        makespan, sessions = asyncio.run(main())
    finally:
        server.close()
        app.state.engine.shutdown()
        app.state.sessions.shutdown()
    return {"mode": mode, "makespan_s": makespan, "throughput_tok_s": out["tokens"] / makespan,
            "resumed_ttft_s": [t for turn, t in out["ttft"] if turn > 0 and t is not None],
            "decisions": sessions["keep_decisions"], "recomputed_tokens": sessions["recomputed_tokens"],
            "preemptions": engine.scheduler.num_preemptions - preempt0, "replies": out["replies"]}


def _merge(mode: str, runs: list[dict]) -> dict:
    """A mode's rounds: medians of makespan and throughput, TTFT over every
    round's resumed turns, decisions and recomputation summed."""
    ttft = [t for r in runs for t in r["resumed_ttft_s"]]
    q = statistics.quantiles(ttft, n=100) if len(ttft) >= 2 else ttft * 99
    decisions: dict = {}
    for r in runs:
        for k, v in r["decisions"].items():
            decisions[k] = decisions.get(k, 0) + v
    return {"mode": mode, "rounds": len(runs), "makespan_s": statistics.median(r["makespan_s"] for r in runs),
            "throughput_tok_s": statistics.median(r["throughput_tok_s"] for r in runs),
            "throughput_per_round": [r["throughput_tok_s"] for r in runs],
            "ttft_resumed_p50_ms": statistics.median(ttft) * 1e3, "ttft_resumed_p99_ms": q[98] * 1e3,
            "decisions": decisions, "recomputed_tokens": sum(r["recomputed_tokens"] for r in runs),
            "preemptions": sum(r["preemptions"] for r in runs)}


def run(args) -> int:
    from trajserve.llm import LLM

    if args.num_blocks is None and args.kv_cache_memory is None:  # room for the active turns, not every history
        per_agent = args.preamble_tokens + 150 + args.turns * (args.tool_max_tokens + args.reply_tokens + 60)
        args.num_blocks = int(args.trajectories * blocks_for(per_agent, args.block_size) * args.pool_fraction)
    engine = LLM.from_args(args).engine
    workload = build_workload(engine.tokenizer, args, random.Random(args.seed))
    if args.rounds < 1:
        raise ValueError(f"--rounds must be >= 1, got {args.rounds}")
    modes = args.modes.split(",")
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown modes {bad}; choose from {', '.join(MODES)}")
    runs: dict[str, list[dict]] = {m: [] for m in modes}
    for rnd in range(args.rounds):  # alternated: a mode's place in the order is not its result
        for m in modes if rnd % 2 == 0 else list(reversed(modes)):
            runs[m].append(run_mode(engine, workload, m, args))
            print(f"round {rnd + 1} {m}: makespan {runs[m][-1]['makespan_s']:.1f} s", file=sys.stderr)
    first = runs[modes[0]][0]["replies"]
    same = all(r["replies"] == first for rs in runs.values() for r in rs)
    results = [_merge(m, runs[m]) for m in modes]
    by = {r["mode"]: r for r in results}
    res = {"command": command_line(), "machine": machine_info(), "api": "messages", "rounds": args.rounds,
           "agents": args.trajectories,
           "turns": args.turns + 1, "wait_scale": args.wait_scale, "wait_source": args.wait_trace or "mix",
           "num_blocks": engine.num_blocks, "replies_identical_across_modes": same, "results": results}
    if {"lru", "inferred", "explicit"} <= by.keys():
        gain = by["explicit"]["throughput_tok_s"] - by["lru"]["throughput_tok_s"]
        res["inferred_share_of_explicit_gain"] = \
            (by["inferred"]["throughput_tok_s"] - by["lru"]["throughput_tok_s"]) / gain if gain else None
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    print(f"\n{res['command']}\n{args.trajectories} agents x {args.turns + 1} turns over /v1/messages, waits "
          f"x{args.wait_scale} ({res['wait_source']}), pool {engine.num_blocks} blocks, {args.rounds} rounds in "
          "alternated order (medians; TTFT over every round)\n")
    print(f"{'mode':>9} {'makespan':>9} {'tok/s':>7} {'TTFT p50':>9} {'p99':>8} {'recomp':>7} {'preempt':>7}  "
          "decisions")
    for r in results:
        print(f"{r['mode']:>9} {r['makespan_s']:>8.1f}s {r['throughput_tok_s']:>7.2f} "
              f"{r['ttft_resumed_p50_ms']:>7.0f}ms {r['ttft_resumed_p99_ms']:>6.0f}ms {r['recomputed_tokens']:>7} "
              f"{r['preemptions']:>7}  {r['decisions']}")
    print(f"greedy replies identical in every mode: {same}")
    if res.get("inferred_share_of_explicit_gain") is not None:
        print(f"inferred pauses' share of the explicit sessions' throughput gain over LRU: "
              f"{res['inferred_share_of_explicit_gain']:.2f}")
    print("\nJSON:")
    print(json.dumps(res))
    return 0
