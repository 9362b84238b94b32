"""Weight offload with prefetch (inference-optimization 8.4.3): what moving
some layers' weights to host memory frees on the accelerator, what it costs
every forward pass, and when compressing before the move pays.

Offloading n_off copies of S_layer bytes frees n_off * S_layer, less the
prefetch buffers that stay on the device (one buffer: copy, compute, copy
in turn; two: the next layer copies while this one computes). Every decode
round moves all offloaded bytes again:

    T_copy >= n_off * S_layer / B_link                per round
    compressed to r * S:  r S / B_link + S / R_dec  <  S / B_link
                     <=>  R_dec > B_link / (1 - r)    (R_dec in raw bytes/s)

Arithmetic only; sizes in bytes, bandwidths in bytes/s, times in seconds.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass


@dataclass(frozen=True, slots=True)
class OffloadPlan:
    offloaded_bytes: int  # n_off * S_layer, moved every round
    buffers: int
    net_saved_bytes: int  # offloaded - buffers * S_layer
    extra_states: int  # whole request states of state_bytes the net saving holds
    copy_s_per_round: float  # >= offloaded / B_link
    copy_s_total: float  # over `rounds` rounds
    rounds: int
    link_for_budget: float | None  # the one-way bandwidth that fits all copies in budget_s
    step_s: float | None  # a round with the copy, given the round without it (step_with_offload)

    def to_dict(self) -> dict:
        return asdict(self)


def plan_offload(layer_bytes: int, offloaded_layers: int, buffers: int, state_bytes: int, link_bytes_per_s: float,
                 rounds: int, budget_s: float | None = None, round_s: float | None = None) -> OffloadPlan:
    """layer_bytes: one offloaded copy (S_layer); buffers: prefetch buffers of
    that size kept on the device (1 or 2); state_bytes: one request's KV
    state, for how many more fit; rounds: decode rounds that each move the
    offloaded bytes again (G - 1 for G output tokens)."""
    for name, v in (("layer_bytes", layer_bytes), ("offloaded_layers", offloaded_layers),
                    ("state_bytes", state_bytes), ("rounds", rounds)):
        if v < (1 if name != "rounds" else 0):
            raise ValueError(f"{name} must be >= {1 if name != 'rounds' else 0}, got {v}")
    if buffers < 0 or buffers > offloaded_layers:
        raise ValueError(f"buffers must be in [0, {offloaded_layers}] (the offloaded layers), got {buffers}")
    if not link_bytes_per_s > 0:
        raise ValueError(f"link bandwidth must be > 0, got {link_bytes_per_s}")
    moved = layer_bytes * offloaded_layers
    net = moved - buffers * layer_bytes
    per_round = moved / link_bytes_per_s
    return OffloadPlan(offloaded_bytes=moved, buffers=buffers, net_saved_bytes=net, extra_states=net // state_bytes,
                       copy_s_per_round=per_round, copy_s_total=per_round * rounds, rounds=rounds,
                       link_for_budget=moved * rounds / budget_s if budget_s else None,
                       step_s=step_with_offload(round_s, per_round, buffers) if round_s is not None else None)


@dataclass(frozen=True, slots=True)
class CompressedMove:
    direct_s: float  # S / B_link
    compressed_link_s: float  # r S / B_link
    saved_link_s: float  # what decompression must fit in
    min_decompress_bytes_per_s: float  # R_dec > B_link / (1 - r)

    def to_dict(self) -> dict:
        return asdict(self)


def compressed_move(size_bytes: float, ratio: float, link_bytes_per_s: float) -> CompressedMove:
    """Moving S bytes compressed to r S: the link times and the decompression
    throughput (raw bytes/s) above which it beats moving S as is."""
    if not 0 < ratio < 1:
        raise ValueError(f"compression ratio r must be in (0, 1), got {ratio}")
    direct = size_bytes / link_bytes_per_s
    packed = ratio * size_bytes / link_bytes_per_s
    return CompressedMove(direct, packed, direct - packed, link_bytes_per_s / (1 - ratio))


def step_with_offload(round_s: float, copy_s: float, buffers: int) -> float:
    """A round with offloaded weights: two or more prefetch buffers overlap
    the copy with the round's other work, so it takes the longer of the two
    (8.4.3: >= 42.5 ms over PCIe whatever the rest); one buffer is copied
    into, computed from and copied into again in turn, so they add. The
    simulator's cost model calls this too (one implementation)."""
    if buffers < 1:
        raise ValueError(f"offloaded weights need at least one prefetch buffer, got {buffers}")
    return max(round_s, copy_s) if buffers >= 2 else round_s + copy_s


def fits_deadline(copy_s_per_round: float, round_s: float) -> bool:
    """Prefetch hides the copy only if a round's copy is no longer than its compute."""
    return copy_s_per_round <= round_s and math.isfinite(copy_s_per_round)
