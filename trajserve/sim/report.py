"""`trajserve simulate` without --validate: run, print a table (or JSON), plot."""
from __future__ import annotations

import argparse
import sys

from trajserve.sim.build import SimSetup
from trajserve.sim.from_args import command_line, dump, sessions_factory, setup_from_args
from trajserve.sim.metrics import parse_slos, per_turn, summarize
from trajserve.sim.sweep import cache_size_sweep


def describe(setup: SimSetup) -> dict:
    hw, m = setup.hw, setup.model
    return {"hardware": hw.name, "tp": m.tp, "peak_flops": hw.peak_flops, "mfu": hw.mfu,
            "bandwidth": hw.bandwidth, "mbu": hw.mbu, "fixed_overhead_s": hw.fixed_overhead_s,
            "per_seq_overhead_s": hw.per_seq_overhead_s, "attention_flops": hw.attention_flops or hw.peak_flops,
            "host_link_bandwidth": hw.host_link_bandwidth, "nvme_bandwidth": hw.nvme_bandwidth,
            "hardware_source": hw.source, "model": m.name, "weight_read_bytes": m.weight_read_bytes,
            "m_token": m.m_token, "m_token_device": m.m_token_device, "num_blocks": setup.num_blocks,
            "block_size": setup.block_size, "pool": setup.pool_source,
            "max_num_seqs": setup.scheduler.max_num_seqs,
            "max_num_batched_tokens": setup.scheduler.max_num_batched_tokens,
            "max_prefill_chunk": setup.scheduler.max_prefill_chunk, "prefix_caching": setup.prefix_caching}


def run_simulate(args: argparse.Namespace) -> int:
    setup = setup_from_args(args)
    make_sessions, workload = sessions_factory(args)
    slos = parse_slos(args.slo)
    progress = args.progress and not args.json and sys.stderr.isatty()
    result: dict = {"command": command_line(), "setup": describe(setup), "workload": workload}
    if args.cache_blocks:
        result["sweep"] = cache_size_sweep(setup, make_sessions, args.cache_blocks,
                                           max_concurrency=args.max_concurrency, progress=progress)
        if args.sweep_plot:
            from trajserve.sim.plot import plot_hit_rate_sweep

            plot_hit_rate_sweep(result["sweep"], args.sweep_plot,
                                f"{setup.model.name} on {setup.model.tp} x {setup.hw.name}: {args.workload}")
    elif args.sweep_plot:
        raise ValueError("--sweep-plot needs --cache-blocks (the pool sizes to simulate)")
    if not args.cache_blocks or args.plot:
        sim, tokens = setup.simulator(max_concurrency=args.max_concurrency, progress=progress)
        res = sim.run(make_sessions(tokens))
        result["summary"] = summarize(res, slos)
        if args.workload == "agent":
            result["per_turn"] = per_turn(res)
        if args.plot:
            from trajserve.sim.plot import plot_u_kv

            plot_u_kv(res, args.plot, f"{setup.model.name} on {setup.model.tp} x {setup.hw.name}: {args.workload}")
    if args.json:
        print(dump(result))
    else:
        print_report(result, args)
    return 0


def print_pauses(p: dict, block_size: int) -> None:
    """Keep decisions and tier traffic of the tool pauses (sim/pauses.py)."""
    n = p["pauses"]
    hint = "true waits announced" if p["wait_hint"] == "exact" else "waits estimated from history"
    print(f"\ntool pauses: {n:,} ({p['mode']}, {hint}); host tier {p['host_capacity_bytes'] / 2**30:,.0f} GiB, "
          f"disk tier {p['disk_capacity_bytes'] / 2**30:,.0f} GiB")
    if not n:
        return
    dec = p["decisions"]
    print("keep decisions: " + ", ".join(f"{k} {dec.get(k, 0):,} ({dec.get(k, 0) / n * 100:.0f}%)"
                                         for k in ("keep", "host", "disk", "drop")))
    placed = p.get("placed", dec)
    if placed != dec:  # a tier without room passed the state down: say where it went
        print("placed (a full tier falls to the next): " + ", ".join(
            f"{k} {placed.get(k, 0):,}" for k in ("keep", "host", "disk", "drop")))
    out, inn, link = p["blocks_out"], p["blocks_in"], p["link_s"]
    print(f"blocks out/in: host {out.get('host', 0):,}/{inn.get('host', 0):,}, disk {out.get('disk', 0):,}/"
          f"{inn.get('disk', 0):,} (x {block_size} tokens); link time host {link.get('host', 0.0):.2f} s, "
          f"nvme {link.get('nvme', 0.0):.2f} s; steps waited for copies {p['copy_wait_s']:.2f} s")
    print(f"prefetches {p['prefetches']:,} (hits {p['prefetch_hits']:,}), resume stalls {p['resume_stalls']:,} "
          f"({p['resume_stall_s']:.2f} s); lease demotions {p['lease_demotions']:,}, pressure demotions "
          f"{p['pressure_demotions']:,}, stall drops {p['stall_drops']:,}; recomputed on resume "
          f"{p['recomputed_tokens']:,} tokens; peak host {p['host_peak_bytes'] / 1e9:,.1f} GB, "
          f"disk {p['disk_peak_bytes'] / 1e9:,.1f} GB")


def _ms(d: dict, k: str) -> str:
    v = d.get(k)
    return f"{v:>9.1f}" if v is not None else f"{'-':>9}"


def print_report(res: dict, args: argparse.Namespace) -> None:
    s = res["setup"]
    print(f"\n{res['command']}")
    print(f"hardware: {s['tp']} x {s['hardware']} (TP {s['tp']}): {s['peak_flops'] / 1e12:,.1f} TFLOP/s x MFU "
          f"{s['mfu']:.2f}, {s['bandwidth'] / 1e9:,.0f} GB/s x MBU {s['mbu']:.2f}, "
          f"{s['fixed_overhead_s'] * 1e3:.2f} ms per step"
          + (f" + {s['per_seq_overhead_s'] * 1e3:.3f} ms per sequence" if s["per_seq_overhead_s"] else ""))
    print(f"model: {s['model']}: weights read per step D_w = {s['weight_read_bytes'] / 1e9:.2f} GB, "
          f"m_token = {s['m_token'] / 1024:,.1f} KiB (eq. 1), {s['m_token_device'] / 1024:,.1f} KiB per device")
    print(f"pool: {s['num_blocks']:,} blocks x {s['block_size']} = {s['num_blocks'] * s['block_size']:,} tokens "
          f"({s['pool']}); budget {s['max_num_batched_tokens']} tokens/step, chunk <= {s['max_prefill_chunk']}, "
          f"<= {s['max_num_seqs']} sequences, prefix cache {'on' if s['prefix_caching'] else 'off'}")
    print(f"workload: {res['workload']}\n")
    if "summary" in res:
        m = res["summary"]
        print(f"{m['calls']:,} calls ({m['sequences']:,} sequences, {m['rejected']} rejected) in "
              f"{m['duration_s']:,.1f} s simulated; {m['steps']:,} steps, "
              f"{m['compute_bound_steps'] / max(m['steps'], 1) * 100:.0f}% compute-bound; "
              f"simulation took {m['wall_s']:.1f} s\n")
        print(f"{'latency ms':<10} {'mean':>9} {'p50':>9} {'p90':>9} {'p99':>9}")
        for key, label in (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2e_ms", "E2E")):
            d = m[key]
            print(f"{label:<10} {_ms(d, 'mean')} {_ms(d, 'p50')} {_ms(d, 'p90')} {_ms(d, 'p99')}")
        t = m["throughput"]
        print(f"\nthroughput: {t['requests_per_s']:.3f} calls/s, {t['output_tokens_per_s']:,.1f} output tokens/s, "
              f"{t['prompt_tokens_per_s']:,.0f} prompt tokens/s; {t['computed_tokens_per_s']:,.0f} tokens/s "
              f"through the model (prefill not served by the cache, and decode)")
        if m["goodput"]:
            g = m["goodput"]
            slo = ", ".join(f"{k} <= {v:g} ms" for k, v in g["slo_ms"].items())
            print(f"goodput (inference-optimization 8.6.2, {slo}): {g['requests_per_s']:.3f} calls/s "
                  f"({g['fraction'] * 100:.1f}% of calls)")
        print(f"prefix hit rate H_prefix (eq. 2): {m['prefix_hit_rate'] * 100:.2f}% "
              f"({m['cached_tokens']:,} of {m['prompt_tokens']:,} prompt tokens)")
        u = m["u_kv"]
        print(f"U_KV (eq. 8): time-weighted mean {u['mean'] * 100 if u['mean'] is not None else 0:.1f}%, "
              f"max {u['max'] * 100 if u['max'] is not None else 0:.1f}%; preemptions {m['preemptions']:,} "
              f"({m.get('swap_preemptions', 0):,} swapped), "
              f"evicted blocks {m['evicted_blocks']:,}, copy-on-write copies {m['cow_copies']:,}")
    if res.get("summary") and res["summary"].get("prefix_tiers"):
        t = res["summary"]["prefix_tiers"]
        print(f"\nprefix cache lower tiers: {t['spilled_blocks']:,} blocks spilled by LRU, {t['promoted_blocks']:,} "
              f"loaded back on hits ({t['loaded_host_blocks']:,} from host, {t['loaded_disk_blocks']:,} from disk); "
              f"{t['demoted_blocks']:,} host -> disk, {t['dropped_blocks']:,} dropped; holding {t['host_blocks']:,} "
              f"host + {t['disk_blocks']:,} disk blocks at the end")
    if res.get("summary") and res["summary"].get("pauses"):
        print_pauses(res["summary"]["pauses"], res["summary"]["block_size"])
    if res.get("per_turn"):
        print(f"\n{'turn':>4} {'calls':>6} {'prompt':>8} {'hit':>7} {'TTFT p50 ms':>12}")
        for r in res["per_turn"]:
            print(f"{r['turn']:>4} {r['calls']:>6} {r['prompt_tokens_median']:>8.0f} {r['hit_rate'] * 100:>6.1f}% "
                  f"{r['ttft_ms_p50']:>12.1f}")
    if res.get("sweep"):
        print("\nprefix hit rate vs KV pool size (same workload, one simulation per size):")
        print(f"{'blocks':>9} {'tokens':>11} {'hit':>7} {'evicted':>10} {'preempt':>8} {'TTFT p50 ms':>12} "
              f"{'out tok/s':>10} {'wall s':>7}")
        for r in res["sweep"]:
            if "error" in r:
                print(f"{r['num_blocks']:>9,} {r['tokens']:>11,}  {r['error']}")
                continue
            p50 = f"{r['ttft_ms_p50']:>12.1f}" if r["ttft_ms_p50"] is not None else f"{'-':>12}"
            print(f"{r['num_blocks']:>9,} {r['tokens']:>11,} {r['hit_rate'] * 100:>6.2f}% {r['evicted_blocks']:>10,} "
                  f"{r['preemptions']:>8,} {p50} {r['output_tokens_per_s']:>10,.1f} {r['wall_s']:>7.1f}")
    if args.plot:
        print(f"\nU_KV plot: {args.plot}")
    if args.sweep_plot:
        print(f"hit rate vs pool size plot: {args.sweep_plot}")
    print()
