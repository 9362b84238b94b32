"""The capacity plan: one model on one kind of accelerator, for several context lengths.

Scopes: memory terms (eqs. 3-5) are per device; a trajectory's KV is spread
over the TP x PP devices of one model replica, each holding its share of
every block, so capacity is counted per replica on per-device numbers and
multiplied by the number of replicas. A shared prefix is stored once per
replica.
"""
from __future__ import annotations

import math
from dataclasses import dataclass, field

from trajserve.plan import concurrency, keep_offload, memory_budget, model_shapes, retention, tail_waste
from trajserve.plan.catalog import DeviceSpec, ModelSpec
from trajserve.plan.flops import compute_time, forward_flops
from trajserve.plan.kv_format import m_token, storage_format


@dataclass(slots=True)
class PlanRequest:
    model: ModelSpec
    device: DeviceSpec
    contexts: tuple[int, ...] = (8192, 32768, 131072)
    num_gpus: int | None = None        # default: tp * pp (one replica)
    tp: int = 1
    pp: int = 1
    output_tokens: int = 0             # K_avg
    shared_prefix: int = 0             # S_shared, tokens stored once per replica
    shared_fraction: float | None = None  # sigma: shared = sigma * context, per context
    headroom: float = 0.1              # Pool_headroom as a fraction of M_KV (box 0.7)
    kv_dtype: str = "bf16"
    weight_dtype: str | None = None    # default: the model's dtype
    block_size: int = 16
    reserve_bytes: float = 4.5e9       # M_activations + M_runtime per device (box 0.7)
    memory_bytes: float | None = None  # override C_HBM per device
    mfu: float = 0.45                  # prefill efficiency (boxes 0.4, 0.6)
    hit_prob: float = 0.5              # p_h for the prefix retention value
    dram_cost_ratio: float = 0.0       # mu_DRAM / mu_HBM for the break-even wait


@dataclass(slots=True)
class ContextRow:
    context: int
    output_tokens: int
    shared_tokens: int
    stored_tokens: int                 # M + K - 1
    kv_bytes: float                    # one unshared trajectory, block-rounded, whole replica
    max_unshared: int                  # eq. 6, all replicas
    max_shared: int | None             # eq. 7, all replicas; None without sharing
    tail_waste_fraction: float         # at max_unshared, share of the pool
    reload_host_s: float | None
    round_trip_host_s: float | None
    reload_nvme_s: float | None
    recompute_s: float | None
    break_even_wait_s: float | None


@dataclass(slots=True)
class PrefixRetention:
    tokens: int
    bytes: float
    recompute_s: float
    fetch_s: float
    maintain_s: float
    hit_prob: float
    value_s: float                     # V_h
    threshold_hit_prob: float


@dataclass(slots=True)
class Plan:
    model: str
    model_source: str
    device: str
    device_source: str
    num_gpus: int
    tp: int
    pp: int
    replicas: int
    kv_dtype: str
    weight_dtype: str
    block_size: int
    headroom: float
    m_token: float                     # eq. 1, whole model
    m_token_device: float
    block_bytes_device: float
    memory_per_device: float
    weights_per_device: float          # eq. 4
    reserve_per_device: float
    kv_pool_per_device: float          # eq. 5
    kv_pool_total: float
    token_capacity: int                # per replica, after headroom
    rows: list[ContextRow] = field(default_factory=list)
    prefix: PrefixRetention | None = None


def _validate(r: PlanRequest) -> int:
    if not r.contexts:
        raise ValueError("at least one context length is needed")
    if any(c < 1 for c in r.contexts):
        raise ValueError(f"context lengths must be >= 1 token, got {list(r.contexts)}")
    if r.output_tokens < 0:
        raise ValueError(f"output tokens must be >= 0, got {r.output_tokens}")
    if r.block_size < 1:
        raise ValueError(f"block size must be >= 1, got {r.block_size}")
    if r.shared_prefix < 0:
        raise ValueError(f"shared prefix must be >= 0 tokens, got {r.shared_prefix}")
    if r.shared_fraction is not None and not 0.0 <= r.shared_fraction < 1.0:
        raise ValueError(f"shared fraction sigma must be in [0, 1), got {r.shared_fraction}")
    if r.shared_fraction is not None and r.shared_prefix:
        raise ValueError("give a shared prefix in tokens or a shared fraction, not both")
    if not 0.0 <= r.headroom < 1.0:
        raise ValueError(f"headroom must be in [0, 1), got {r.headroom}")
    if not 0.0 < r.mfu <= 1.0:
        raise ValueError(f"mfu must be in (0, 1], got {r.mfu}")
    if not 0.0 <= r.hit_prob <= 1.0:
        raise ValueError(f"hit probability must be in [0, 1], got {r.hit_prob}")
    if not 0.0 <= r.dram_cost_ratio < 1.0:
        raise ValueError(f"dram cost ratio mu_DRAM/mu_HBM must be in [0, 1), got {r.dram_cost_ratio}")
    if r.reserve_bytes < 0:
        raise ValueError(f"reserve must be >= 0 bytes, got {r.reserve_bytes}")
    memory_budget.check_parallelism(r.model.config, r.tp, r.pp)
    group = r.tp * r.pp
    n = r.num_gpus if r.num_gpus is not None else group
    if n < 1:
        raise ValueError(f"num-gpus must be >= 1, got {n}")
    if n % group:
        raise ValueError(f"num-gpus={n} is not a multiple of tp*pp={group}")
    return n // group


def _shared_for(r: PlanRequest, context: int) -> int:
    shared = math.floor(r.shared_fraction * context) if r.shared_fraction is not None else r.shared_prefix
    if shared > context:
        raise ValueError(f"shared prefix ({shared} tokens) is longer than the context ({context} tokens); "
                         f"use contexts >= {shared} or --shared-fraction")
    return shared


def _or_none(fn, *args):
    try:
        return fn(*args)
    except ValueError:  # a device value that is unknown until calibration
        return None


def plan(r: PlanRequest) -> Plan:
    replicas = _validate(r)
    cfg, dev = r.model.config, r.device
    group = r.tp * r.pp
    kv_fmt = storage_format(r.kv_dtype, "kv dtype")
    m_tok = m_token(cfg, kv_fmt)
    m_dev = m_tok * memory_budget.kv_share_per_device(cfg, r.tp, r.pp)

    if r.weight_dtype is None and r.model.weight_bytes is not None:
        w_name, w_dev = r.model.dtype, r.model.weight_bytes / group
    else:
        w_fmt = storage_format(r.weight_dtype or r.model.dtype, "weight dtype")
        w_name = w_fmt.name
        w_dev = memory_budget.weights_per_device(r.model.params, float(w_fmt.bytes_per_value), r.tp, r.pp)
    c_dev = float(r.memory_bytes if r.memory_bytes is not None else dev.memory_bytes)
    pool_dev = memory_budget.kv_pool(c_dev, w_dev, r.reserve_bytes)
    blocks = concurrency.pool_blocks(pool_dev, m_dev, r.block_size, r.headroom)

    out = Plan(model=r.model.name, model_source=r.model.source, device=dev.name, device_source=dev.source,
               num_gpus=replicas * group, tp=r.tp, pp=r.pp, replicas=replicas, kv_dtype=kv_fmt.name,
               weight_dtype=w_name, block_size=r.block_size, headroom=r.headroom, m_token=m_tok,
               m_token_device=m_dev, block_bytes_device=m_dev * r.block_size, memory_per_device=c_dev,
               weights_per_device=w_dev, reserve_per_device=r.reserve_bytes, kv_pool_per_device=pool_dev,
               kv_pool_total=pool_dev * replicas * group, token_capacity=blocks * r.block_size)

    # Each device moves its own share over its own link, all at once: the
    # replica's bytes go at link x (m_token / m_token per device), which is
    # link x TP x PP until TP passes the KV heads (each rank then holds a
    # whole head that others hold too, and the copies do not add bandwidth).
    links = m_tok / m_dev
    host_bw = dev.host_link_bandwidth * links
    nvme_bw = dev.nvme_bandwidth * links
    # One sequence's prefill runs its PP stages one after another: only TP adds FLOP/s.
    prefill_peak = dev.bf16_flops * r.tp
    n_matmul = model_shapes.matmul_params(cfg)
    q_dim = cfg.num_heads * cfg.head_dim
    sharing = r.shared_fraction is not None or r.shared_prefix > 0
    for ctx in r.contexts:
        shared = _shared_for(r, ctx)
        stored = concurrency.stored_tokens(ctx, r.output_tokens)
        # Sliding-window layers keep at most their window: the share of eq. 1's bytes this context holds.
        held = cfg.kv_bytes(stored, 1) / (cfg.kv_bytes_per_token(1) * stored)
        kv_bytes = concurrency.blocks_for(stored, r.block_size) * r.block_size * m_tok * held
        unshared = concurrency.max_trajectories(pool_dev, m_dev * held, ctx, r.output_tokens, headroom=r.headroom,
                                                block_size=r.block_size)
        with_prefix = concurrency.max_trajectories(pool_dev, m_dev * held, ctx, r.output_tokens,
                                                   shared_tokens=shared, headroom=r.headroom,
                                                   block_size=r.block_size)
        recompute = _or_none(compute_time, forward_flops(n_matmul, cfg.num_layers, q_dim, stored),
                             prefill_peak, r.mfu)
        out.rows.append(ContextRow(
            context=ctx, output_tokens=r.output_tokens, shared_tokens=shared, stored_tokens=stored,
            kv_bytes=kv_bytes, max_unshared=unshared * replicas,
            max_shared=with_prefix * replicas if sharing else None,
            tail_waste_fraction=tail_waste.waste_fraction(unshared, r.block_size, m_dev * held, pool_dev),
            reload_host_s=_or_none(keep_offload.transfer_time, kv_bytes, host_bw),
            round_trip_host_s=_or_none(keep_offload.round_trip_time, kv_bytes, host_bw),
            reload_nvme_s=_or_none(keep_offload.transfer_time, kv_bytes, nvme_bw),
            recompute_s=recompute,
            break_even_wait_s=_or_none(keep_offload.break_even_wait, kv_bytes, host_bw, r.dram_cost_ratio),
        ))

    if sharing:
        out.prefix = _prefix_retention(r, m_tok, n_matmul, q_dim, prefill_peak, host_bw)
    return out


def _prefix_retention(r: PlanRequest, m_tok: float, n_matmul: int, q_dim: int, peak: float,
                      host_bw: float) -> PrefixRetention | None:
    """V_h of keeping the shared prefix in host memory (inference-optimization 8.3.4)."""
    tokens = r.shared_prefix or math.floor((r.shared_fraction or 0.0) * min(r.contexts))
    if tokens == 0 or peak <= 0 or host_bw <= 0:
        return None
    nbytes = tokens * m_tok
    t_r = compute_time(forward_flops(n_matmul, r.model.config.num_layers, q_dim, tokens), peak, r.mfu)
    t_f = keep_offload.transfer_time(nbytes, host_bw)
    t_m = t_f  # maintenance = the one write-back to the host (8.3.4)
    return PrefixRetention(tokens=tokens, bytes=nbytes, recompute_s=t_r, fetch_s=t_f, maintain_s=t_m,
                           hit_prob=r.hit_prob, value_s=retention.retention_value(r.hit_prob, t_r, t_f, t_m),
                           threshold_hit_prob=retention.threshold_hit_prob(t_r, t_f, t_m))
