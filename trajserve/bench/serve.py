"""`trajserve bench serve`: load an OpenAI-compatible server, in the manner of
vLLM's `bench serve`.

Requests arrive as a Poisson process (`--request-rate`, `inf` = all at once;
`--burstiness` < 1 burstier, > 1 more regular: gamma-distributed gaps with
the same mean), at most `--max-concurrency` in flight, each streamed so TTFT
and inter-token latencies are seen by the client. Datasets:

  random         random token ids, --input-len / --output-len (completions API)
  shared-prefix  a common --prefix-len token prefix + random suffix
  agent          trajectories of --turns chat turns: a system + tool preamble
                 (one shared, or --preambles K kinds), each turn the server's
                 reply and a tool result; a trajectory's turns run one after
                 another (closed loop)

Reports successful, failed and refused (429) requests, duration, request
and token throughput, goodput under `--goodput ttft:MS tpot:MS e2e:MS`,
and mean/median/p99 of TTFT, TPOT, ITL and E2E latency. `--sweep-rate
R1,R2,...` runs the load at each rate in turn and finds the knee
(bench/rate_sweep.py).
"""
from __future__ import annotations

import argparse
import asyncio
import json
import logging
import random
import time
from dataclasses import dataclass, field

import httpx
import numpy as np
from tqdm import tqdm

from trajserve.bench.agent_workload import WORDS, task
from trajserve.bench.common import command_line


@dataclass(slots=True)
class Result:
    ok: bool = False
    error: str = ""
    prompt_tokens: int = 0
    output_tokens: int = 0
    cached_tokens: int = 0
    ttft: float = 0.0
    e2e: float = 0.0
    itl: list[float] = field(default_factory=list)
    text: str = ""

    @property
    def tpot(self) -> float | None:
        return (self.e2e - self.ttft) / (self.output_tokens - 1) if self.output_tokens > 1 else None


async def stream_request(client: httpx.AsyncClient, path: str, body: dict) -> Result:
    res = Result()
    body = {**body, "stream": True, "stream_options": {"include_usage": True}}
    t0 = time.perf_counter()
    last = None
    try:
        async with client.stream("POST", path, json=body) as r:
            if r.status_code != 200:
                res.error = f"HTTP {r.status_code}: {(await r.aread()).decode()[:200]}"
                return res
            async for line in r.aiter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if chunk.get("usage"):
                    u = chunk["usage"]
                    res.prompt_tokens, res.output_tokens = u["prompt_tokens"], u["completion_tokens"]
                    res.cached_tokens = (u.get("prompt_tokens_details") or {}).get("cached_tokens", 0)
                for ch in chunk.get("choices", []):
                    piece = ch.get("text") if "text" in ch else (ch.get("delta") or {}).get("content")
                    if not piece:
                        continue
                    now = time.perf_counter()
                    if last is None:
                        res.ttft = now - t0
                    else:
                        res.itl.append(now - last)
                    last = now
                    res.text += piece
        res.e2e = time.perf_counter() - t0
        res.ok = last is not None or res.output_tokens > 0
        if not res.ok:
            res.error = "no tokens streamed"
    except httpx.HTTPError as e:
        res.error = f"{type(e).__name__}: {e}"
    return res


def gaps(n: int, rate: float, burstiness: float, rng: np.random.Generator) -> np.ndarray:
    """Inter-arrival times: gamma with shape = burstiness and mean 1/rate
    (burstiness 1 = Poisson)."""
    if rate == float("inf"):
        return np.zeros(n)
    return rng.gamma(burstiness, 1.0 / (rate * burstiness), size=n)


def tool_text(rng: random.Random, words: int) -> str:
    return "\n".join(" ".join(rng.choice(WORDS) for _ in range(8)) for _ in range(max(1, words // 8)))


async def run_async(args: argparse.Namespace) -> dict:
    logging.getLogger("httpx").setLevel(logging.WARNING)  # not a line per request on a -v run
    rng = random.Random(args.seed)
    nprng = np.random.default_rng(args.seed)
    limits = httpx.Limits(max_connections=args.max_concurrency or 1000)
    async with httpx.AsyncClient(base_url=args.base_url.rstrip("/"), timeout=args.timeout, limits=limits) as client:
        models = (await client.get("/v1/models")).json()["data"]
        model = args.model or models[0]["id"]
        sem = asyncio.Semaphore(args.max_concurrency) if args.max_concurrency else None
        bar = tqdm(total=args.num_prompts * (args.turns if args.dataset == "agent" else 1), desc="requests",
                   disable=args.json)
        results: list[Result] = []

        async def limited(coro_fn):
            if sem is None:
                return await coro_fn()
            async with sem:
                return await coro_fn()

        def completion_body(i: int) -> dict:
            prefix = [] if args.dataset == "random" else [(7 * j) % 5000 + 100 for j in range(args.prefix_len)]
            ids = prefix + [rng.randrange(100, 20000) for _ in range(args.input_len)]
            return {"model": model, "prompt": ids, "max_tokens": args.output_len, "temperature": 0,
                    "ignore_eos": True}

        async def single(i: int) -> None:
            body = completion_body(i)
            res = await limited(lambda: stream_request(client, "/v1/completions", body))
            results.append(res)
            bar.update(1)

        tools = " ".join(f"tool_{k}(path, args)" for k in range(args.prefix_len // 6))
        kinds = max(1, getattr(args, "preambles", 1))

        async def trajectory(i: int) -> None:
            # --preambles K: K kinds of agent, each its own system prompt (trajectory i is kind i % K).
            kind = f"You are coding agent {i % kinds}. " if kinds > 1 else "You are a coding agent. "
            msgs = [{"role": "system", "content": kind + "Tools: " + tools}, {"role": "user", "content": task(i)}]
            own = random.Random(args.seed * 1_000_003 + i)  # its tool outputs, whatever order turns finish in
            for turn in range(args.turns):
                body = {"model": model, "messages": msgs, "max_tokens": args.output_len, "temperature": 0}
                res = await limited(lambda: stream_request(client, "/v1/chat/completions", body))
                results.append(res)
                bar.update(1)
                if not res.ok:
                    return
                msgs = msgs + [{"role": "assistant", "content": res.text},
                               {"role": "user", "content": "Tool output:\n" + tool_text(own, args.input_len)}]

        start = time.perf_counter()
        tasks = []
        for i, gap in enumerate(gaps(args.num_prompts, args.request_rate, args.burstiness, nprng)):
            await asyncio.sleep(gap)
            tasks.append(asyncio.create_task(trajectory(i) if args.dataset == "agent" else single(i)))
        await asyncio.gather(*tasks)
        duration = time.perf_counter() - start
        bar.close()
    return summarize(results, duration, args)


def parse_goodput(specs: list[str]) -> dict[str, float]:
    out = {}
    for s in specs:
        key, _, ms = s.partition(":")
        if key not in ("ttft", "tpot", "e2e") or not ms:
            raise ValueError(f"--goodput takes ttft:MS, tpot:MS or e2e:MS, got {s!r}")
        out[key] = float(ms) / 1e3
    return out


def stats(xs: list[float]) -> dict:
    if not xs:
        return {"mean_ms": None, "median_ms": None, "p99_ms": None}
    a = np.asarray(xs) * 1e3
    return {"mean_ms": float(a.mean()), "median_ms": float(np.median(a)), "p99_ms": float(np.percentile(a, 99))}


def summarize(results: list[Result], duration: float, args: argparse.Namespace) -> dict:
    ok = [r for r in results if r.ok]
    slo = parse_goodput(args.goodput or [])

    def meets(r: Result) -> bool:
        return all((r.ttft if k == "ttft" else r.e2e if k == "e2e" else (r.tpot or 0.0)) <= v for k, v in slo.items())

    out_tokens = sum(r.output_tokens for r in ok)
    in_tokens = sum(r.prompt_tokens for r in ok)
    return {
        "command": command_line(), "base_url": args.base_url, "dataset": args.dataset,
        "request_rate": args.request_rate, "burstiness": args.burstiness, "max_concurrency": args.max_concurrency,
        "successful_requests": len(ok), "failed_requests": len(results) - len(ok),
        "refused_requests": sum(r.error.startswith("HTTP 429") for r in results),  # the server's admission caps
        "errors": sorted({r.error for r in results if not r.ok})[:5],
        "duration_s": duration, "request_throughput": len(ok) / duration,
        "output_token_throughput": out_tokens / duration, "total_token_throughput": (in_tokens + out_tokens) / duration,
        "prompt_tokens": in_tokens, "output_tokens": out_tokens,
        "cached_prompt_tokens": sum(r.cached_tokens for r in ok),
        "goodput": {"slo_ms": {k: v * 1e3 for k, v in slo.items()},
                    "requests_per_s": sum(meets(r) for r in ok) / duration} if slo else None,
        "ttft": stats([r.ttft for r in ok]), "tpot": stats([r.tpot for r in ok if r.tpot is not None]),
        "itl": stats([x for r in ok for x in r.itl]), "e2e": stats([r.e2e for r in ok]),
    }


def run(args: argparse.Namespace) -> int:
    if args.request_rate <= 0:
        raise ValueError(f"--request-rate must be > 0 (inf = all at once), got {args.request_rate}")
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    parse_goodput(args.goodput or [])
    try:
        res = asyncio.run(run_async(args))
    except httpx.ConnectError as e:
        raise ValueError(f"cannot reach the server at {args.base_url}: {e}") from None
    if args.json:
        print(json.dumps(res, indent=2))
        return 0 if res["successful_requests"] else 1
    print(f"\n{res['command']}")
    rows = [("Successful requests", res["successful_requests"]), ("Failed requests", res["failed_requests"]),
            ("Benchmark duration (s)", f"{res['duration_s']:.2f}"),
            ("Request throughput (req/s)", f"{res['request_throughput']:.3f}"),
            ("Output token throughput (tok/s)", f"{res['output_token_throughput']:.1f}"),
            ("Total token throughput (tok/s)", f"{res['total_token_throughput']:.1f}"),
            ("Prompt tokens / cached", f"{res['prompt_tokens']} / {res['cached_prompt_tokens']}")]
    if res["goodput"]:
        rows.append((f"Goodput (req/s, SLO {res['goodput']['slo_ms']} ms)", f"{res['goodput']['requests_per_s']:.3f}"))
    for k in ("ttft", "tpot", "itl", "e2e"):
        for s in ("mean_ms", "median_ms", "p99_ms"):
            v = res[k][s]
            rows.append((f"{s.split('_')[0].capitalize()} {k.upper()} (ms)", "-" if v is None else f"{v:.1f}"))
    for name, value in rows:
        print(f"{name:<44} {value:>12}")
    if res["errors"]:
        print("errors:", *res["errors"], sep="\n  ")
    print("\nJSON:")
    print(json.dumps(res))
    return 0 if res["successful_requests"] else 1
