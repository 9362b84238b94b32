"""`trajserve bench resume`: what a resumed turn pays for its state's tier.

One session with a history of H tokens pauses under a forced decision and
resumes with an observation of O tokens; the measure is resume-to-first-
token (resume() + the turn's prefill up to its first sampled token):

    keep            the state never left the device (the floor)
    host / disk     reloaded; the copy streams in under the observation's
                    prefill, which waits per layer (kv/copy_engine.py)
    host-serial /   reloaded, the whole copy before the prefill starts (what
    disk-serial     the overlap is measured against)
    drop            recomputed: the prefill covers H + O tokens

Spec: kv-cache-management "异步分页换入换出" (pipelined reload with the
observation's prefill). Every mode must give the same first token; the run
fails if one does not.
"""
from __future__ import annotations

import argparse
import json
import statistics
import time

from trajserve.sampling import SamplingParams

MODES = ("keep", "host", "host-serial", "disk", "disk-serial", "drop")
ONE = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)


def run(args: argparse.Namespace) -> int:
    modes = [m for m in args.modes.split(",") if m]
    bad = [m for m in modes if m not in MODES]
    if bad:
        raise ValueError(f"unknown mode(s) {bad}; choose from {','.join(MODES)}")
    # Imported here, not at the top: `trajserve` builds this parser for every
    # command, and torch alone costs ~3 s that `plan` and `simulate` never use.
    import torch

    from trajserve.bench.common import command_line, machine_info
    from trajserve.llm import LLM
    from trajserve.sessions.config import SessionConfig
    from trajserve.sessions.manager import SessionManager

    eng = LLM.from_args(args).engine
    g = torch.Generator().manual_seed(args.seed)
    vocab = eng.model_config.vocab_size
    history = torch.randint(100, vocab - 100, (args.history_tokens,), generator=g).tolist()
    obs = torch.randint(100, vocab - 100, (args.observation_tokens,), generator=g).tolist()
    rows: dict[str, dict] = {}
    first_tokens: dict[str, set[int]] = {}
    samples: dict[str, list[float]] = {m: [] for m in modes}
    copy_s: dict[str, list[float]] = {m: [] for m in modes}
    waited_s: dict[str, list[float]] = {m: [] for m in modes}
    for rep in range(args.repeats + 1):  # the first round warms up and is not counted
        for mode in modes:
            tier = mode.split("-")[0]
            mgr = SessionManager(eng, SessionConfig(overlap_reload=not mode.endswith("serial")))
            eng.kv.clear_cache()
            s = mgr.open(history)
            s.generate(ONE)
            s.pause(decision=tier)
            mgr.flush()  # the save has landed: the state is where the decision put it
            t = time.perf_counter()
            s.resume(obs)
            out = s.generate(ONE)
            dt = time.perf_counter() - t
            mgr.flush()
            st = mgr.stats
            if rep:
                samples[mode].append(dt)
                copy_s[mode].append(st.swap_in_s)
                waited_s[mode].append(st.resume_stall_s)
            first_tokens.setdefault(mode, set()).add(out.outputs[0].token_ids[0])
            mgr.shutdown()
    eng.kv.clear_cache()
    firsts = {t for ts in first_tokens.values() for t in ts}
    for mode in modes:
        rows[mode] = {"resume_to_first_token_s": statistics.median(samples[mode]),
                      "reload_copy_s": statistics.median(copy_s[mode]),
                      "stalled_s": statistics.median(waited_s[mode]),
                      "samples": samples[mode]}
    base = rows.get("keep", {}).get("resume_to_first_token_s")
    result = {"command": command_line(), "machine": machine_info(), "history_tokens": args.history_tokens,
              "observation_tokens": args.observation_tokens, "repeats": args.repeats,
              "same_first_token": len(firsts) == 1, "modes": rows}
    if args.json:
        print(json.dumps(result, indent=2))
    else:
        print(f"resume of a {args.history_tokens:,}-token session with a {args.observation_tokens}-token "
              f"observation, median of {args.repeats}")
        print(f"{'mode':<12} {'resume->1st token':>18} {'x keep':>7} {'reload copy':>12} {'stalled':>9}")
        for mode, r in rows.items():
            ratio = f"{r['resume_to_first_token_s'] / base:.2f}" if base else "-"
            print(f"{mode:<12} {r['resume_to_first_token_s'] * 1e3:>15.1f} ms {ratio:>7} "
                  f"{r['reload_copy_s'] * 1e3:>9.1f} ms {r['stalled_s'] * 1e3:>6.1f} ms")
        print(f"same first token in every mode: {result['same_first_token']}")
        print(json.dumps(result))
    return 0 if result["same_first_token"] else 1


def add_parser(bsub) -> None:
    r = bsub.add_parser("resume", help="resume-to-first-token by tier: keep / host / disk (overlapped or serial) / drop")
    r.add_argument("--history-tokens", type=int, default=3000)
    r.add_argument("--observation-tokens", type=int, default=400)
    r.add_argument("--modes", default=",".join(MODES))
    r.add_argument("--repeats", type=int, default=5)
    r.add_argument("--json", action="store_true", help="print only JSON")
    from trajserve.engine.options import add_engine_args  # --seed is among them: the token draw uses it

    add_engine_args(r)
    r.set_defaults(func=run)
