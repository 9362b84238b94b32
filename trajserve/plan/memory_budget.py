"""What one device's memory holds: weights, reserve, and the KV pool left over.

    C_HBM = M_weights + M_activations + M_runtime + M_KV      (eq. 3, kv-cache-management)
    M_weights = N_params * b_weight / (TP * PP)               (eq. 4)
    M_KV = C_HBM - (M_weights + M_activations + M_runtime)    (eq. 5)
"""
from __future__ import annotations

from trajserve.config import ModelConfig


def check_parallelism(model: ModelConfig, tp: int, pp: int) -> None:
    """TP splits attention heads, PP splits layers: both must divide evenly,
    or one device would hold more than 1/(TP*PP) and eq. 4 would not hold."""
    if tp < 1 or pp < 1:
        raise ValueError(f"tp and pp must be >= 1, got tp={tp}, pp={pp}")
    if model.num_heads % tp:
        raise ValueError(f"tp={tp} does not divide the {model.num_heads} attention heads; "
                         f"allowed tp: {', '.join(str(d) for d in divisors(model.num_heads))}")
    # More TP ranks than KV heads replicates each KV head (every rank needs one).
    if model.num_kv_heads % tp and tp % model.num_kv_heads:
        raise ValueError(f"tp={tp} neither divides nor is a multiple of the {model.num_kv_heads} KV heads")
    if model.num_layers % pp:
        raise ValueError(f"pp={pp} does not divide the {model.num_layers} layers; "
                         f"allowed pp: {', '.join(str(d) for d in divisors(model.num_layers))}")


def divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def kv_share_per_device(model: ModelConfig, tp: int, pp: int) -> float:
    """Fraction of m_token one device stores: H_kv/TP heads (at least one,
    replicated when TP > H_kv) of L/PP layers. m_token/TP in the spec's case.
    An MLA latent belongs to no head: every TP rank holds all of it."""
    if model.mla is not None:
        return 1 / pp
    heads = max(model.num_kv_heads // tp, 1)
    return heads / model.num_kv_heads / pp


def weights_per_device(n_params: float, b_weight: float, tp: int, pp: int) -> float:
    """M_weights = N_params * b_weight / (TP * PP)   (eq. 4, kv-cache-management)."""
    return n_params * b_weight / (tp * pp)


def kv_pool(c_hbm: float, m_weights: float, m_activations: float, m_runtime: float = 0.0) -> float:
    """M_KV = C_HBM - (M_weights + M_activations + M_runtime)   (eq. 5)."""
    pool = c_hbm - (m_weights + m_activations + m_runtime)
    if pool <= 0:
        raise ValueError(
            f"no memory left for the KV pool: weights {m_weights / 1e9:.2f} GB + reserve "
            f"{(m_activations + m_runtime) / 1e9:.2f} GB per device >= device memory {c_hbm / 1e9:.2f} GB; "
            "use more devices (--tp/--pp), a smaller --weight-dtype or a smaller --reserve")
    return pool
