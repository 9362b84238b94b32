"""`trajserve bench quant-agreement`: quantized execution against the float32
path on the same weights (inference-optimization 8.4.1: what quantization
costs in quality).

16 fixed prompts (prose, code, JSON, a chat turn), 64 greedy tokens each
(EOS ignored), once with `--quantization` (default auto: the GGUF's blocks)
and once with the weights dequantized to float32 (`none`). Reports per
prompt the tokens identical up to the first divergence, and two |delta
logprob| figures: over the tokens both generated alike (the chosen token's
logprob under each path), and teacher-forced over all 64 float32 tokens
(both paths score the float path's continuation as a prompt, so a
divergence does not end the comparison). `--bf16` puts torch's bfloat16
forward on the tested side instead: the same figures for a path users
already accept. The reference keeps a float32 KV pool; the tested side's
pool is `--kv-cache-dtype` (auto: bfloat16 where AMX runs its prefill).
"""
from __future__ import annotations

import argparse
import json

from trajserve.bench.common import command_line, identical_prefix, machine_info

PROMPTS = [
    "The capital of France is",
    "def fibonacci(n):",
    "List three uses of a KV cache:",
    "Write a haiku about the sea.",
    "import numpy as np\n\ndef softmax(x):\n",
    '{"name": "read_file", "arguments": {"path": "src/',
    "The mitochondria is the powerhouse of the cell because",
    "Once upon a time, in a village by the mountains,",
    "SELECT name, count(*) FROM orders WHERE",
    "To install the package, run",
    "Q: What is 17 times 23?\nA:",
    "The three laws of thermodynamics are",
    "<|im_start|>user\nSummarize the plot of Hamlet in two sentences.<|im_end|>\n<|im_start|>assistant\n",
    "fn main() {\n    let v: Vec<i32> =",
    "Dear hiring manager, I am writing to",
    "git commit -m \"",
]
TOKENS = 64


def _runs(llm, prompts: list[list[int]]):
    from trajserve.sampling import SamplingParams

    sp = SamplingParams(max_tokens=TOKENS, temperature=0, ignore_eos=True, logprobs=0)
    return llm.generate(prompts, sp, use_tqdm=False)


def _scored(llm, prompt: list[int], continuation: list[int]) -> list[float]:
    from trajserve.sampling import SamplingParams

    sp = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True, prompt_logprobs=0)
    out = llm.generate([prompt + continuation], sp, use_tqdm=False)[0]
    return [e[0] for e in out.prompt_logprobs[len(prompt):]]


def run(args: argparse.Namespace) -> int:
    from trajserve.llm import LLM

    common = dict(model=args.model, num_blocks=args.num_blocks or 1024)
    # --bf16: torch's bfloat16 forward on the side under test, a yardstick a user already accepts.
    quant = (LLM(quantization="none", dtype="bfloat16", **common) if args.bf16 else
             LLM(quantization=args.quantization, dtype="float32", kv_cache_dtype=args.kv_cache_dtype, **common))
    ref = LLM(quantization="none", dtype="float32", kv_cache_dtype="float32", **common)
    prompts = [quant.engine.tokenizer.encode(p) for p in PROMPTS]
    a, b = _runs(quant, prompts), _runs(ref, prompts)
    rows = []
    for p, x, y in zip(prompts, a, b):
        tx, ty = x.outputs[0].token_ids, y.outputs[0].token_ids
        same = identical_prefix(tx, ty, TOKENS)
        lx = [lp for lp, _ in x.outputs[0].logprobs[:same]]
        ly = [lp for lp, _ in y.outputs[0].logprobs[:same]]
        forced = [abs(u - v) for u, v in zip(_scored(quant, p, ty), _scored(ref, p, ty))]
        rows.append({"identical_tokens": same,
                     "mean_abs_dlogprob_agreeing": sum(abs(u - v) for u, v in zip(lx, ly)) / same if same else None,
                     "mean_abs_dlogprob_forced": sum(forced) / len(forced), "max_abs_dlogprob_forced": max(forced)})
    n_full = sum(r["identical_tokens"] == TOKENS for r in rows)
    summary = {
        "prompts": len(rows), "tokens": TOKENS,
        "share_identical_for_64": n_full / len(rows),
        "mean_identical_prefix": sum(r["identical_tokens"] for r in rows) / len(rows) / TOKENS,
        "mean_abs_dlogprob_forced": sum(r["mean_abs_dlogprob_forced"] for r in rows) / len(rows),
        "max_abs_dlogprob_forced": max(r["max_abs_dlogprob_forced"] for r in rows),
    }
    out = {"command": command_line(), "machine": machine_info(), "quantization": quant.engine.quantization,
           "dtype": str(quant.engine.dtype).removeprefix("torch."),
           "kv_dtype": quant.engine.kv_format.name,
           "weights": quant.engine.model.weight_formats(), "kernels": getattr(quant.engine.model.kernels, "isa", None),
           "rows": rows, "summary": summary}
    if args.json:
        print(json.dumps(out, indent=2))
        return 0
    print(f"\n{out['command']}\ntested: {out['dtype']}, KV {out['kv_dtype']}, {out['weights']} (kernels "
          f"{out['kernels']}) vs the same weights, compute and KV in float32\n")
    print(f"{'#':>3} {'identical':>9} {'|dlp| agreeing':>15} {'|dlp| forced':>13} {'max forced':>11}")
    for i, r in enumerate(rows):
        ag = r["mean_abs_dlogprob_agreeing"]
        print(f"{i:>3} {r['identical_tokens']:>6}/{TOKENS} {(f'{ag:.4f}' if ag is not None else '-'):>15} "
              f"{r['mean_abs_dlogprob_forced']:>13.4f} {r['max_abs_dlogprob_forced']:>11.3f}")
    s = summary
    print(f"\n{s['share_identical_for_64'] * 100:.0f} % of continuations identical for {TOKENS} tokens; "
          f"identical prefix {s['mean_identical_prefix'] * 100:.0f} % on average; teacher-forced mean |dlogprob| "
          f"{s['mean_abs_dlogprob_forced']:.4f} (max {s['max_abs_dlogprob_forced']:.3f})")
    print("\nJSON:")
    print(json.dumps(out))
    return 0
