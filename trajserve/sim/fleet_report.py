"""`simulate --replicas N --router kv|round-robin|least-loaded|char-prefix|all`:
the same workload on N replicas behind each router (sim/fleet.py), and on
one replica with all N pools' blocks (the cache a perfect router would
approach, though that one replica also carries all N replicas' load); a
table, JSON and, with --plot, a bar chart."""
from __future__ import annotations

import argparse

import numpy as np

from trajserve.cluster.router import ROUTERS, make_router
from trajserve.sim.fleet import Fleet
from trajserve.sim.from_args import command_line, dump, sessions_factory, setup_from_args


def routers_from(text: str) -> list[str]:
    names = list(ROUTERS) if text == "all" else [t.strip() for t in text.split(",") if t.strip()]
    bad = [n for n in names if n not in ROUTERS]
    if bad or not names:
        raise ValueError(f"--router must be all or a comma list of {', '.join(ROUTERS)}, got {text!r}")
    return names


def run_fleet(args: argparse.Namespace) -> int:
    names = routers_from(args.router)
    if args.prefix_host_cache or args.prefix_disk_cache or args.spec_accept is not None or args.cache_blocks:
        raise ValueError("--replicas runs without --prefix-host-cache / --prefix-disk-cache, --spec-accept and "
                         "--cache-blocks (the fleet simulation does not model them)")
    setup = setup_from_args(args)
    setup.keep_policy = "cache"  # tool pauses are not modelled across replicas: paused state stays cached
    make_sessions, workload = sessions_factory(args)
    n = args.replicas
    rows = []
    for name in names:
        tokens_src = setup.simulator()[1]  # a fresh token source of the block size
        options = {"block_size": setup.block_size} if name == "kv" else {}
        fleet = Fleet(setup, n, make_router(name, n, **options), tokens_src)
        rows.append(fleet.run(make_sessions(tokens_src)).as_dict())
    sim, tokens = setup.simulator(num_blocks=setup.num_blocks * n)
    res = sim.run(make_sessions(tokens))
    ttft = [f - a for f, a in zip(res.records.first_token, res.records.arrival)]
    q = np.percentile(ttft, [50, 99]) if ttft else [float("nan")] * 2
    one = {"router": f"one replica, {n} pools' blocks", "replicas": 1, "calls": len(ttft), "hit_rate": res.hit_rate,
           "ttft_p50_s": float(q[0]), "ttft_p99_s": float(q[1]), "calls_per_replica": [len(ttft)]}
    result = {"command": command_line(), "workload": workload, "replicas": n,
              "blocks_per_replica": setup.num_blocks, "routers": rows, "one_cache": one}
    if args.plot:
        plot_routers(rows, one, args.plot, f"{workload}: {n} replicas x {setup.num_blocks:,} blocks")
    if args.json:
        print(dump(result))
        return 0
    print(f"workload: {workload}\n{n} replicas of {setup.model.name} on {setup.model.tp} x {setup.hw.name}, "
          f"{setup.num_blocks:,} blocks each (tool pauses, prefix-cache tiers and forks not modelled)")
    print(f"{'router':<28} {'hit rate':>8} {'TTFT p50 s':>10} {'TTFT p99 s':>10} {'calls/replica':>14}")
    for r in [*rows, one]:
        spread = f"{min(r['calls_per_replica'])}-{max(r['calls_per_replica'])}"
        print(f"{r['router']:<28} {r['hit_rate']:>8.3f} {r['ttft_p50_s']:>10.3f} {r['ttft_p99_s']:>10.3f} "
              f"{spread:>14}")
    return 0


def plot_routers(rows: list[dict], one: dict, path: str, title: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    labels = [r["router"] for r in rows] + ["one cache"]
    all_rows = [*rows, one]
    fig, (left, right) = plt.subplots(1, 2, figsize=(11, 4))
    left.bar(labels, [r["hit_rate"] for r in all_rows], color=["tab:blue"] * len(rows) + ["tab:gray"])
    left.set(ylabel="prefix hit rate (eq. 2)", title="hit rate")
    x = np.arange(len(all_rows))
    right.bar(x - 0.2, [r["ttft_p50_s"] for r in all_rows], 0.4, label="p50")
    right.bar(x + 0.2, [r["ttft_p99_s"] for r in all_rows], 0.4, label="p99")
    right.set(xticks=x, xticklabels=labels, ylabel="TTFT (s)", title="time to first token")
    right.legend()
    for ax in (left, right):
        ax.tick_params(axis="x", labelrotation=20)
    fig.suptitle(title, fontsize=9)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)
