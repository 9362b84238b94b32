"""`trajserve bench kv-agreement`: a KV pool format against full-precision
KV, everything else equal (inference-optimization 8.4.2 / 8.4.4:
what compressing K and V costs in quality).

16 fixed prompts of 200 to 3,000 tokens, the length an agent's context
has: a file it read (Python standard-library sources, fixed for the
interpreter's version) and a question about it. Each runs twice per pool:
64 greedy tokens (EOS ignored), then teacher-forced along the float32
pool's continuation, scoring every position's full next-token
distribution. Reports per prompt the tokens identical up to the first
divergence, the mean KL(p_float32 || p_format) over the 64 positions, and
where they part, float32's own log-probability gap between its token and
the format's (how near a tie the flipped choice was); then the share of
continuations identical for all 64 and the mean KL over all positions.
Weights and compute are the same on both sides (default `--quantization
none`: float32 weights, so only the pool differs).

A whole continuation is decided by its first divergence, so 16 of them
say little about a rate; the teacher-forced pass scores every one of the
16 x 64 positions on float32's tokens, and where the format's argmax is not
float32's counts a flip (with float32's gap there). At a flip rate r,
independent positions keep (1 - r)^64 of continuations whole: 95 % needs
r <= 0.080 %. The same pass checks float32 against itself (its prefill's
argmax is the token its decode chose). `--emulate` runs a float32 pool
with a chosen loss put into its stored rows instead of a pool format
(bench/kv_emulation.py), to see where the disagreement comes from.
"""
from __future__ import annotations

import argparse
import inspect
import json
import math

from trajserve.bench.common import command_line, identical_prefix, machine_info
from trajserve.bench.kv_emulation import RECENT, emulated

TOKENS = 64
NUM_PROMPTS = 16
SHORTEST, LONGEST = 200, 3000
# Shortest prompt first; each module's source is longer than its prompt (Python 3.11).
_SOURCES = ("bisect", "sched", "fnmatch", "abc", "colorsys", "glob", "copy", "queue", "string", "json.decoder",
            "shlex", "textwrap", "heapq", "tokenize", "csv", "functools")
_QUESTIONS = ("What does the last function in this file do, and what could go wrong with it?",
              "List the public names this module defines.",
              "Write a unit test for the first class or function in this file.",
              "Explain the module's error handling in two sentences.")


def prompts(tokenizer) -> list[list[int]]:
    """The 16 prompts' token ids: lengths spread evenly over 200-3,000."""
    import importlib

    out = []
    for i, name in enumerate(_SOURCES[:NUM_PROMPTS]):
        target = SHORTEST + (LONGEST - SHORTEST) * i // (NUM_PROMPTS - 1)
        head = tokenizer.encode(f"Here is the file {name.replace('.', '/')}.py:\n```python\n")
        tail = tokenizer.encode(f"\n```\n{_QUESTIONS[i % len(_QUESTIONS)]}\nAnswer:")
        body = tokenizer.encode(inspect.getsource(importlib.import_module(name)))
        keep = target - len(head) - len(tail)
        if keep > len(body):
            raise RuntimeError(f"{name} is shorter than its {target}-token prompt")
        out.append(head + body[:keep] + tail)
    return out


class Capture:
    """The full next-token log-distributions of one teacher-forced request:
    the engine's observer of prompt rows (built into it: LLM(prompt_logits=)),
    keeping the rows at positions [first, first + TOKENS) of the request it
    was last pointed at."""

    def __init__(self) -> None:
        self.first, self.rows = None, {}

    def __call__(self, spans: list[tuple], logits) -> None:
        if self.first is None:
            return
        for _req, row0, start, n in spans:
            for i in range(n):
                if self.first <= start + i < self.first + TOKENS:
                    self.rows[start + i] = logits[row0 + i].float().log_softmax(-1)

    def at(self, first: int) -> Capture:
        self.first, self.rows = first, {}
        return self


def _continuations(llm, ids: list[list[int]]) -> list[list[int]]:
    from trajserve.sampling import SamplingParams

    sp = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True)
    return [o.outputs[0].token_ids for o in llm.generate(ids, sp, use_tqdm=False)]


def _distributions(llm, capture: Capture, prompt: list[int], continuation: list[int]):
    """[TOKENS, vocab] log-probabilities of the next token after prompt +
    continuation[:j], for j < TOKENS (the last prompt position first): the
    whole continuation goes in as prompt, whose rows then score it."""
    import torch

    from trajserve.sampling import SamplingParams

    llm.engine.kv.clear_cache()  # scored from scratch: no prefix from the run before
    cap = capture.at(len(prompt) - 1)
    llm.generate([prompt + continuation], SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=0),
                 use_tqdm=False)
    cap.first = None
    return torch.stack([cap.rows[p] for p in range(len(prompt) - 1, len(prompt) - 1 + TOKENS)])


def run(args: argparse.Namespace) -> int:
    from trajserve.llm import LLM

    if not 1 <= args.prompts <= NUM_PROMPTS:
        raise ValueError(f"--prompts must be 1 to {NUM_PROMPTS}, got {args.prompts}")
    common = dict(model=args.model, num_blocks=args.num_blocks or 1024, dtype="float32",
                  quantization=args.quantization)
    emulation = getattr(args, "emulate", None)
    seen = {"tested": Capture(), "ref": Capture()}
    tested = LLM(kv_cache_dtype="float32" if emulation else args.kv_cache_dtype, prompt_logits=seen["tested"],
                 **common)
    store = emulated(tested, emulation) if emulation else None
    ref = LLM(kv_cache_dtype="float32", prompt_logits=seen["ref"], **common)
    ids = prompts(tested.engine.tokenizer)[: args.prompts]
    b = _continuations(ref, ids)
    if store is None:
        a = _continuations(tested, ids)
    else:  # one prompt at a time: the recent window starts at each prompt's own length - RECENT
        a = []
        for p in ids:
            store.full_from = len(p) - RECENT
            a += _continuations(tested, [p])
    rows = []
    for p, x, y in zip(ids, a, b):
        same = identical_prefix(x, y, TOKENS)
        if store is not None:
            store.full_from = len(p) - RECENT
        lp, lq = _distributions(ref, seen["ref"], p, y), _distributions(tested, seen["tested"], p, y)
        kl = (lp.exp() * (lp - lq)).sum(-1)  # KL(p_float32 || p_format) at each position
        # Where the continuations part: how far float32 itself put its token above the one the format chose
        # (log-probability gap under float32; a near tie flips under any perturbation).
        gap = (lp[same, y[same]] - lp[same, x[same]]).item() if same < TOKENS else None
        # Teacher-forced, every position scores on its own (no cascade after a first divergence): where the
        # format's argmax is not float32's, and float32's gap there. And float32 against itself: the kernels
        # give a query the same bits in prefill as in decode, so its prefill must pick every token its decode
        # chose; a difference would make the counts above suspect.
        top_p, top_q = lp.argmax(-1), lq.argmax(-1)
        flips = (top_p != top_q).nonzero().flatten().tolist()
        rows.append({"prompt_tokens": len(p), "identical_tokens": same, "mean_kl": kl.mean().item(),
                     "max_kl": kl.max().item(), "divergence_gap": gap,
                     "forced_flips": len(flips),
                     "forced_flip_gaps": [(lp[j, top_p[j]] - lp[j, top_q[j]]).item() for j in flips],
                     "float32_self_flips": sum(int(top_p[j]) != y[j] for j in range(TOKENS))})
    summary = {"prompts": len(rows), "tokens": TOKENS,
               "share_identical_for_64": sum(r["identical_tokens"] == TOKENS for r in rows) / len(rows),
               "mean_identical_prefix": sum(r["identical_tokens"] for r in rows) / len(rows) / TOKENS,
               "mean_kl": sum(r["mean_kl"] for r in rows) / len(rows),
               "max_kl": max(r["max_kl"] for r in rows),
               "largest_divergence_gap": max((r["divergence_gap"] for r in rows if r["divergence_gap"] is not None),
                                             default=None)}
    positions = len(rows) * TOKENS
    rate = sum(r["forced_flips"] for r in rows) / positions
    gaps = [g for r in rows for g in r["forced_flip_gaps"]]
    summary.update({
        "forced_positions": positions, "forced_flip_rate": rate,
        "largest_forced_flip_gap": max(gaps, default=None),
        "float32_self_flips": sum(r["float32_self_flips"] for r in rows),
        # Were positions independent, a continuation stays whole for 64 tokens with probability (1 - rate)^64;
        # the flip rate at which that reaches a 95 % target is 1 - 0.95^(1/64) = 0.080 %.
        "expected_share_identical_for_64": (1 - rate) ** TOKENS,
        "flip_rate_for_95_percent": 1 - 0.95 ** (1 / TOKENS)})
    out = {"command": command_line(), "machine": machine_info(), "kv_dtype": tested.engine.kv_format.name,
           "emulation": emulation,
           "reference_kv_dtype": ref.engine.kv_format.name, "quantization": tested.engine.quantization,
           "weights": tested.engine.model.weight_formats(),
           "kernels": getattr(tested.engine.model.kernels, "isa", None), "rows": rows, "summary": summary}
    if not all(math.isfinite(r["mean_kl"]) for r in rows):
        raise RuntimeError("a KL divergence is not finite")
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    tested_name = f"float32 rows stored as {emulation} (emulated)" if emulation else out["kv_dtype"]
    print(f"\n{out['command']}\nKV {tested_name} against KV float32; weights {out['weights']} in float32 "
          f"(kernels {out['kernels']})\n")
    print(f"{'#':>3} {'prompt':>7} {'identical':>9} {'mean KL':>10} {'max KL':>9} {'gap at divergence':>18} "
          f"{'forced flips':>12}")
    for i, r in enumerate(rows):
        gap = "" if r["divergence_gap"] is None else f"{r['divergence_gap']:.4f}"
        print(f"{i:>3} {r['prompt_tokens']:>7} {r['identical_tokens']:>6}/{TOKENS} {r['mean_kl']:>10.5f} "
              f"{r['max_kl']:>9.4f} {gap:>18} {r['forced_flips']:>12}")
    s = summary
    print(f"\n{s['share_identical_for_64'] * 100:.0f} % of continuations identical for {TOKENS} tokens; identical "
          f"prefix {s['mean_identical_prefix'] * 100:.0f} % on average; mean KL {s['mean_kl']:.5f} "
          f"(max {s['max_kl']:.4f})")
    largest = "" if s["largest_forced_flip_gap"] is None else (f" (largest float32 gap there "
                                                               f"{s['largest_forced_flip_gap']:.4f})")
    print(f"teacher-forced along float32's tokens: {s['forced_flip_rate'] * 100:.2f} % of {s['forced_positions']} "
          f"positions pick another token{largest}; independent "
          f"positions would keep {s['expected_share_identical_for_64'] * 100:.0f} % of continuations whole (95 % "
          f"needs <= {s['flip_rate_for_95_percent'] * 100:.3f} %); float32's prefill vs its own decode: "
          f"{s['float32_self_flips']} positions differ")
    if s["largest_divergence_gap"] is not None:
        print(f"where continuations part, float32's own log-probability gap between its token and the format's: "
              f"at most {s['largest_divergence_gap']:.4f}")
    print("\nJSON:")
    print(json.dumps(out))
    return 0
