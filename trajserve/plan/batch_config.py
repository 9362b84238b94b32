"""Time and memory of one serving configuration for a batch of requests
(inference-optimization 8.6.3).

A batch finishes after its prefill and enough decode rounds to produce the
remaining G - 1 tokens; a speculative round yields several tokens, so it
cuts rounds, not round time. One decode round costs the larger of its
memory read and its compute (8.2.1). Without a measurement, a round's time
is bytes / (bandwidth * MBU); with measured (bytes, time) points, it is
interpolated between them, as the spec does for q8_0.
"""
from __future__ import annotations

import math
from collections.abc import Sequence

import numpy as np


def decode_rounds(output_tokens: int, tokens_per_round: float = 1.0) -> int:
    """Rounds after the first token (which the prefill produces)."""
    if tokens_per_round <= 0:
        raise ValueError(f"tokens per round must be > 0, got {tokens_per_round}")
    return math.ceil(max(output_tokens - 1, 0) / tokens_per_round - 1e-9)


def round_time_from_bytes(bytes_read: float, bandwidth: float, efficiency: float) -> float:
    return bytes_read / (bandwidth * efficiency)


def round_time_interpolated(bytes_read: float, measured_bytes: Sequence[float],
                            measured_seconds: Sequence[float]) -> float:
    """Linear interpolation in measured (bytes read, round time) points."""
    xs = np.asarray(measured_bytes, dtype=float)
    if bytes_read < xs.min() or bytes_read > xs.max():
        raise ValueError(f"{bytes_read:.3g} bytes is outside the measured range "
                         f"[{xs.min():.3g}, {xs.max():.3g}]; measure it instead of extrapolating")
    return float(np.interp(bytes_read, xs, np.asarray(measured_seconds, dtype=float)))


def round_time(read_seconds: float, compute_seconds: float = 0.0) -> float:
    """A round waits for whichever of reading and computing is slower (8.2.1)."""
    return max(read_seconds, compute_seconds)


def request_time(queue_seconds: float, prefill_seconds: float, output_tokens: int, interval_seconds: float,
                 stall_seconds: float = 0.0) -> float:
    """One request, arrival to last token (8.1.1): the queue, the prefill
    that yields the first token, then G - 1 output intervals (plus what
    other work inserted into them, e.g. another request's prefill):
    0.1 + 0.096 + 255 x 0.0265 = 6.95 s."""
    if output_tokens < 1:
        raise ValueError(f"output tokens must be >= 1, got {output_tokens}")
    if min(queue_seconds, prefill_seconds, interval_seconds, stall_seconds) < 0:
        raise ValueError("queue, prefill, interval and stall times must be >= 0")
    return queue_seconds + prefill_seconds + decode_rounds(output_tokens) * interval_seconds + stall_seconds


def completion_time(prefill_seconds: float, output_tokens: int, round_seconds: float,
                    tokens_per_round: float = 1.0) -> float:
    """Whole batch, arrival to last token: prefill + rounds * round time."""
    return prefill_seconds + decode_rounds(output_tokens, tokens_per_round) * round_seconds


def gpu_seconds(new_tokens: int, output_tokens: int, prefill_rate: float, decode_rate: float) -> float:
    """t_GPU = L / r_P + (G - 1) / r_D per request (8.6.3)."""
    return new_tokens / prefill_rate + (output_tokens - 1) / decode_rate
