"""Accelerator and model catalogs (catalog.toml), looked up by name or path."""
from __future__ import annotations

import functools
import os
import tomllib
from dataclasses import dataclass, replace
from importlib import resources
from pathlib import Path

from trajserve.config import MLASpec, ModelConfig, MoESpec, WindowSpec
from trajserve.plan import model_shapes


@dataclass(frozen=True, slots=True)
class DeviceSpec:
    key: str
    name: str
    memory_bytes: int           # C_HBM per device (eq. 3)
    hbm_bandwidth: float        # bytes/s; 0 = unknown
    bf16_flops: float           # dense FLOP/s; 0 = unknown
    host_link: str
    host_link_bandwidth: float  # bytes/s per direction; 0 = none/unknown
    nvme_bandwidth: float       # bytes/s per device; 0 = unknown
    source: str


@dataclass(frozen=True, slots=True)
class ModelSpec:
    key: str
    config: ModelConfig
    params: int                 # N_params (eq. 4)
    dtype: str                  # weight storage format name
    source: str
    weight_bytes: int | None = None  # measured resident size (a GGUF file) instead of params * b
    # The context the model was trained for, where its file says (a GGUF, a
    # config.json with max_position_embeddings); None for catalog entries,
    # whose aliases span versions with different contexts (Llama 3 / 3.1).
    max_context: int | None = None

    @property
    def name(self) -> str:
        return self.config.name or self.key


@functools.cache
def _catalog() -> dict:
    with resources.files("trajserve.plan").joinpath("catalog.toml").open("rb") as f:
        return tomllib.load(f)


def _find(section: str, name: str, what: str) -> tuple[str, dict]:
    entries = _catalog()[section]
    wanted = name.strip().lower()
    for key, entry in entries.items():
        if wanted == key or wanted in entry.get("aliases", ()):
            return key, entry
    raise ValueError(f"unknown {what} {name!r}; allowed: {', '.join(entries)}")


def device_names() -> list[str]:
    return list(_catalog()["devices"])


def model_names() -> list[str]:
    return list(_catalog()["models"])


def _physical_ram() -> int:
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")


def get_device(name: str) -> DeviceSpec:
    key, e = _find("devices", name, "gpu")
    spec = DeviceSpec(key=key, name=e["name"], memory_bytes=int(e["memory_bytes"]),
                      hbm_bandwidth=float(e["hbm_bandwidth"]), bf16_flops=float(e["bf16_flops"]),
                      host_link=e["host_link"], host_link_bandwidth=float(e["host_link_bandwidth"]),
                      nvme_bandwidth=float(e["nvme_bandwidth"]), source=e["source"])
    if spec.memory_bytes == 0:  # the cpu-local placeholder until calibration fills it
        spec = replace(spec, memory_bytes=_physical_ram())
    return spec


_MODEL_FIELDS = ("num_layers", "num_heads", "num_kv_heads", "head_dim", "hidden_size",
                 "intermediate_size", "vocab_size", "tie_word_embeddings")


def get_model(name_or_path: str) -> ModelSpec:
    """A catalog name, a config.json (or its directory, or any .json file
    holding one), or a .gguf file."""
    p = Path(name_or_path).expanduser()
    if p.suffix == ".gguf":
        if not p.is_file():
            raise ValueError(f"model file {str(p)!r} does not exist")
        cfg = model_shapes.read_gguf_config(p)
        # Quantized weights: the file size is the resident size, not params * b.
        return ModelSpec(key=p.stem, config=cfg, params=model_shapes.total_params(cfg), dtype="gguf",
                         source=f"GGUF metadata of {p}", weight_bytes=p.stat().st_size,
                         max_context=cfg.max_position_embeddings)
    if p.name == "config.json" or p.is_dir() or (p.suffix == ".json" and p.is_file()):
        cfg, dtype, given = model_shapes.read_hf_config(p)
        return ModelSpec(key=cfg.name or p.name, config=cfg, params=model_shapes.total_params(cfg),
                         dtype=dtype, source=f"config.json at {p}; params counted from its shapes",
                         max_context=cfg.max_position_embeddings if given else None)
    try:
        key, e = _find("models", name_or_path, "model")
    except ValueError as err:
        raise ValueError(f"{err}; or pass a config.json, a Hugging Face directory or a .gguf file") from None
    cfg = ModelConfig(architecture=e["architecture"], name=e["name"],
                      qk_norm=e["architecture"] in ("qwen3", "qwen3_moe"), **{f: e[f] for f in _MODEL_FIELDS},
                      **_families(e))
    params = int(e["params"]) if "params" in e else model_shapes.total_params(cfg)
    return ModelSpec(key=key, config=cfg, params=params, dtype=e["dtype"], source=e["source"])


def _families(e: dict) -> dict:
    """An entry's routed experts, latent attention and sliding windows (catalog.toml)."""
    n, out = e["num_layers"], {}
    if "moe" in e:
        m = e["moe"]
        out["moe"] = MoESpec(m["experts"], m["top_k"], m["expert_size"], True,
                             tuple(range(m.get("first_dense", 0), n)), m.get("shared_size", 0))
    if "mla" in e:
        out["mla"] = MLASpec(**e["mla"])
    if "window" in e:
        w = e["window"]
        out["window"] = WindowSpec(w["size"], tuple(i for i in range(n) if (i + 1) % w["global_every"]))
    return out
