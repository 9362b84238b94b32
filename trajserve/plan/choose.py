"""The configuration chosen from the SLO (inference-optimization 8.6.3 and
exercise 8-9): a batch of requests arriving together, a deadline and the
memory left for KV and auxiliary buffers; each candidate configuration's
memory and completion time, and the one that meets both at the least
accelerator time per good result.

The candidates, priced from one measured configuration (B) as the chapter
prices them:

  A  bf16 KV, separate contexts: the whole prompts prefilled at B's FLOP
     efficiency; a round interpolated in measured (bytes read, round time)
     points at the bytes its KV adds;
  B  bf16 KV, the shared prefix stored once (its prefill and round measured);
  C  q8_0 KV, separate contexts: A's prefill, a round at q8_0's bytes;
  D  B plus a draft model: its memory, its extra prefill, more tokens a
     round, the round the larger of B's and the verification's compute;
  E  B plus drafts looked up in the context (an index in host memory: no
     device memory, no extra prefill), a few tokens a round, a lookup's time
     added to each round.

The chapter's KV is bf16; `kv_format` prices A, B, D and E at another
pool format (an engine's float32 pool on a CPU: `trajserve serve --slo`,
server/slo_choice.py), C staying q8_0. `draft=False` leaves D out, for an
engine that has no draft model to run.

A result is good when it is correct (all candidates are assumed to answer
correctly) and on time: a batch that misses the deadline has no good
result, and its accelerator time per good result is unbounded.
"""
from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from trajserve.plan import batch_config, concurrency
from trajserve.plan.catalog import DeviceSpec, ModelSpec
from trajserve.plan.flops import compute_time, forward_flops
from trajserve.plan.kv_format import m_token
from trajserve.plan.model_shapes import decode_read_params, matmul_params

MiB = 1 << 20


@dataclass(frozen=True)
class Measured:
    """The measurements the candidates are priced from. Defaults: the
    chapter's, Qwen3-8B on the RTX PRO 6000 (experiments 8-1 and 8-5; the
    lookup's from exercise 8-9)."""
    shared_prefill_s: float = 2.04        # B: the batch's prefill, the shared prefix cached
    shared_round_s: float = 27.35e-3      # B: a decode round of the batch
    # Decode rounds measured at round_context tokens a request, by batch size.
    rounds: dict[int, float] = field(default_factory=lambda: {1: 26.26e-3, 4: 26.62e-3, 16: 27.44e-3,
                                                              64: 29.63e-3})
    round_context: int = 2048
    draft_memory_bytes: int = (20_894 - 17_706) * MiB  # the draft model's peak (DFlash)
    draft_prefill_extra: float = 0.094    # its prefill of the input, on top of B's
    draft_tokens_per_round: float = 3.0
    draft_verified_positions: int = 8     # positions each request verifies a round
    lookup_tokens_per_round: float = 2.0
    lookup_round_extra_s: float = 0.1e-3  # the host index's query, each round


@dataclass(frozen=True)
class Candidate:
    name: str
    what: str
    memory_bytes: float
    time_s: float
    fits: bool
    on_time: bool
    gpu_s_per_good: float  # the batch's time over its good results (inf: none)


def candidates(model: ModelSpec, device: DeviceSpec, requests: int, prompt: int, shared: int, output: int,
               memory_bytes: float, deadline_s: float, measured: Measured = Measured(),
               block_size: int = 16, kv_format: str = "bf16", draft: bool = True) -> list[Candidate]:
    if not 0 <= shared <= prompt:
        raise ValueError(f"the shared prefix ({shared:,} tokens) must be within the input ({prompt:,})")
    if min(requests, prompt, output) < 1:
        raise ValueError("requests, input and output tokens must be >= 1")
    c, n, m = model.config, requests, measured
    k, k_q8 = m_token(c, kv_format), m_token(c, "q8_0")
    weights = 2 * decode_read_params(c)
    xs = [weights + b * m.round_context * k for b in m.rounds]
    ys = list(m.rounds.values())

    def prefill_flops(new: int, cached: int = 0) -> float:
        return forward_flops(matmul_params(c), c.num_layers, c.num_heads * c.head_dim, new, cached)

    eff = n * prefill_flops(prompt - shared, shared) / (m.shared_prefill_s * device.bf16_flops)
    separate_prefill = compute_time(n * prefill_flops(prompt), device.bf16_flops, eff)
    verify = n * forward_flops(matmul_params(c) + c.vocab_size * c.hidden_size, c.num_layers,
                               c.num_heads * c.head_dim, m.draft_verified_positions, prompt)
    per_request = concurrency.blocks_for(concurrency.stored_tokens(prompt, output), block_size) * block_size
    private = concurrency.trajectory_blocks(prompt, output, shared, block_size) * block_size
    shared_mem = (shared + n * private) * k
    rows = [  # name, what, memory, prefill, round, tokens a round
        ("A", f"{kv_format} KV, separate contexts", n * per_request * k, separate_prefill,
         batch_config.round_time_interpolated(weights + n * prompt * k, xs, ys), 1.0),
        ("B", f"{kv_format} KV, shared prefix", shared_mem, m.shared_prefill_s, m.shared_round_s, 1.0),
        ("C", "q8_0 KV, separate contexts", n * per_request * k_q8, separate_prefill,
         batch_config.round_time_interpolated(weights + n * prompt * k_q8, xs, ys), 1.0),
        ("D", "shared prefix + draft model", shared_mem + m.draft_memory_bytes,
         m.shared_prefill_s * (1 + m.draft_prefill_extra),
         batch_config.round_time(m.shared_round_s, compute_time(verify, device.bf16_flops, eff)),
         m.draft_tokens_per_round),
        ("E", "shared prefix + drafts looked up in the context", shared_mem, m.shared_prefill_s,
         m.shared_round_s + m.lookup_round_extra_s, m.lookup_tokens_per_round),
    ]
    out = []
    for name, what, mem, prefill, round_s, per_round in rows:
        if name == "D" and not draft:
            continue
        t = batch_config.completion_time(prefill, output, round_s, per_round)
        fits, on_time = mem <= memory_bytes, t <= deadline_s
        out.append(Candidate(name, what, mem, t, fits, on_time, t / n if on_time else math.inf))
    return out


def choose(cands: list[Candidate]) -> Candidate | None:
    """The candidate that fits and is on time at the least accelerator time
    per good result (less memory on a tie); None if none does."""
    ok = [x for x in cands if x.fits and x.on_time]
    return min(ok, key=lambda x: (x.gpu_s_per_good, x.memory_bytes)) if ok else None


def report(cands: list[Candidate], chosen: Candidate | None) -> dict:
    return {"candidates": [asdict(x) | {"gpu_s_per_good": None if math.isinf(x.gpu_s_per_good)
                                        else x.gpu_s_per_good} for x in cands],
            "chosen": chosen.name if chosen else None}
