"""`trajserve bench serve --sweep-rate R1,R2,...`: the knee, measured from
outside (inference-optimization 8.6.2).

The same load (`bench serve`'s dataset and SLO) runs at each arrival rate
in turn against one server; for each rate: the completed throughput, the
goodput under `--goodput` (requests meeting every target, per second of
the run: 8.6.2's R_good with Q_i = 1), the requests refused (429 from
`serve --admission` or the queue limit), the requests in the system by
Little's law (8.6.1: L = X T, completed per second times their mean time
in the system) and the latency tails. The knee is the rate of highest
goodput: past it, more arrivals only lengthen the queue, and the chapter's
rule is to cap admissions there (at about L requests in the system).
The server's own cap (`trajserve_admission_cap` on /metrics, from
`serve --admission auto` or a number) is printed beside it.
"""
from __future__ import annotations

import argparse
import asyncio
import json

import httpx

from trajserve.bench.common import command_line
from trajserve.bench.serve import parse_goodput, run_async


def parse_rates(text: str) -> list[float]:
    try:
        rates = [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        rates = []
    if not rates or any(not 0 < r < float("inf") for r in rates):
        raise ValueError(f"--sweep-rate takes finite positive request rates, e.g. 1,2,4,8,16; got {text!r}")
    return sorted(rates)


def server_cap(base_url: str) -> float | None:
    """The server's --admission cap from /metrics, None when it has none."""
    try:
        text = httpx.get(base_url.rstrip("/") + "/metrics", timeout=10).text
    except httpx.HTTPError:
        return None
    for line in text.splitlines():
        if line.startswith("trajserve_admission_cap "):
            return float(line.split()[1])
    return None


def knee(rows: list[dict]) -> dict:
    """The row of highest goodput (the lowest rate of equals), and how far
    goodput fell from it at the highest rate."""
    best = max(rows, key=lambda r: (r["goodput"], -r["rate"]))
    last = rows[-1]
    fall = 1 - last["goodput"] / best["goodput"] if best["goodput"] > 0 else 0.0
    return {"rate": best["rate"], "goodput": best["goodput"], "in_system": best["in_system"],
            "fall_at_highest_rate": fall}


def row(rate: float, res: dict) -> dict:
    x, e2e = res["request_throughput"], res["e2e"]["mean_ms"]
    return {"rate": rate, "completed": x, "goodput": res["goodput"]["requests_per_s"],
            "refused": res["refused_requests"], "failed": res["failed_requests"],
            "in_system": x * e2e / 1e3 if e2e is not None else 0.0,
            "ttft_p99_ms": res["ttft"]["p99_ms"], "e2e_p50_ms": res["e2e"]["median_ms"]}


def run(args: argparse.Namespace) -> int:
    rates = parse_rates(args.sweep_rate)
    if args.burstiness <= 0:
        raise ValueError(f"--burstiness must be > 0, got {args.burstiness}")
    if not parse_goodput(args.goodput or []):
        raise ValueError("--sweep-rate finds where goodput peaks: give the SLO with --goodput, e.g. ttft:2000 tpot:200")
    rows = []
    for rate in rates:
        one = argparse.Namespace(**{**vars(args), "request_rate": rate, "json": True})
        try:
            res = asyncio.run(run_async(one))
        except httpx.ConnectError as e:
            raise ValueError(f"cannot reach the server at {args.base_url}: {e}") from None
        rows.append(row(rate, res))
        if not args.json:
            r = rows[-1]
            print(f"  {rate:g}/s: completed {r['completed']:.3f} req/s, goodput {r['goodput']:.3f}", flush=True)
    out = {"command": command_line(), "base_url": args.base_url, "dataset": args.dataset,
           "slo_ms": {k: v * 1e3 for k, v in parse_goodput(args.goodput).items()}, "rates": rows,
           "knee": knee(rows), "server_admission_cap": server_cap(args.base_url)}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"\n{out['command']}\nSLO {out['slo_ms']} ms\n")
    print(f"{'rate /s':>8} {'completed /s':>13} {'goodput /s':>11} {'refused':>8} {'L = X T':>8} "
          f"{'TTFT p99 ms':>12} {'E2E p50 ms':>11}")
    for r in rows:
        ttft = "-" if r["ttft_p99_ms"] is None else f"{r['ttft_p99_ms']:,.0f}"
        e2e = "-" if r["e2e_p50_ms"] is None else f"{r['e2e_p50_ms']:,.0f}"
        print(f"{r['rate']:>8g} {r['completed']:>13.3f} {r['goodput']:>11.3f} {r['refused']:>8} "
              f"{r['in_system']:>8.1f} {ttft:>12} {e2e:>11}")
    k = out["knee"]
    print(f"\nknee: {k['rate']:g}/s (goodput {k['goodput']:.3f} req/s, {k['in_system']:.1f} requests in the system); "
          f"at {rows[-1]['rate']:g}/s goodput is {k['fall_at_highest_rate']:.0%} below it")
    cap = out["server_admission_cap"]
    print("the server's --admission cap: " + ("none" if cap is None else f"{cap:g} requests"))
    print("\nJSON:")
    print(json.dumps(out))
    return 0
