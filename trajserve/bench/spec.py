"""`trajserve bench spec`: speculative decoding on and off.

One engine, one process; each case runs with the proposer and without,
alternated round by round (this machine's speed drifts by tens of percent
over minutes, so the two sides of a ratio are taken seconds apart). Before
the first round every case's prompts are prefilled once, so the measured
passes hit the prefix cache and time what speculation changes: decoding.

Cases:
  edit-b1 / edit-b8   an agent's edit turn: the tool result is a file of
                      300-1,500 tokens (prose: stdlib docstrings, which the
                      embedded model copies when asked), the reply rewrites
                      it with a few changes; 3 requests one at a time / 16
                      with 8 in flight (continuous batching);
  free-b1 / free-b8   free text with little repetition (stories, answers):
                      3 one at a time / 16 with 8 in flight;
  agent               the multi-turn `bench agent` workload (shared tool
                      preamble, pytest-like tool logs), replayed turn-major
                      one request at a time with longer replies.

Per case: output tokens/s without and with speculation, the speed-up (the
median of the rounds' ratios), the acceptance rate and the mean tokens a
verified round output (its accepted drafts + the target's own), and whether
every output was identical with and without (greedy).
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import inspect
import json
import random
import statistics
import time

from trajserve.bench.agent_workload import preamble, task, tool_result
from trajserve.sampling import SamplingParams

TARGETS = {"edit-b1": 2.5, "edit-b8": 1.5, "free-b1": 0.95, "free-b8": 0.95}
_DOCS = ("argparse", "json", "textwrap", "logging", "unittest", "pickle", "string", "csv", "shutil", "socket",
         "subprocess", "tarfile", "zipfile", "threading", "heapq", "bisect", "inspect", "difflib")
_EDITS = (("the", "THE"), ("is", "IS"), ("and", "plus"), ("a", "one"), ("of", "OF"), ("to", "into"))
_FREE = ("Write a short story about a lighthouse keeper who finds a message in a bottle.",
         "Explain how a refrigerator works to a ten-year-old.",
         "Describe a walk through a busy market in a city you imagine.",
         "What are the trade-offs between trains and planes for a 500 km trip?",
         "Write a poem about the first snow of winter.",
         "Give advice to someone starting to learn the piano as an adult.",
         "Describe the life cycle of a star.",
         "Invent a board game and explain its rules.")


def _prose(tokenizer, target: int, offset: int) -> str:
    """About `target` tokens of English prose: stdlib module docstrings
    (fixed for the interpreter's version), cut at a line end."""
    import importlib

    lines: list[str] = []
    for name in _DOCS[offset:] + _DOCS[:offset]:
        doc = inspect.getdoc(importlib.import_module(name)) or ""
        lines.extend(line for line in doc.splitlines() if line.strip())
    out, n = [], 0
    for line in lines:
        n += len(tokenizer.encode(line + "\n", add_special_tokens=False))
        if n > target:
            break
        out.append(line)
    return "\n".join(out)


def edit_prompt(tokenizer, target: int, i: int) -> tuple[list[int], int]:
    """An edit turn's prompt and its reply budget (the file's length)."""
    text = _prose(tokenizer, target, i)
    a, b = _EDITS[i % len(_EDITS)]
    conv = [{"role": "system", "content": "You are a coding agent. You read files with tools and rewrite them."},
            {"role": "user", "content": "Open notes.txt."},
            {"role": "assistant", "content": '{"tool": "read_file", "path": "notes.txt"}'},
            {"role": "user", "content": f"Tool output (notes.txt):\n\n{text}\n\nRewrite notes.txt with the word "
                                        f"'{a}' replaced by '{b}'. Repeat the whole file."}]
    return tokenizer.encode_chat(conv), len(tokenizer.encode(text, add_special_tokens=False))


def agent_prompts(engine, trajectories: int, turns: int, reply: int) -> list[list[int]]:
    """`bench agent`'s conversations, turn-major; each turn's prompt holds the
    replies of the turns before (greedy, without speculation: both sides
    replay the same prompts)."""
    tok, rng = engine.tokenizer, random.Random(0)
    pre = preamble(tok, 600)
    convs = [[{"role": "system", "content": pre}, {"role": "user", "content": task(i)}] for i in range(trajectories)]
    prompts = []
    for turn in range(turns):
        for conv in convs:
            if turn:
                conv.append({"role": "user", "content": "Tool output:\n" + tool_result(tok, rng, rng.randint(100, 400))})
            ids = tok.encode_chat(conv)
            prompts.append(ids)
            out = _run(engine, [ids], [SamplingParams(max_tokens=reply, temperature=0)], 1)[0]
            conv.append({"role": "assistant", "content": tok.decode(out)})
    return prompts


def _run(engine, prompts: list[list[int]], params: list[SamplingParams], batch: int) -> list[list[int]]:
    """Greedy outputs of prompts, in order, with up to `batch` in flight: a
    request is added as soon as one finishes (continuous batching, as a
    server with that many clients sees it)."""
    outs: dict[str, list[int]] = {}
    order: list[str] = []
    pending = list(zip(prompts, params))[::-1]
    inflight = 0
    while pending or engine.has_unfinished_requests():
        while pending and inflight < batch:
            p, sp = pending.pop()
            order.append(engine.add_request(p, sp))
            inflight += 1
        for out in engine.step():
            if out.finished:
                outs[out.request_id] = list(out.outputs[0].token_ids)
                inflight -= 1
    return [outs[i] for i in order]


def build_cases(engine, args) -> list[dict]:
    tok = engine.tokenizer
    cases = []
    b1 = [edit_prompt(tok, n, i) for i, n in enumerate((300, 700, 1500))]
    b8 = [edit_prompt(tok, 300 + 10 * i, i) for i in range(16)]
    cap = args.max_tokens
    for name, items, batch in (("edit-b1", b1, 1), ("edit-b8", b8, 8)):
        cases.append({"name": name, "batch": batch, "prompts": [p for p, _ in items],
                      "params": [SamplingParams(max_tokens=min(n + 16, cap), temperature=0) for _, n in items]})
    for name, batch, n in (("free-b1", 1, 3), ("free-b8", 8, 16)):
        prompts = [tok.encode_chat([{"role": "user", "content": f"{_FREE[i % len(_FREE)]}{' Be brief.' * (i // 8)}"}])
                   for i in range(n)]
        cases.append({"name": name, "batch": batch, "prompts": prompts,
                      "params": [SamplingParams(max_tokens=min(128, cap), temperature=0)] * n})
    if args.agent_trajectories:
        prompts = agent_prompts(engine, args.agent_trajectories, args.agent_turns, 48)
        cases.append({"name": "agent", "batch": 1, "prompts": prompts,
                      "params": [SamplingParams(max_tokens=48, temperature=0)] * len(prompts)})
    return cases


def run(args: argparse.Namespace) -> int:
    from trajserve.bench.common import command_line, machine_info  # imports torch: not at parser build
    from trajserve.engine.options import config_from_args
    from trajserve.engine.engine import LLMEngine

    cfg = config_from_args(args)
    if cfg.scheduler.speculative not in ("ngram", "suffix"):  # auto / off: the bench measures ngram against none
        cfg = dataclasses.replace(cfg, scheduler=dataclasses.replace(cfg.scheduler, speculative="ngram"))
    engine = LLMEngine(cfg)
    proposer = engine.proposer
    cases = build_cases(engine, args)
    for c in cases:  # the prompts into the prefix cache: measured passes time decoding
        with engine.scheduler.without_drafts():
            _run(engine, c["prompts"], [SamplingParams(max_tokens=1)] * len(c["prompts"]), c["batch"])
    rows = {c["name"]: {"off_s": [], "on_s": [], "tokens": 0, "identical": True, "ref": None,
                        "drafts": 0, "draft_tokens": 0, "accepted": 0} for c in cases}
    for r in range(args.rounds):
        for c in cases:
            row = rows[c["name"]]
            for mode in (("off", "on") if r % 2 == 0 else ("on", "off")):
                before = (proposer.num_drafts, proposer.num_draft_tokens, proposer.num_accepted_tokens)
                with engine.scheduler.without_drafts() if mode == "off" else contextlib.nullcontext():
                    t = time.perf_counter()
                    outs = _run(engine, c["prompts"], c["params"], c["batch"])
                    row[f"{mode}_s"].append(time.perf_counter() - t)
                if mode == "on":
                    row["drafts"] += proposer.num_drafts - before[0]
                    row["draft_tokens"] += proposer.num_draft_tokens - before[1]
                    row["accepted"] += proposer.num_accepted_tokens - before[2]
                if row["ref"] is None:
                    row["ref"] = outs
                    row["tokens"] = sum(len(o) for o in outs)
                row["identical"] &= outs == row["ref"]
    out_cases = []
    for c in cases:
        row = rows[c["name"]]
        ratios = [off / on for off, on in zip(row["off_s"], row["on_s"])]
        n = row["tokens"]
        out_cases.append({
            "name": c["name"], "batch": c["batch"], "requests": len(c["prompts"]), "output_tokens": n,
            "off_tok_s": n / statistics.median(row["off_s"]), "on_tok_s": n / statistics.median(row["on_s"]),
            "speedup": statistics.median(ratios), "speedup_rounds": ratios,
            "acceptance_rate": row["accepted"] / row["draft_tokens"] if row["draft_tokens"] else None,
            "mean_accepted": 1 + row["accepted"] / row["drafts"] if row["drafts"] else None,
            "identical": row["identical"], "target": TARGETS.get(c["name"]),
            "meets_target": None if c["name"] not in TARGETS else statistics.median(ratios) >= TARGETS[c["name"]]})
    res = {"command": command_line(), "machine": machine_info(), "engine": engine.startup_summary,
           "rounds": args.rounds, "max_draft": proposer.config.max_draft, "cases": out_cases,
           "step_ms": proposer.metrics()["step_ms"]}
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print_report(res)
    engine.close()
    return 0 if all(c["identical"] for c in out_cases) else 1


def print_report(res: dict) -> None:
    print(res["engine"])
    print(f"\nspeculative decoding (ngram, drafts up to {res['max_draft']} tokens), {res['rounds']} alternated rounds")
    print("measured step time (rows: ms): " + ", ".join(f"{r}: {ms:.1f}" for r, ms in list(res["step_ms"].items())[:20]))
    print(f"{'case':<9} {'batch':>5} {'tokens':>7} {'off tok/s':>10} {'on tok/s':>9} {'speed-up':>9} "
          f"{'target':>7} {'accept':>7} {'mean N':>7} {'identical':>9}")
    for c in res["cases"]:
        acc = "-" if c["acceptance_rate"] is None else f"{c['acceptance_rate']:.2f}"
        mn = "-" if c["mean_accepted"] is None else f"{c['mean_accepted']:.2f}"
        tgt = "-" if c["target"] is None else f">={c['target']:g}"
        print(f"{c['name']:<9} {c['batch']:>5} {c['output_tokens']:>7} {c['off_tok_s']:>10.1f} {c['on_tok_s']:>9.1f} "
              f"{c['speedup']:>8.2f}x {tgt:>7} {acc:>7} {mn:>7} {str(c['identical']):>9}")


def add_parser(bsub) -> None:
    from trajserve.engine.options import add_engine_args

    s = bsub.add_parser("spec", help="speculative decoding on vs off, alternated: edit-heavy agent turns, free "
                        "text, the agent workload (speed-up, acceptance, identical output)")
    s.add_argument("--rounds", type=int, default=2, help="alternated rounds (each runs every case on and off)")
    s.add_argument("--max-tokens", type=int, default=400, help="cap on an edit reply's tokens")
    s.add_argument("--agent-trajectories", type=int, default=3, help="0: no agent case")
    s.add_argument("--agent-turns", type=int, default=3)
    s.add_argument("--json", action="store_true", help="print only JSON")
    add_engine_args(s)
    s.set_defaults(func=lambda a: run(a))
