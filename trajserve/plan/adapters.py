"""Many LoRA adapters on one base model: their bytes, and what they take
from the KV pool (inference-optimization 8.2.1).

A LoRA adapter on a projection W [out x in] adds two matrices, A [r x in]
and B [out x r]; the request's product becomes W x + (alpha / r) B (A x).
One adapter over the modules `targets` of every layer holds

    P_adapter = L * sum_{m in targets} r (in_m + out_m)     parameters
    D_adapter = P_adapter * s_a                               bytes (s_a: the adapter's dtype)

(8.2.1: rank 16, bf16, Qwen3-8B's Q and V projections: 14.6 MiB; 100 of
them 1.43 GiB, against 14.1 GiB of matrix weights). What adapters hold
and what the KV holds are sized apart (8.2.1: 100 unshared 8K contexts of
Qwen3-8B are 112.5 GiB of KV): resident adapters come out of the pool,
tokens lost = N D_adapter / m_token. Arithmetic only.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass

from trajserve.config import ModelConfig
from trajserve.plan.model_shapes import PROJECTIONS as MODULES
from trajserve.plan.model_shapes import lm_head_params, matmul_params, projection_shape

# PEFT's target_modules names (Llama / Qwen projections), long and short.
_SHORT = {m.split("_")[0]: m for m in MODULES}


def module_name(name: str) -> str:
    """'q' or 'q_proj' -> 'q_proj'; ValueError naming the choices otherwise."""
    full = _SHORT.get(name, name)
    if full not in MODULES:
        raise ValueError(f"unknown LoRA target module {name!r}; the targets are {', '.join(MODULES)} "
                         f"(or {', '.join(_SHORT)})")
    return full


def module_shape(c: ModelConfig, name: str) -> tuple[int, int]:
    """(in, out) features of one layer's projection ('q' or 'q_proj')."""
    return projection_shape(c, module_name(name))


def adapter_params(c: ModelConfig, rank: int, targets: list[str]) -> int:
    """P_adapter = L sum_m r (in_m + out_m)."""
    if rank < 1:
        raise ValueError(f"LoRA rank must be >= 1, got {rank}")
    if not targets:
        raise ValueError("give at least one target module")
    return c.num_layers * sum(rank * sum(module_shape(c, m)) for m in {module_name(t) for t in targets})


@dataclass(frozen=True, slots=True)
class AdapterPlan:
    rank: int
    targets: list[str]
    adapter_params: int
    adapter_bytes: float       # D_adapter
    adapters: int              # N resident
    adapters_bytes: float      # N D_adapter
    matrix_weight_bytes: float  # the base model's matrices (layers + LM head)
    kv_per_token: float        # m_token
    pool_tokens_lost: int      # N D_adapter / m_token
    contexts: int              # sequences for the KV comparison
    context_tokens: int
    contexts_kv_bytes: float   # contexts x context_tokens x m_token

    def to_dict(self) -> dict:
        return asdict(self)


def plan_adapters(c: ModelConfig, rank: int, targets: list[str], adapters: int, adapter_bytes_per_param: float,
                  weight_bytes_per_param: float, kv_per_token: float, contexts: int = 0,
                  context_tokens: int = 0) -> AdapterPlan:
    if adapters < 0 or contexts < 0 or context_tokens < 0:
        raise ValueError(f"adapters, contexts and context tokens must be >= 0, got {adapters}, {contexts}, "
                         f"{context_tokens}")
    p = adapter_params(c, rank, targets)
    one = p * adapter_bytes_per_param
    return AdapterPlan(
        rank=rank, targets=sorted({module_name(t) for t in targets}, key=MODULES.index), adapter_params=p,
        adapter_bytes=one, adapters=adapters, adapters_bytes=adapters * one,
        matrix_weight_bytes=(matmul_params(c) + lm_head_params(c)) * weight_bytes_per_param,
        kv_per_token=kv_per_token, pool_tokens_lost=int(adapters * one // kv_per_token),
        contexts=contexts, context_tokens=context_tokens,
        contexts_kv_bytes=contexts * context_tokens * kv_per_token)
