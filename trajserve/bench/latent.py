"""`trajserve bench latent`: latent attention's decode (DeepSeek's MLA,
model/mla.py) over a paged pool, torch's paged attention against
mla_attention.c, at a model's widths and a grid of batch sizes and context
lengths.

    trajserve bench latent --heads 16 --rank 512 --rope 64 --batch 1,8 --context 1024,4096

Each decode row's H absorbed queries attend over its sequence's cached rows
[latent, k_pe] (rank + rope values a token) and weigh the latent; the two
paths run on the same random pool and queries, alternating `--repeats`
times, and the table gives the medians, their ratio (compare within one
run: the machine is shared), the rows the kernel read per second and the
largest difference between the two outputs.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time


def add_parser(sub) -> None:
    p = sub.add_parser("latent", help="latent attention's decode: torch's paged path against the C kernel")
    p.add_argument("--heads", type=int, default=16, help="query heads (DeepSeek-V2-Lite: 16, V3: 128)")
    p.add_argument("--rank", type=int, default=512, help="kv_lora_rank: the latent's values")
    p.add_argument("--rope", type=int, default=64, help="qk_rope_head_dim: the RoPE key's values")
    p.add_argument("--batch", default="1,8", help="decode rows")
    p.add_argument("--context", default="1024,4096", help="each row's cached tokens")
    p.add_argument("--block-size", type=int, default=16)
    p.add_argument("--repeats", type=int, default=15)
    p.add_argument("--json", action="store_true", help="print only JSON")
    p.set_defaults(func=run)


def _metas(n: int, ctx: int, bs: int):
    """Decode metadata for n rows of ctx tokens each, their blocks back to
    back: the pair tensors torch's path reads, the tables the kernel reads."""
    import numpy as np
    import torch

    from trajserve.model.attention import AttentionMetadata

    nb = -(-ctx // bs)
    ix = lambda v: torch.as_tensor(np.asarray(v), dtype=torch.int64)  # noqa: E731
    tables = ix(np.arange(n * nb))
    pos = np.tile(np.arange(nb), n)[:, None] * bs + np.arange(bs)[None, :]
    rows = ix(np.arange(n))
    pairs = AttentionMetadata(None, None, rows, ix(np.repeat(np.arange(n), nb)), tables,
                              torch.from_numpy(pos < ctx), n, [])
    kernel = AttentionMetadata(None, None, rows, None, None, None, n, [], dec_tables=tables,
                               dec_table_start=ix(np.arange(n) * nb), dec_ctx=ix([ctx] * n))
    return n * nb, pairs, kernel


def run(args: argparse.Namespace) -> int:
    import torch

    from trajserve.bench.common import command_line, machine_info
    from trajserve.model import cpu_kernels
    from trajserve.model.attention import paged_attention
    from trajserve.model.mla import latent_attention

    kernels = cpu_kernels.load()
    if kernels is None:
        raise ValueError("bench latent compares the C kernel with torch: the kernels did not load here")
    dk, dv, scale = args.rank + args.rope, args.rank, (args.rank + args.rope) ** -0.5
    g = torch.Generator().manual_seed(0)
    rows = []
    for n in (int(x) for x in args.batch.split(",")):
        for ctx in (int(x) for x in args.context.split(",")):
            blocks, pairs, meta = _metas(n, ctx, args.block_size)
            pool = torch.randn(blocks, 1, args.block_size, dk, generator=g)
            q = torch.randn(n, args.heads, dk, generator=g)
            paths = {"torch": lambda: paged_attention(q, pool, pool, pairs, scale)[..., :dv],
                     "kernel": lambda: latent_attention(kernels, q, pool, meta, scale, dv)}
            diff = (paths["torch"]() - paths["kernel"]()).abs().max().item()
            times = {k: [] for k in paths}
            for _ in range(args.repeats):
                for name, f in paths.items():
                    t = time.perf_counter()
                    f()
                    times[name].append(time.perf_counter() - t)
            med = {k: statistics.median(v) for k, v in times.items()}
            rows.append({"batch": n, "context": ctx, "torch_ms": med["torch"] * 1e3, "kernel_ms": med["kernel"] * 1e3,
                         "speedup": med["torch"] / med["kernel"],
                         "kernel_read_gb_s": n * ctx * dk * 4 / med["kernel"] / 1e9, "max_abs_diff": diff})
    report = {"command": command_line(), "machine": machine_info(), "isa": kernels.isa,
              "widths": {"heads": args.heads, "rank": args.rank, "rope": args.rope, "block_size": args.block_size},
              "rows": rows}
    if args.json:
        print(json.dumps(report, indent=2))
        return 0
    print(f"latent attention's decode, {args.heads} heads over rows of {args.rank} + {args.rope} values "
          f"(float32 pool, blocks of {args.block_size}), C kernels ({kernels.isa}); medians of {args.repeats}")
    print(f"{'batch':>5} {'context':>7} {'torch ms':>9} {'kernel ms':>9} {'speedup':>7} {'kernel GB/s':>11} "
          f"{'max diff':>9}")
    for r in rows:
        print(f"{r['batch']:>5} {r['context']:>7} {r['torch_ms']:>9.2f} {r['kernel_ms']:>9.2f} {r['speedup']:>6.2f}x "
              f"{r['kernel_read_gb_s']:>11.1f} {r['max_abs_diff']:>9.1e}")
    print(json.dumps(report))
    return 0
