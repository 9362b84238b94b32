"""The numbers the cost model needs: one device (peak FLOP/s, bandwidth,
efficiencies, fixed overhead, links) and one model split over TP devices.

Both come from the plan catalog (trajserve/plan/catalog.toml, with sources),
or from a hardware profile JSON that `trajserve calibrate` wrote after
measuring the real engine. A profile's rates are *effective* rates (what the
engine reached), so it carries MFU = MBU = 1.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from trajserve.config import MLASpec, ModelConfig, MoESpec, WindowSpec
from trajserve.plan import memory_budget, model_shapes
from trajserve.plan.catalog import DeviceSpec, ModelSpec
from trajserve.plan.kv_format import m_token, storage_format

PROFILE_KIND = "trajserve-hardware-profile"


@dataclass(frozen=True, slots=True)
class Hardware:
    """One accelerator; a TP replica is tp identical ones."""
    name: str
    peak_flops: float            # P: dense FLOP/s per device
    bandwidth: float             # beta: memory bytes/s per device
    mfu: float = 0.45            # achieved share of P (inference-optimization 8.6.3)
    mbu: float = 0.7             # achieved share of beta (ibid.)
    fixed_overhead_s: float = 0.002   # per step: kernel launches, host scheduling, sync
    per_seq_overhead_s: float = 0.0   # per sequence in the step (host-side prepare; calibrated CPUs)
    attention_flops: float = 0.0      # FLOP/s of the attention kernel; 0 = same as peak_flops
    kv_bandwidth: float = 0.0         # bytes/s the attention kernel reads KV at; 0 = same as bandwidth
    host_link_bandwidth: float = 0.0  # bytes/s per direction per device (PCIe, NVLink-C2C)
    nvme_bandwidth: float = 0.0       # bytes/s per device
    memory_bytes: float = 0.0         # C_HBM per device (eq. 3)
    source: str = ""

    def __post_init__(self) -> None:
        if self.peak_flops <= 0 or self.bandwidth <= 0:
            raise ValueError(f"{self.name}: peak FLOP/s and bandwidth must be known (> 0) to simulate; "
                             "calibrate this machine (trajserve calibrate) and pass --profile")
        for f in ("mfu", "mbu"):
            v = getattr(self, f)
            if not 0 < v <= 1:
                raise ValueError(f"{f} must be in (0, 1], got {v}")
        if self.fixed_overhead_s < 0 or self.per_seq_overhead_s < 0:
            raise ValueError("step overheads must be >= 0")

    @classmethod
    def from_device(cls, dev: DeviceSpec, mfu: float = 0.45, mbu: float = 0.7,
                    fixed_overhead_s: float = 0.002) -> Hardware:
        return cls(name=dev.name, peak_flops=dev.bf16_flops, bandwidth=dev.hbm_bandwidth, mfu=mfu, mbu=mbu,
                   fixed_overhead_s=fixed_overhead_s, host_link_bandwidth=dev.host_link_bandwidth,
                   nvme_bandwidth=dev.nvme_bandwidth, memory_bytes=dev.memory_bytes, source=dev.source)

    @classmethod
    def from_profile(cls, profile: dict) -> Hardware:
        d = profile["device"]
        return cls(name=d["name"], peak_flops=d["peak_flops"], bandwidth=d["bandwidth"], mfu=1.0, mbu=1.0,
                   fixed_overhead_s=d["fixed_overhead_s"], per_seq_overhead_s=d.get("per_seq_overhead_s", 0.0),
                   attention_flops=d.get("attention_flops", 0.0), kv_bandwidth=d.get("kv_bandwidth", 0.0),
                   host_link_bandwidth=d.get("host_link_bandwidth", 0.0),
                   nvme_bandwidth=d.get("nvme_bandwidth", 0.0), memory_bytes=d.get("memory_bytes", 0.0),
                   source=f"calibrated profile ({d.get('source', 'trajserve calibrate')})")


@dataclass(frozen=True, slots=True)
class ModelCost:
    """Per-token constants of one model, whole-model figures plus its TP split."""
    name: str
    config: ModelConfig
    matmul_params: int        # N multiplied per new token: 2 N FLOPs (projections, MLP)
    head_params: int          # LM head: runs only on rows whose logits are sampled
    weight_read_bytes: float  # D_w: bytes of weights one step streams (inference-optimization 8.2.1)
    m_token: float            # eq. 1, kv-cache-management: KV bytes per token, whole model
    tp: int = 1
    kv_share: float = 1.0     # share of m_token one device holds (H_kv / TP, at least one head)

    @property
    def num_layers(self) -> int:
        return self.config.num_layers

    @property
    def q_dim(self) -> int:
        return self.config.num_heads * self.config.head_dim

    @property
    def m_token_device(self) -> float:
        return self.m_token * self.kv_share

    def block_bytes_device(self, block_size: int) -> float:
        return self.m_token_device * block_size

    @classmethod
    def from_spec(cls, spec: ModelSpec, tp: int = 1, kv_dtype: str = "bf16",
                  weight_dtype: str | None = None) -> ModelCost:
        cfg = spec.config
        memory_budget.check_parallelism(cfg, tp, 1)
        read = model_shapes.decode_read_params(cfg)
        if weight_dtype is None and spec.weight_bytes is not None:
            # A GGUF's file size is its resident size; scale it to the part a step reads.
            w_read = spec.weight_bytes * read / spec.params
        else:
            w_read = read * float(storage_format(weight_dtype or spec.dtype, "weight dtype").bytes_per_value)
        return cls(name=spec.name, config=cfg, matmul_params=model_shapes.matmul_params(cfg),
                   head_params=model_shapes.lm_head_params(cfg), weight_read_bytes=w_read,
                   m_token=float(m_token(cfg, kv_dtype)), tp=tp,
                   kv_share=memory_budget.kv_share_per_device(cfg, tp, 1))

    @classmethod
    def from_profile(cls, profile: dict) -> ModelCost:
        m = profile["model"]
        cfg = config_from_dict(m["config"])
        return cls(name=m["name"], config=cfg, matmul_params=m["matmul_params"], head_params=m["head_params"],
                   weight_read_bytes=m["weight_read_bytes"], m_token=m["m_token"])

    def to_profile(self) -> dict:
        from dataclasses import asdict

        return {"name": self.name, "config": asdict(self.config), "matmul_params": self.matmul_params,
                "head_params": self.head_params, "weight_read_bytes": self.weight_read_bytes,
                "m_token": self.m_token}


def config_from_dict(d: dict) -> ModelConfig:
    """A ModelConfig written by asdict (a profile's): its nested specs back as theirs."""
    nested = {"moe": MoESpec, "mla": MLASpec, "window": WindowSpec}
    d = dict(d)
    for key, cls in nested.items():
        if d.get(key) is not None:
            d[key] = cls(**{k: tuple(v) if isinstance(v, list) else v for k, v in d[key].items()})
    return ModelConfig(**d)


def load_profile(path: str | Path) -> dict:
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"hardware profile {str(p)!r} not found; write one with: trajserve calibrate --out {p}")
    try:
        doc = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ValueError(f"hardware profile {str(p)!r} is not valid JSON: {e}") from None
    if doc.get("kind") != PROFILE_KIND:
        raise ValueError(f"{str(p)!r} is not a trajserve hardware profile (kind={doc.get('kind')!r})")
    return doc
