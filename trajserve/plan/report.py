"""A plan as a readable table or as JSON."""
from __future__ import annotations

import dataclasses
import json

from trajserve.plan.planner import Plan
from trajserve.units import gb, gib, kib, seconds


def to_json(p: Plan) -> str:
    return json.dumps(dataclasses.asdict(p), indent=2)


def _table(header: list[str], rows: list[list[str]]) -> list[str]:
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(header)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return [fmt.format(*header), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in rows)]


def to_text(p: Plan) -> str:
    lines = [
        f"{p.model} on {p.num_gpus} x {p.device} (TP={p.tp}, PP={p.pp}, {p.replicas} replica(s))",
        f"  m_token (eq. 1)         {p.m_token:,.0f} bytes ({kib(p.m_token)}) {p.kv_dtype}; "
        f"{p.m_token_device:,.0f} bytes per device",
        f"  weights (eq. 4)         {gb(p.weights_per_device)} per device ({p.weight_dtype})",
        f"  reserve                 {gb(p.reserve_per_device)} per device (activations + runtime)",
        f"  KV pool (eq. 5)         {gb(p.kv_pool_per_device)} per device of {gb(p.memory_per_device)} "
        f"({gib(p.memory_per_device)}); {gb(p.kv_pool_total)} in all",
        f"  usable after headroom   {p.token_capacity:,} tokens per replica "
        f"({p.headroom:.0%} headroom, blocks of {p.block_size} = {kib(p.block_bytes_device)} per device)",
        "",
    ]
    shared = any(r.max_shared is not None for r in p.rows)
    header = ["context", "output", "KV/traj", "B max"]
    if shared:
        header += ["shared", "B shared"]
    header += ["tail waste", "reload", "recompute", "break-even"]
    rows = []
    for r in p.rows:
        row = [f"{r.context:,}", f"{r.output_tokens:,}", gb(r.kv_bytes), f"{r.max_unshared:,}"]
        if shared:
            row += [f"{r.shared_tokens:,}", f"{r.max_shared:,}"]
        row += [f"{r.tail_waste_fraction:.3%}", seconds(r.reload_host_s), seconds(r.recompute_s),
                seconds(r.break_even_wait_s)]
        rows.append(row)
    lines += _table(header, rows)
    lines += ["",
              "B max: trajectories that fit with no sharing (eq. 6); B shared: with the shared prefix stored",
              "once per replica (eq. 7). reload: one way over the host link, all devices in parallel;",
              "break-even: offload when the tool wait is longer (box 0.6)."]
    if p.prefix is not None:
        x = p.prefix
        lines += ["",
                  f"Shared prefix of {x.tokens:,} tokens ({gb(x.bytes)}) kept in host memory (8.3.4):",
                  f"  recompute T_r {seconds(x.recompute_s)}, fetch T_f {seconds(x.fetch_s)}, "
                  f"maintain T_m {seconds(x.maintain_s)}",
                  f"  V_h at p_h={x.hit_prob:.0%}: {seconds(x.value_s) if x.value_s >= 0 else '-' + seconds(-x.value_s)}"
                  f"; worth keeping when p_h > {x.threshold_hit_prob:.1%}"]
    return "\n".join(lines)
