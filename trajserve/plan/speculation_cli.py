"""`trajserve plan spec`: what speculative decoding gains for an acceptance
profile and a step cost (trajserve/plan/speculation.py; 8.5.2-8.5.4)."""
from __future__ import annotations

import argparse
import json


def _floats(text: str) -> list[float]:
    try:
        return [float(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated numbers, got {text!r}") from None


def _ints(text: str) -> list[int]:
    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def add_spec_parser(p: argparse.ArgumentParser) -> None:
    p.add_argument("--accept", type=_floats, required=True,
                   help="acceptance probability a, or a profile a_1,a_2,... (each given all before it were "
                        "accepted; the last repeats)")
    p.add_argument("--draft-len", type=_ints, default=[1, 2, 4, 8], help="draft lengths m to compare")
    p.add_argument("--verify-ms", type=float, required=True, help="one verify step (target forward), ms")
    p.add_argument("--plain-ms", type=float, default=None, help="one plain decode step, ms (default: --verify-ms)")
    p.add_argument("--query-ms", type=float, default=0.0, help="a draft lookup per round, ms")
    p.add_argument("--draft-ms", type=float, default=0.0, help="drafting per draft token (a draft model), ms")
    p.add_argument("--draft-group", type=int, default=1,
                   help="draft positions run in groups of this many (a fixed execution shape)")
    p.add_argument("--setup-ms", type=float, default=0.0, help="one-off setup, e.g. building the index, ms")
    p.add_argument("--output-tokens", type=int, default=0, help="a request's output, for its total time")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.set_defaults(func=cmd_spec)


def cmd_spec(args: argparse.Namespace) -> int:
    from trajserve.plan.speculation import plan_speculation

    accept = args.accept[0] if len(args.accept) == 1 else args.accept
    r = plan_speculation(accept, args.draft_len, args.verify_ms, query_ms=args.query_ms, draft_ms=args.draft_ms,
                         draft_group=args.draft_group, plain_ms=args.plain_ms, setup_ms=args.setup_ms,
                         output_tokens=args.output_tokens)
    if args.json:
        print(json.dumps(r.to_dict()))
        return 0
    print(f"acceptance {r.accept}; verify {r.verify_ms:g} ms, lookup {r.query_ms:g} ms, draft {r.draft_ms:g} ms a "
          f"position in groups of {r.draft_group}; plain decode {r.plain_ms:g} ms a token\n")
    print(f"{'m':>3} {'E[N]':>7} {'T ms':>8} {'ms/token':>9} {'speed-up':>9} {'dN':>7} {'dT ms':>7} "
          f"{'dT/dN':>8}  longer pays (dT/dN < T/N before)")
    for x in r.lengths:
        per = "-" if x.added_ms_per_token is None else f"{x.added_ms_per_token:.2f}"
        pays = "-" if x.pays is None else ("yes" if x.pays else "no")
        print(f"{x.m:>3} {x.expected_output:>7.3f} {x.round_ms:>8.2f} {x.ms_per_token:>9.2f} "
              f"{r.plain_ms / x.ms_per_token:>8.2f}x {x.added_output:>7.3f} {x.added_ms:>7.2f} {per:>8}  {pays}")
    print(f"\nbest draft length {r.best}; its lookup may take up to {r.query_budget_ms:.1f} ms a round and "
          f"still beat plain decoding")
    if r.setup_ms:
        print(f"a {r.setup_ms:g} ms setup is paid back after {r.setup_break_even_tokens:.0f} output tokens")
    if r.output_tokens:
        print(f"{r.output_tokens} output tokens: {r.plain_request_s:.2f} s plain, {r.spec_request_s:.2f} s with "
              f"speculation (setup included)")
    return 0
