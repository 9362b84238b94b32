"""`trajserve bench products`: one decoder layer's quantized weight products
of a catalog model's shape, on AMX-INT8 tiles against the VNNI kernel, by
stored format and input rows.

    trajserve bench products --shape smollm2-1.7b --rows 16,32,64,512

The layer is q|k|v, o, the fused gate|up with SiLU, and down, each a
random valid matrix of the format (`QuantizedWeight.random_blocks`: the
kernels' work does not depend on the values); the input rows are what a
decode batch or a prefill chunk multiplies. The two paths alternate in one
process, `--repeats` times each, and the table gives the medians, their
ratio (the machine is shared: compare within one run) and what the tiles
arm ran: below a format's tile rows (quant_kernels.c AMX_MIN_ROWS), or for
a format without tiles, both arms run VNNI and the ratio is the noise.
Where the CPU has no AMX-INT8 there is nothing to compare and it says so.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def add_parser(sub) -> None:
    p = sub.add_parser("products", help="a layer's quantized products on AMX-INT8 tiles against VNNI, by format")
    p.add_argument("--shape", default="smollm2-1.7b", help="a catalog model (trajserve/plan/catalog.toml)")
    p.add_argument("--formats", default=None, help="comma-separated stored formats (default: every one the kernels "
                                                   "run as stored: q8_0, q4_0, q4_1, q4_k, q5_k, q6_k, mxfp4)")
    p.add_argument("--rows", default="16,32,64,512", help="input rows: decode batch sizes, prefill chunk tokens")
    p.add_argument("--repeats", type=int, default=9)
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    import numpy as np
    import torch

    from trajserve.bench.common import command_line, machine_info
    from trajserve.model import cpu_kernels
    from trajserve.model.quant import STORED_FORMATS, QuantizedWeight
    from trajserve.plan.catalog import get_model

    formats = [f.strip() for f in args.formats.split(",") if f.strip()] if args.formats else list(STORED_FORMATS)
    unknown = [f for f in formats if f not in STORED_FORMATS]
    if unknown:
        raise ValueError(f"--formats: {', '.join(unknown)} not among {', '.join(STORED_FORMATS)}")
    rows = [int(r) for r in args.rows.split(",")]
    kernels = cpu_kernels.load()
    if kernels is None or not kernels.amx_int8:
        print("bench products: this CPU (or build) runs no AMX-INT8 tiles; nothing to compare")
        return 1
    tiles, vnni = kernels.with_paths(amx_int8=True), kernels.with_paths(amx_int8=False)
    c = get_model(args.shape).config
    h, inter, q = c.hidden_size, c.intermediate_size, c.num_heads * c.head_dim
    qkv = q + 2 * c.num_kv_heads * c.head_dim
    rng = np.random.default_rng(0)
    results = []
    for fmt in formats:
        w = {name: QuantizedWeight.random_blocks(fmt, n, k, rng).pack()
             for name, n, k in (("qkv", qkv, h), ("o", h, q), ("gate", inter, h), ("up", inter, h), ("down", h, inter))}
        for m in rows:
            x = {k: torch.from_numpy(rng.standard_normal((m, k), dtype=np.float32))
                 for k in {h, inter, q}}

            def layer(K) -> float:
                t = time.perf_counter()
                K.qlinear(x[h], w["qkv"])
                K.qlinear(x[q], w["o"])
                K.qgate_up_silu(x[h], w["gate"], w["up"])
                K.qlinear(x[inter], w["down"])
                return time.perf_counter() - t

            times: dict[str, list[float]] = {"tiles": [], "vnni": []}
            layer(tiles)  # warm: the tile state, the caches
            layer(vnni)
            for _ in range(args.repeats):
                times["tiles"].append(layer(tiles))
                times["vnni"].append(layer(vnni))
            t, v = statistics.median(times["tiles"]), statistics.median(times["vnni"])
            from_rows = kernels.tile_rows(fmt)
            runs = "tiles" if from_rows and m >= from_rows else "VNNI (no tile path)" if not from_rows \
                else f"VNNI (tiles from {from_rows} rows)"
            results.append({"format": fmt, "rows": m, "tiles_ms": t * 1e3, "vnni_ms": v * 1e3, "tiles_speedup": v / t,
                            "tiles_arm_runs": runs})
    out = {"command": command_line(), "machine": machine_info(), "shape": args.shape, "repeats": args.repeats,
           "results": results}
    if not args.json:
        print(f"{args.shape}: one layer's products (q|k|v, o, gate|up, down), median of {args.repeats}")
        print(f"{'format':>7} {'rows':>5} {'tiles ms':>9} {'VNNI ms':>9} {'tiles / VNNI':>13}  the tiles arm runs")
        for r in results:
            print(f"{r['format']:>7} {r['rows']:>5} {r['tiles_ms']:>9.2f} {r['vnni_ms']:>9.2f} "
                  f"{r['tiles_speedup']:>12.2f}x  {r['tiles_arm_runs']}")
        print("JSON:")
    print(json.dumps(out))
    return 0
