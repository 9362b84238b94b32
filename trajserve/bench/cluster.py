"""`trajserve bench cluster`: one agent load through one server and through
`serve --replicas N` under each router (the live comparison).

Each configuration is a fresh `trajserve serve` process (port 0), loaded by
`bench serve`'s agent dataset (bench/serve.py: trajectories of --turns chat
turns, --preambles kinds of agent with their own system prompt, each turn
the reply plus a tool result, turns of one trajectory in sequence) and then
stopped; the same seed gives every configuration the same prompts. The one
server is the baseline: one KV cache that every turn can hit, with the
replicas' threads together. Reported per configuration: the prefix hit rate
(cached prompt tokens / prompt tokens, as each replica counted them), TTFT
p50/p99, end-to-end mean, duration; and each router's hit rate as a share of
the one server's (target for kv: >= 0.95).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import os
import re
import shlex
import subprocess
import sys
import threading
import time


class _Server:
    """`trajserve serve --port 0 ARGS` until stop(); url from its start-up line."""

    def __init__(self, args: list[str], timeout: float = 600) -> None:
        import httpx

        env = dict(os.environ, OMP_WAIT_POLICY="PASSIVE")
        self.proc = subprocess.Popen([sys.executable, "-m", "trajserve.cli", "serve", "--port", "0", *args],
                                     stderr=subprocess.PIPE, stdout=subprocess.DEVNULL, text=True, env=env)
        self.url, seen = None, []
        deadline = time.monotonic() + timeout
        while self.url is None:
            line = self.proc.stderr.readline()
            if not line and self.proc.poll() is not None:
                raise RuntimeError("server exited:\n" + "".join(seen[-20:]))
            seen.append(line)
            m = re.search(r"serving \S+ on (http://\S+)", line)
            if m:
                self.url = m.group(1)
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError("no start-up line:\n" + "".join(seen[-20:]))
        threading.Thread(target=lambda: [None for _ in self.proc.stderr], daemon=True).start()
        while True:
            try:
                if httpx.get(self.url + "/health", timeout=5).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline or self.proc.poll() is not None:
                self.stop()
                raise RuntimeError("server did not become healthy")
            time.sleep(0.5)

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()


def _load_args(args: argparse.Namespace, url: str) -> argparse.Namespace:
    return argparse.Namespace(
        base_url=url, model=None, dataset="agent", num_prompts=args.trajectories, input_len=args.tool_words,
        output_len=args.output_len, prefix_len=args.prefix_len, turns=args.turns, preambles=args.preambles,
        request_rate=args.request_rate, burstiness=1.0, max_concurrency=args.max_concurrency, goodput=None,
        timeout=args.timeout, seed=args.seed, json=True)


def run(args: argparse.Namespace) -> int:
    import httpx

    from trajserve.bench.common import command_line
    from trajserve.bench.serve import run_async

    logging.getLogger("httpx").setLevel(logging.WARNING)  # a line per request otherwise
    from trajserve.cluster.router import ROUTERS

    routers = [r for r in args.routers.split(",") if r]
    bad = [r for r in routers if r not in ROUTERS]
    if bad or not routers:
        raise ValueError(f"--routers: a comma list of {', '.join(ROUTERS)}; got {args.routers!r}")
    if args.replicas < 2:
        raise ValueError(f"--replicas must be >= 2 to compare routers, got {args.replicas}")
    extra = shlex.split(args.serve_args)
    configs = [("one server", ["--threads", str(args.replicas * args.threads), *extra])]
    configs += [(f"{args.replicas} replicas, {r}", ["--replicas", str(args.replicas), "--router", r,
                                                    "--threads", str(args.threads), *extra]) for r in routers]
    rows = []
    for name, serve_args in configs:
        print(f"{name}: trajserve serve {' '.join(serve_args)}", file=sys.stderr, flush=True)
        server = _Server(serve_args)
        try:
            res = asyncio.run(run_async(_load_args(args, server.url)))
            replicas = httpx.get(server.url + "/v1/replicas", timeout=30).json()["data"] \
                if "--replicas" in serve_args else None
        finally:
            server.stop()
        hit = res["cached_prompt_tokens"] / max(1, res["prompt_tokens"])
        rows.append({"config": name, "serve_args": serve_args, "hit_rate": hit,
                     "prompt_tokens": res["prompt_tokens"], "cached_tokens": res["cached_prompt_tokens"],
                     "ttft_p50_ms": res["ttft"]["median_ms"], "ttft_p99_ms": res["ttft"]["p99_ms"],
                     "e2e_mean_ms": res["e2e"]["mean_ms"], "duration_s": res["duration_s"],
                     "failed": res["failed_requests"], "errors": res["errors"],
                     "routed": [r["routed"] for r in replicas] if replicas else None})
    base = rows[0]["hit_rate"]
    for row in rows:
        row["hit_rate_vs_one"] = row["hit_rate"] / base if base else None
    out = {"command": command_line(), "rows": rows}
    if not args.json:
        print(f"\n{out['command']}")
        print(f"{'configuration':<28} {'hit rate':>9} {'vs one':>7} {'TTFT p50':>9} {'TTFT p99':>9} "
              f"{'E2E mean':>9} {'time s':>7} {'failed':>6}  routed")
        for r in rows:
            print(f"{r['config']:<28} {r['hit_rate']:>9.3f} {r['hit_rate_vs_one']:>7.3f} {r['ttft_p50_ms']:>9.1f} "
                  f"{r['ttft_p99_ms']:>9.1f} {r['e2e_mean_ms']:>9.1f} {r['duration_s']:>7.1f} {r['failed']:>6}  "
                  f"{r['routed'] or ''}")
        print("\nJSON:")
    print(json.dumps(out))
    return 0 if all(r["failed"] == 0 for r in rows) else 1


def add_parser(bsub) -> None:
    c = bsub.add_parser("cluster", help="an agent load through one server and through serve --replicas N under "
                                        "each router: prefix hit rate, TTFT")
    c.add_argument("--replicas", type=int, default=2)
    c.add_argument("--routers", default="kv,round-robin", help="comma list of kv, round-robin, least-loaded, "
                                                               "char-prefix")
    c.add_argument("--threads", type=int, default=1, help="torch threads per replica (the one server gets "
                                                          "replicas x threads)")
    c.add_argument("--serve-args", default="", help="more `serve` options for every configuration, quoted")
    c.add_argument("--trajectories", type=int, default=16)
    c.add_argument("--turns", type=int, default=4)
    c.add_argument("--preambles", type=int, default=4, help="kinds of agent, each its own system prompt")
    c.add_argument("--prefix-len", type=int, default=512, help="system + tools preamble length (words)")
    c.add_argument("--tool-words", type=int, default=64, help="words of tool output a turn adds")
    c.add_argument("--output-len", type=int, default=32)
    c.add_argument("--request-rate", type=float, default=4.0, help="trajectories started per second (Poisson)")
    c.add_argument("--max-concurrency", type=int, default=None)
    c.add_argument("--timeout", type=float, default=600)
    c.add_argument("--seed", type=int, default=0)
    c.add_argument("--json", action="store_true", help="print only JSON")
    c.set_defaults(func=run)
