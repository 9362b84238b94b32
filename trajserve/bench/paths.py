"""`trajserve bench throughput --paths`: every execution path this machine
runs, side by side, and what `--dtype auto --quantization auto` picks.

A path is (weight format, compute dtype, KV dtype, kernels): the GGUF's
blocks in each kernel build the CPU runs (avx512, avx2) over a bfloat16 and
a float32 KV pool, float32 weights and KV in the C kernels,
torch's bfloat16 forward where the CPU has native bf16, torch's float32
forward. Each runs `bench throughput --json` in its own process (a fresh
heap, its own kernel build, no state from the path before), one after the
other, so the figures of one run compare as ratios. The table gives each
path's tokens/s per batch size, prefill tokens/s, the weight bytes a decode
step reads and the step's ratio to their bandwidth floor, then auto's
distance from the fastest other path at each figure (the issue's bound:
10 %; the path auto resolves to, which also runs by name, is left out of
that: the two differ only by noise).
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

from trajserve.bench.common import command_line, machine_info

_CLI = "import sys; from trajserve.cli import main; sys.exit(main())"


def machine_paths() -> list[dict]:
    """name, extra flags and environment of each path this machine runs."""
    from trajserve.engine.dtype import cpu_has_native_bf16
    from trajserve.model import cpu_kernels

    paths = [{"name": "auto", "flags": [], "env": {}}]
    for isa in cpu_kernels.supported_isas() if cpu_kernels.load() is not None else []:
        for kv in ("bfloat16", "float32"):  # a bf16 pool's prefill runs on AMX tiles where the build has them
            paths.append({"name": f"quantized ({isa}), {kv} KV",
                          "flags": ["--dtype", "float32", "--quantization", "auto", "--kv-cache-dtype", kv],
                          "env": {"TRAJSERVE_CPU_ISA": isa}})
    if cpu_kernels.load() is not None:
        paths.append({"name": "float32 C kernels", "flags": ["--dtype", "float32", "--quantization", "none",
                                                             "--kv-cache-dtype", "float32"], "env": {}})
    if cpu_has_native_bf16():
        paths.append({"name": "bfloat16 torch", "flags": ["--dtype", "bfloat16"], "env": {}})
    paths.append({"name": "float32 torch", "flags": ["--dtype", "float32", "--no-cpu-kernels"], "env": {}})
    return paths


def _passed_flags(args: argparse.Namespace) -> list[str]:
    flags = ["--batch-sizes", args.batch_sizes, "--context", str(args.context), "--decode-steps",
             str(args.decode_steps), "--prefill-tokens", str(args.prefill_tokens), "--repeats", str(args.repeats),
             "--cached-prefix", str(args.cached_prefix)]
    for name, flag in (("model", "--model"), ("num_threads", "--threads"), ("num_blocks", "--num-blocks")):
        if getattr(args, name, None) is not None:
            flags += [flag, str(getattr(args, name))]
    return flags


def value(r: dict, fig: str) -> float:
    """A path's figure: 'b=N' tokens/s at batch N, or 'prefill'."""
    return r["prefill_tokens_per_s"] if fig == "prefill" else r["tokens_per_s"][fig[2:]]


def auto_versus(ok: list[dict], figures: list[str]) -> tuple[str | None, dict]:
    """The path auto resolves to, and auto's ratio to the fastest other
    configuration at each figure. That path also runs by name: comparing
    the two would measure only the machine's noise, so it is left out."""
    auto = next((r for r in ok if r["path"] == "auto"), None)
    if auto is None:
        return None, {}
    twin = next((r["path"] for r in ok if r is not auto and r["config"] == auto["config"]), None)
    others = [r for r in ok if r is not auto and r["config"] != auto["config"]]
    versus = {}
    for fig in figures:
        best = max(others, key=lambda r: value(r, fig)) if others else auto
        versus[fig] = {"fastest": best["path"], "auto_over_fastest": value(auto, fig) / value(best, fig)}
    return twin, versus


def run(args: argparse.Namespace) -> int:
    results = []
    for path in machine_paths():
        cmd = [sys.executable, "-c", _CLI, "bench", "throughput", "--json", *_passed_flags(args), *path["flags"]]
        print(f"running {path['name']}: trajserve {' '.join(cmd[3:])}", file=sys.stderr, flush=True)
        proc = subprocess.run(cmd, env={**os.environ, **path["env"]}, capture_output=True, text=True)
        if proc.returncode != 0:
            results.append({"path": path["name"], "error": proc.stderr.strip().splitlines()[-1:]})
            continue
        r = json.loads(proc.stdout)
        results.append({"path": path["name"], "weights": r["weights"], "kernels": r["kernels"],
                        "config": [r["dtype"], r.get("kv_dtype"), r["quantization"], r["kernels"]],
                        "weight_bytes": r["weight_bytes"], "decode_floor_ms": r["decode_floor_ms"],
                        "read_bandwidth_GBps": r["read_bandwidth_GBps"],
                        "tokens_per_s": {str(d["batch"]): d["tokens_per_s"] for d in r["decode"]},
                        "batch1_step_over_floor": next((d["step_ms"] / r["decode_floor_ms"] for d in r["decode"]
                                                        if d["batch"] == 1), None),
                        "prefill_tokens_per_s": r["prefill"]["tokens_per_s"]})
    ok = [r for r in results if "error" not in r]
    figures = [*(f"b={b}" for b in args.batch_sizes.split(",")), "prefill"]


    twin, versus = auto_versus(ok, figures)
    out = {"command": command_line(), "machine": machine_info(), "paths": results, "auto_is": twin,
           "auto_vs_fastest": versus}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"\n{out['command']}\n{out['machine']['cpu']}, {out['machine']['cores']} cores\n")
    head = f"{'path':<32} {'weights':<28} {'MB/step':>8} {'step/floor':>10} " + " ".join(f"{f:>8}" for f in figures)
    print(head)
    for r in results:
        if "error" in r:
            print(f"{r['path']:<32} failed: {' '.join(r['error'])}")
            continue
        ratio = r["batch1_step_over_floor"]
        print(f"{r['path']:<32} {r['weights']:<28.28} {r['weight_bytes'] / 1e6:>8.1f} "
              f"{(f'{ratio:.2f}' if ratio else '-'):>10} " + " ".join(f"{value(r, f):>8.1f}" for f in figures))
    print("\n(tokens/s; step/floor: the batch-1 step over weight bytes / read bandwidth)")
    if twin is not None:
        print(f"auto runs {twin} (the two rows differ by the machine's noise); against the other paths:")
    for fig, v in versus.items():
        print(f"auto at {fig}: {v['auto_over_fastest']:.2f} of the fastest ({v['fastest']})")
    print("\nJSON:")
    print(json.dumps(out))
    return 0
