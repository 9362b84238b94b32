"""A LoRA adapter in the PEFT format, checked against the base model.

A PEFT adapter directory holds adapter_config.json (peft_type LORA, r,
lora_alpha, target_modules, ...) and adapter_model.safetensors with, per
adapted projection of layer i,

    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_A.weight   [r, in]
    base_model.model.model.layers.{i}.{self_attn|mlp}.{module}.lora_B.weight   [out, r]

and the adapted product is W x + s B (A x), s = lora_alpha / r (rsLoRA:
lora_alpha / sqrt(r)). The tensors are the truth about what is adapted
(target_modules may be a regex, layers_to_transform may skip layers); each
is checked against the base model's shape for its module, and an adapter
that needs more than this engine runs (DoRA, LoRA biases, modules_to_save,
per-module rank or alpha patterns, Conv1D's fan_in_fan_out) is refused
with the field named, never half-applied. The path is the operator's
(`serve --lora-modules`), never a client string.
"""
from __future__ import annotations

import hashlib
import json
import math
import re
from dataclasses import dataclass, field
from pathlib import Path

import torch

from trajserve.config import ModelConfig
from trajserve.plan.adapters import MODULES, module_shape

CONFIG_FILE, WEIGHTS_FILE = "adapter_config.json", "adapter_model.safetensors"
_KEY = re.compile(r"^base_model\.model\.model\.layers\.(\d+)\.(self_attn|mlp)\.(\w+_proj)\.lora_([AB])"
                  r"(?:\.default)?\.weight$")
_PART = {"q_proj": "self_attn", "k_proj": "self_attn", "v_proj": "self_attn", "o_proj": "self_attn",
         "gate_proj": "mlp", "up_proj": "mlp", "down_proj": "mlp"}
# Config fields whose non-default values change the product beyond W x + s B A x.
_REFUSED = {"use_dora": (False, "DoRA (use_dora)"), "lora_bias": (False, "LoRA biases (lora_bias)"),
            "fan_in_fan_out": (False, "Conv1D weights (fan_in_fan_out)"),
            "modules_to_save": (None, "whole modules replaced by the adapter (modules_to_save)"),
            "rank_pattern": ({}, "per-module ranks (rank_pattern)"),
            "alpha_pattern": ({}, "per-module alphas (alpha_pattern)"),
            "layer_replication": (None, "layer replication (layer_replication)")}


class AdapterError(ValueError):
    """An adapter this engine cannot serve; the message names the file, field or module."""


@dataclass(slots=True)
class LoRAAdapter:
    name: str
    rank: int
    alpha: float
    scaling: float  # s: lora_alpha / r, or / sqrt(r) with use_rslora
    # (layer, module) -> (A [r, in], B [out, r]), float32
    weights: dict[tuple[int, str], tuple[torch.Tensor, torch.Tensor]] = field(default_factory=dict)
    # sha256 of the config and weights files (and of the precision it runs in,
    # where --lora-dtype changes it: other numbers, other KV): its identity
    digest: str = ""
    # The precision it runs in: bf16 for a bf16 file, else float32 (float16
    # too: bf16 would round it), unless --lora-dtype says otherwise.
    dtype: torch.dtype = torch.float32

    @property
    def modules(self) -> list[str]:
        return sorted({m for _, m in self.weights}, key=MODULES.index)

    @property
    def num_params(self) -> int:
        return sum(a.numel() + b.numel() for a, b in self.weights.values())

    def delta(self, layer: int, module: str) -> torch.Tensor | None:
        """s B A [out, in]: what the adapter adds to the projection's weight (None: not adapted)."""
        ab = self.weights.get((layer, module))
        return None if ab is None else self.scaling * (ab[1] @ ab[0])


def _read_config(d: Path) -> dict:
    try:
        cfg = json.loads((d / CONFIG_FILE).read_text())
    except FileNotFoundError:
        raise AdapterError(f"{d}: no {CONFIG_FILE} (a PEFT LoRA adapter directory has it and {WEIGHTS_FILE})") \
            from None
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise AdapterError(f"{d / CONFIG_FILE}: not JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise AdapterError(f"{d / CONFIG_FILE}: not a JSON object")
    if cfg.get("peft_type", "LORA") != "LORA":
        raise AdapterError(f"{d / CONFIG_FILE}: peft_type is {cfg.get('peft_type')!r}; only LORA adapters are served")
    for key, (default, what) in _REFUSED.items():
        if cfg.get(key, default) not in (default, None, {}, False):
            raise AdapterError(f"{d / CONFIG_FILE}: {what} is not supported")
    return cfg


def _number(cfg: dict, key: str, d: Path, integer: bool = False) -> float:
    v = cfg.get(key)
    ok = isinstance(v, int) if integer else isinstance(v, (int, float))
    if not ok or isinstance(v, bool) or not (v > 0 and math.isfinite(v)):
        raise AdapterError(f"{d / CONFIG_FILE}: {key} must be a positive {'integer' if integer else 'number'}, "
                           f"got {v!r}")
    return v


def load_adapter(path: str | Path, name: str, model: ModelConfig, max_rank: int = 64,
                 run_dtype: str = "auto") -> LoRAAdapter:
    """Read and check a PEFT LoRA adapter for `model`. AdapterError (a
    ValueError) naming the file, field or module and its shapes otherwise."""
    from safetensors import SafetensorError
    from safetensors.torch import load_file

    d = Path(path)
    cfg = _read_config(d)
    rank = int(_number(cfg, "r", d, integer=True))
    if rank > max_rank:
        raise AdapterError(f"{d / CONFIG_FILE}: r = {rank} is over --max-lora-rank {max_rank}")
    alpha = float(_number(cfg, "lora_alpha", d))
    scaling = alpha / math.sqrt(rank) if cfg.get("use_rslora") else alpha / rank
    wfile = d / WEIGHTS_FILE
    try:
        tensors = load_file(str(wfile))
    except FileNotFoundError:
        raise AdapterError(f"{d}: no {WEIGHTS_FILE}") from None
    except (SafetensorError, OSError) as e:
        raise AdapterError(f"{wfile}: not a readable safetensors file ({e})") from None
    halves: dict[tuple[int, str], dict[str, torch.Tensor]] = {}
    for key, t in tensors.items():
        m = _KEY.match(key)
        if m is None:
            raise AdapterError(f"{wfile}: tensor {key!r} is not a LoRA A/B matrix of a decoder projection "
                               f"({', '.join(MODULES)})")
        layer, part, module, half = int(m[1]), m[2], m[3], m[4]
        if module not in _PART or _PART[module] != part:
            raise AdapterError(f"{wfile}: tensor {key!r}: {module} is not a projection of {part}")
        if layer >= model.num_layers:
            raise AdapterError(f"{wfile}: tensor {key!r} adapts layer {layer}; the base model has "
                               f"{model.num_layers} layers")
        halves.setdefault((layer, module), {})[half] = t
    if not halves:
        raise AdapterError(f"{wfile}: no LoRA matrices")
    weights = {}
    for (layer, module), ab in sorted(halves.items()):
        where = f"{wfile}: layer {layer} {module}"
        if set(ab) != {"A", "B"}:
            raise AdapterError(f"{where}: lora_{'A' if 'A' not in ab else 'B'} is missing")
        a, b = ab["A"], ab["B"]
        fan_in, fan_out = module_shape(model, module)
        if tuple(a.shape) != (rank, fan_in) or tuple(b.shape) != (fan_out, rank):
            raise AdapterError(f"{where}: lora_A {tuple(a.shape)} and lora_B {tuple(b.shape)} do not fit the base "
                               f"model's {module} [{fan_out} x {fan_in}] at r = {rank} (want A {(rank, fan_in)}, "
                               f"B {(fan_out, rank)})")
        if not (torch.isfinite(a).all() and torch.isfinite(b).all()):
            raise AdapterError(f"{where}: the matrices hold NaN or infinity")
        weights[(layer, module)] = (a.float().contiguous(), b.float().contiguous())
    dtypes = {t.dtype for t in tensors.values()}
    dtype = dtypes.pop() if len(dtypes) == 1 else torch.float32
    if dtype != torch.bfloat16:
        dtype = torch.float32
    tag = b""
    if run_dtype != "auto" and getattr(torch, run_dtype) != dtype:  # rounded (or widened) to run: other KV
        dtype, tag = getattr(torch, run_dtype), f"\0run as {run_dtype}".encode()
    digest = hashlib.sha256((d / CONFIG_FILE).read_bytes() + wfile.read_bytes() + tag).hexdigest()
    return LoRAAdapter(name, rank, alpha, scaling, weights, digest, dtype)
