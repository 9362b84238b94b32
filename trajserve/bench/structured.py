"""`trajserve bench structured`: what holding replies to a JSON schema costs.

The same decode batch with and without a structured output (a JSON schema),
alternated round by round in one process (this machine's speed drifts):
median decode-step time over the steps where the whole batch is decoding,
and the sampler's share of it (where the mask is computed and applied).
Prints a table, then JSON.
"""
from __future__ import annotations

import argparse
import json
import statistics

SCHEMA = {"type": "object", "properties": {"items": {"type": "array", "items": {
    "type": "object", "properties": {"name": {"type": "string"}, "qty": {"type": "integer"}},
    "required": ["name", "qty"]}}}, "required": ["items"]}


def _round(engine, batch: int, steps: int, structured) -> list[tuple[float, float, float]]:
    import time

    from trajserve.sampling import SamplingParams

    sp = SamplingParams(max_tokens=steps, temperature=0, ignore_eos=True, structured=structured)
    for i in range(batch):
        engine.add_request(f"Order {i}: list the groceries as JSON.", sp)
    out = []
    while engine.has_unfinished_requests():
        t = time.perf_counter()
        engine.step()
        dt, st = time.perf_counter() - t, engine.last_step
        if st.num_tokens == st.num_seqs == batch:  # a decode step of the whole batch
            out.append((dt, st.sample, st.forward))
    return out


def run(args: argparse.Namespace) -> int:
    # Imported here: `trajserve` builds this parser for every command.
    from trajserve.bench.common import command_line, machine_info
    from trajserve.llm import LLM
    from trajserve.structured import StructuredOutput

    engine = LLM.from_args(args).engine
    so = StructuredOutput(json_schema=SCHEMA)
    rows = []
    for batch in [int(b) for b in args.batch_sizes.split(",")]:
        _round(engine, batch, 4, None)  # warm-up
        _round(engine, batch, 4, so)  # and the vocabulary index, the schema's compile
        free, held = [], []
        for _ in range(args.repeats):
            free += _round(engine, batch, args.steps, None)
            held += _round(engine, batch, args.steps, so)
        med = {k: [statistics.median(x[j] for x in v) * 1e3 for j in range(3)] + [len(v)]
               for k, v in (("free", free), ("json", held))}
        rows.append({"batch": batch, **{f"{q}_ms_{k}": med[k][j] for k in med
                                        for j, q in enumerate(("step", "sample", "forward"))},
                     "steps_free": med["free"][3], "steps_json": med["json"][3],
                     "step_ratio": med["json"][0] / med["free"][0]})
    if not args.json:
        print(f"decode steps with the whole batch running, median over {args.repeats} alternated rounds")
        print(f"{'batch':>5} {'step free':>10} {'step json':>10} {'ratio':>6} {'forward free':>13} "
              f"{'forward json':>13} {'sampler free':>13} {'sampler json':>13} {'steps':>9}")
        for r in rows:
            print(f"{r['batch']:>5} {r['step_ms_free']:>8.1f}ms {r['step_ms_json']:>8.1f}ms {r['step_ratio']:>6.3f} "
                  f"{r['forward_ms_free']:>11.1f}ms {r['forward_ms_json']:>11.1f}ms "
                  f"{r['sample_ms_free']:>11.2f}ms {r['sample_ms_json']:>11.2f}ms "
                  f"{r['steps_free']:>4}/{r['steps_json']:<4}")
    print(json.dumps({"command": command_line(), "machine": machine_info(), "schema": SCHEMA, "rows": rows}))
    return 0


def add_parser(bsub) -> None:
    p = bsub.add_parser("structured", help="decode-step cost of a JSON-schema structured output vs none")
    p.add_argument("--batch-sizes", default="1,8")
    p.add_argument("--steps", type=int, default=40, help="max tokens per request (a schema may end sooner)")
    p.add_argument("--repeats", type=int, default=4)
    p.add_argument("--json", action="store_true", help="print only JSON")
    from trajserve.engine.options import add_engine_args

    add_engine_args(p)
    p.set_defaults(func=run)
